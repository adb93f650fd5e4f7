"""Tests for artifex/generative_models/models/causal_lm/tokenizer.py against transformers."""

from __future__ import annotations

import json

import jinja2
import numpy as np
import pytest

from artifex.generative_models.models.causal_lm import Tokenizer, render_chat_template

from ._helpers import FIXTURES

EXPECTED = json.loads((FIXTURES / "tokenizer_tiny" / "expected.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(FIXTURES / "tokenizer_tiny")


def test_special_ids(tok):
    assert tok.bos_id == EXPECTED["bos_id"]
    assert tok.eos_ids == tuple(EXPECTED["eos_ids"]) and tok.eos_ids[0] == EXPECTED["eos_id"]
    assert tok.pad_id == EXPECTED["pad_id"]
    assert tok.vocab_size == len(tok) == EXPECTED["vocab_size"]


@pytest.mark.parametrize("case", EXPECTED["encode"], ids=lambda c: repr(c["text"])[:20])
def test_encode_matches_transformers(tok, case):
    assert tok.encode(case["text"], add_special_tokens=case["add_special_tokens"]) == case["ids"]


def test_encode_batch(tok):
    cases = [c for c in EXPECTED["encode"] if c["add_special_tokens"]]
    assert tok.encode_batch([c["text"] for c in cases]) == [c["ids"] for c in cases]


@pytest.mark.parametrize("case", EXPECTED["decode"], ids=lambda c: str(c["ids"][:4]))
def test_decode_matches_transformers(tok, case):
    assert tok.decode(case["ids"], skip_special_tokens=case["skip_special_tokens"]) == case["text"]


def test_batch_decode_accepts_arrays(tok):
    cases = [c for c in EXPECTED["decode"] if c["skip_special_tokens"] and len(c["ids"]) == 4]
    rows = np.array([c["ids"] for c in cases], np.int32)
    assert tok.batch_decode(rows) == [c["text"] for c in cases]


@pytest.mark.parametrize(
    "case",
    EXPECTED["chat"],
    ids=lambda c: f"{len(c['messages'])}msg-gen{c['add_generation_prompt']}-{bool(c['kwargs'])}",
)
def test_chat_template_matches_transformers(tok, case):
    kwargs = dict(case["kwargs"])
    text = tok.apply_chat_template(
        case["messages"],
        add_generation_prompt=case["add_generation_prompt"],
        tokenize=False,
        **kwargs,
    )
    assert text == case["text"]
    ids = tok.apply_chat_template(
        case["messages"], add_generation_prompt=case["add_generation_prompt"], **kwargs
    )
    assert ids == case["ids"]


def test_chat_template_batched_and_errors(tok):
    cases = [c for c in EXPECTED["chat"] if not c["kwargs"] and not c["add_generation_prompt"]]
    assert tok.apply_chat_template([c["messages"] for c in cases], tokenize=False) == [
        c["text"] for c in cases
    ]
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown role: tool"):
        tok.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]
        )
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])


def test_none_values_dropped_and_globals():
    template = (
        "{% for m in messages %}{{ m.role }}{% if m.content is defined %}={{ m.content }}"
        "{% endif %};{% endfor %}{{ strftime_now('%Y') | length }}{{ {'a': '<b>'} | tojson }}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    out = render_chat_template(
        template, [{"role": "user", "content": None}, {"role": "a", "content": 1}]
    )
    assert out == 'user;a=1;4{"a": "<b>"}01'


def test_pad_batch(tok):
    ids, mask = tok.pad_batch([[5, 6, 7], [8]], length=4)
    pad = tok.pad_id
    np.testing.assert_array_equal(ids, [[pad, 5, 6, 7], [pad, pad, pad, 8]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    ids, mask = tok.pad_batch([[5, 6, 7], [8]], side="right")
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, pad, pad]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 0, 0]])
    with pytest.raises(ValueError, match="row 0 has 3 tokens"):
        tok.pad_batch([[5, 6, 7]], length=2)
    with pytest.raises(ValueError, match="side"):
        tok.pad_batch([[1]], side="middle")


def test_missing_pad_falls_back_to_eos(tmp_path):
    for name in ("tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((FIXTURES / "tokenizer_tiny" / name).read_bytes())
    config = json.loads((FIXTURES / "tokenizer_tiny" / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    config["eos_token"] = {"content": "<|eos|>", "special": True}  # AddedToken dict form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.pad_id == tok.eos_ids[0] == EXPECTED["eos_id"]
    assert tok.eos_ids == (EXPECTED["eos_id"],)  # no generation_config.json here


def test_chat_template_in_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(
        (FIXTURES / "tokenizer_tiny" / "tokenizer.json").read_bytes()
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|bos|>",
                "chat_template": [{"name": "default", "template": "X{{ bos_token }}"}],
            }
        )
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "X<|bos|>"
    )
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_for_characters_roundtrip():
    tok = Tokenizer.for_characters("0123456789+-*= ")
    assert (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
    assert tok.vocab_size == 4 + 15
    ids = tok.encode("12 + 3 = 15")
    assert ids[0] == tok.bos_id and len(ids) == 1 + len("12 + 3 = 15")
    assert tok.decode(ids) == "12 + 3 = 15"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>12 + 3 = 15"
    with_eos = tok.encode("7<eos>", add_special_tokens=False)
    assert with_eos == [tok.encode("7", add_special_tokens=False)[0], 2]
    assert tok.encode("a", add_special_tokens=False) == [3]  # unknown -> <unk>
    template = "{% for m in messages %}{{ m.content }}={% endfor %}"
    tok2 = Tokenizer.for_characters("0123456789+=", add_bos=False, chat_template=template)
    assert tok2.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False) == "1+1="
    assert tok2.encode("1+1") == tok2.encode("1+1", add_special_tokens=False)
    with pytest.raises(ValueError, match="single characters"):
        Tokenizer.for_characters(["ab"])
