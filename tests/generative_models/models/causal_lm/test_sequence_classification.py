"""CausalLMForSequenceClassification against transformers' *ForSequenceClassification scores.

Fixtures: tests/fixtures/reward_models/, made by tests/fixtures/make_reward_model_fixtures.py.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import (
    CausalLMConfig,
    CausalLMForSequenceClassification,
    last_token_index,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures")
RM = os.path.join(FIXTURES, "reward_models")
TOL = 1e-4


def _expected(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(os.path.join(RM, name, "expected.npz")))


@pytest.mark.parametrize("name", ["llama_rm", "qwen2_rm"])
def test_scores_equal_transformers_with_right_and_left_padding(name):
    model = CausalLMForSequenceClassification.from_pretrained(os.path.join(RM, name))
    e = _expected(name)
    right = model(jnp.asarray(e["right_ids"]), jnp.asarray(e["right_mask"]))
    np.testing.assert_allclose(np.asarray(right), e["right_scores"], atol=TOL, rtol=0)
    left = model(jnp.asarray(e["left_ids"]), jnp.asarray(e["left_mask"]))  # default positions
    np.testing.assert_allclose(np.asarray(left), e["left_scores"], atol=TOL, rtol=0)
    arange = jnp.broadcast_to(jnp.arange(e["left_ids"].shape[1]), e["left_ids"].shape)
    left_hf = model(jnp.asarray(e["left_ids"]), jnp.asarray(e["left_mask"]), arange)
    np.testing.assert_allclose(np.asarray(left_hf), e["left_arange_scores"], atol=TOL, rtol=0)
    assert right.shape == (e["right_ids"].shape[0], model.num_labels)
    # The fixture's scores differ between rows far beyond the tolerance (the test can fail).
    assert np.ptp(e["right_scores"][:, 0]) > 100 * TOL


def test_scores_without_a_pad_token_equal_transformers_row_by_row():
    model = CausalLMForSequenceClassification.from_pretrained(os.path.join(RM, "qwen3_rm"))
    assert model.config.pad_token_id is None
    e = _expected("qwen3_rm")
    # transformers scores one unpadded row at a time; here the batch is right-padded and the
    # mask picks each row's last token.
    batch = model(jnp.asarray(e["right_ids"]), jnp.asarray(e["right_mask"]))
    np.testing.assert_allclose(np.asarray(batch), e["single_scores"], atol=TOL, rtol=0)
    n = int(e["lengths"][0])
    one = model(jnp.asarray(e["right_ids"][:1, :n]))
    np.testing.assert_allclose(np.asarray(one), e["single_scores"][:1], atol=TOL, rtol=0)


def _last_token_reference(ids: np.ndarray, pad: int | None, mask: np.ndarray) -> np.ndarray:
    """transformers' rule, row by row in plain Python (the rightmost non-pad token)."""
    out = []
    for row, m in zip(ids, mask, strict=True):
        keep = (row != pad) if pad is not None else (m != 0)
        found = [t for t in range(len(row)) if keep[t]]
        out.append(found[-1] if found else 0)
    return np.asarray(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pad", [0, 3, None])
def test_last_token_index_matches_a_reference(seed, pad):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 5, size=(16, 9))
    mask = rng.integers(0, 2, size=(16, 9))
    ids[0] = 0 if pad is None else pad  # a row of padding only
    mask[0] = 0
    got = last_token_index(jnp.asarray(ids), pad, jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(got), _last_token_reference(ids, pad, mask))


def test_last_token_index_errors():
    with pytest.raises(ValueError, match="input_ids must be"):
        last_token_index(jnp.zeros((3,), jnp.int32), 0)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        last_token_index(jnp.zeros((2, 3), jnp.int32), None, jnp.zeros((2, 4), jnp.int32))


def test_a_language_model_checkpoint_is_refused_by_name():
    with pytest.raises(ValueError, match=r"no tensor 'score.weight'.*ForCausalLM"):
        CausalLMForSequenceClassification.from_pretrained(os.path.join(FIXTURES, "qwen2_tiny"))


def test_label_count_disagreeing_with_the_config_is_refused(tmp_path):
    src = os.path.join(RM, "llama_rm")
    dst = tmp_path / "rm"
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        config = json.load(f)
    config["id2label"] = {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"declares 3 labels.*2 rows"):
        CausalLMForSequenceClassification.from_pretrained(dst)


def test_constructor_checks_num_labels():
    cfg = CausalLMConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2
    )
    with pytest.raises(ValueError, match="num_labels must be a positive int"):
        CausalLMForSequenceClassification(cfg, 0, rngs=nnx.Rngs(0))
    model = CausalLMForSequenceClassification(cfg, 3, rngs=nnx.Rngs(0))
    assert model.score.kernel.shape == (8, 3)
    assert model.model.lm_head is None  # a classifier has no language-model head
