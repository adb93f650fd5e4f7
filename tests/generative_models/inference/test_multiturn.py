"""Tests of KV-cache continuation across turns (append, decode a turn, append again)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.inference.multiturn import append_tokens, decode_turn
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig


def _model(seed: int = 0) -> CausalLM:
    config = CausalLMConfig.tiny(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=0,
    )
    return CausalLM(config, rngs=nnx.Rngs(seed))


def _log_softmax64(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_turn_continuation_matches_one_forward_pass(seed: int) -> None:
    """Prompt, turn, tool text, turn, more text: every logit equals the full-sequence pass."""
    model = _model(seed)
    rng = np.random.default_rng(seed)
    rows = 3
    prompts = [list(rng.integers(5, 40, size=n)) for n in (4, 7, 2)]
    cache = model.init_cache(rows, 160)
    cache, logits = append_tokens(model, cache, prompts, buckets=(8, 16))
    conv = [list(map(int, p)) for p in prompts]
    sampled = [[] for _ in range(rows)]  # (conversation index, sampler log-prob)
    active = np.array([True, True, True])
    for turn in range(2):
        out = decode_turn(
            model,
            cache,
            logits,
            active,
            key=jax.random.key(seed * 10 + turn),
            max_new_tokens=6,
            temperature=0.7,
            eos_ids=(),
            stop_sequences=((7, 8),),
        )
        toks, mask, lp = (np.asarray(x) for x in (out.tokens, out.mask, out.log_probs))
        cache, logits = out.cache, out.logits
        for r in range(rows):
            n = int(mask[r].sum())
            assert n >= 1 and mask[r, :n].all() and not mask[r, n:].any()
            for t in range(n):
                sampled[r].append((len(conv[r]), float(lp[r, t])))
                conv[r].append(int(toks[r, t]))
        # Different-length appended chunks (row 1 appends nothing in the second turn).
        extra = [list(rng.integers(5, 40, size=n)) for n in (5, 0 if turn else 3, 9)]
        cache, logits = append_tokens(model, cache, extra, logits, buckets=(8, 16))
        conv = [c + [int(x) for x in e] for c, e in zip(conv, extra, strict=True)]
    for r in range(rows):
        full = np.asarray(model(jnp.asarray([conv[r]], jnp.int32)))[0]
        # the logits after the whole conversation equal the single forward pass
        np.testing.assert_allclose(np.asarray(logits[r]), full[-1], rtol=2e-4, atol=2e-4)
        # every sampled token's log-prob equals log_softmax(z / tau) of the full pass
        ref = _log_softmax64(full / 0.7)
        for i, lp_i in sampled[r]:
            np.testing.assert_allclose(lp_i, ref[i - 1, conv[r][i]], rtol=1e-4, atol=1e-4)


def test_decode_turn_stops_on_stop_sequence_and_eos() -> None:
    model = _model(3)
    cache = model.init_cache(4, 64)
    cache, logits = append_tokens(model, cache, [[5, 6], [7], [9, 9, 9], [11]])
    out = decode_turn(
        model,
        cache,
        logits,
        np.array([True, True, True, False]),
        key=jax.random.key(0),
        max_new_tokens=20,
        temperature=1.0,
        eos_ids=(2,),
        stop_sequences=((5,), (6, 7)),
    )
    toks, mask = np.asarray(out.tokens), np.asarray(out.mask)
    assert not mask[3].any()  # inactive row generates nothing
    for r in range(3):
        seq = list(toks[r, : int(mask[r].sum())])
        if bool(out.eos[r]):
            assert seq[-1] == 2
        elif bool(out.stopped[r]):
            assert seq[-1] == 5 or seq[-2:] == [6, 7]
        else:
            assert len(seq) == 20
        # nothing stops earlier than where it stopped
        for t in range(len(seq) - 1):
            assert seq[t] not in (2, 5) and seq[t : t + 2] != [6, 7]


def test_append_and_decode_check_capacity() -> None:
    model = _model()
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="free slots"):
        append_tokens(model, cache, [[1] * 9], buckets=None)
    cache, logits = append_tokens(model, cache, [[1] * 4], buckets=None)
    with pytest.raises(ValueError, match="free slots"):
        decode_turn(model, cache, logits, np.array([True]), key=jax.random.key(0), max_new_tokens=5)
    with pytest.raises(ValueError, match="empty"):
        append_tokens(model, cache, [[]], logits)
    turn = dict(key=jax.random.key(0), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"decode_turn: limit must be an int, got 1.0"):
        decode_turn(model, cache, logits, np.array([True]), limit=1.0, **turn)
    with pytest.raises(ValueError, match=r"decode_turn: limit must be an int in \[1, 2\]"):
        decode_turn(model, cache, logits, np.array([True]), limit=3, **turn)
    with pytest.raises(TypeError, match="decode_turn: temperature must be a real number"):
        decode_turn(model, cache, logits, np.array([True]), temperature=None, **turn)
    with pytest.raises(ValueError, match="decode_turn: temperature must be a number >= 0"):
        decode_turn(model, cache, logits, np.array([True]), temperature=-1.0, **turn)


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_turn_stops_where_the_decoded_text_first_holds_a_stop_string(seed: int) -> None:
    """With a ``stop_table``, each row stops at the first token after which ``decode`` of its
    turn contains a stop string, whatever tokens wrote it; rows that run to the limit never
    contain one."""
    from artifex.generative_models.inference.stop_strings import stop_string_table
    from artifex.generative_models.models.causal_lm import Tokenizer

    # 4 special tokens and 36 characters: the model's 40 ids
    tok = Tokenizer.for_characters("abcdefghijklmnopqrstuvwxyz0123456789")
    assert tok.vocab_size == 40
    stops = ["ab", "c", "<eos>x"]
    table = stop_string_table(tok, stops)
    model = _model(seed)
    rows = 16
    cache, logits = append_tokens(model, model.init_cache(rows, 64), [[5, 6]] * rows)
    out = decode_turn(
        model,
        cache,
        logits * 0.0,  # uniform first token
        np.ones(rows, bool),
        key=jax.random.key(seed),
        max_new_tokens=24,
        temperature=3.0,
        stop_table=jnp.asarray(table),
    )
    toks, mask, stopped = np.asarray(out.tokens), np.asarray(out.mask), np.asarray(out.stopped)
    hits = 0
    for r in range(rows):
        seq = [int(t) for t in toks[r, : int(mask[r].sum())]]
        texts = [tok.decode(seq[: i + 1], skip_special_tokens=False) for i in range(len(seq))]
        first = next((i for i, t in enumerate(texts) if any(s in t for s in stops)), None)
        if stopped[r]:
            assert first == len(seq) - 1
            hits += 1
        else:
            assert first is None and len(seq) == 24
    assert 4 <= hits < rows


def test_decode_turn_checks_its_stop_table() -> None:
    model = _model()
    cache, logits = append_tokens(model, model.init_cache(1, 16), [[3, 4]])
    turn = dict(key=jax.random.key(0), max_new_tokens=2)
    active = np.array([True])
    with pytest.raises(ValueError, match=r"stop_table must have shape \(S >= 2, 40\)"):
        decode_turn(model, cache, logits, active, stop_table=np.zeros((3, 39), np.int32), **turn)
    with pytest.raises(TypeError, match="2-D integer array"):
        decode_turn(model, cache, logits, active, stop_table=np.zeros((3, 40)), **turn)
    with pytest.raises(ValueError, match="states outside"):
        decode_turn(model, cache, logits, active, stop_table=np.full((3, 40), 3), **turn)
