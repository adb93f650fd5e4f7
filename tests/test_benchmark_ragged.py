"""benchmarks/ragged.py: the ragged workload's end rule, its lengths, and a run at a tiny shape.

The script is a benchmark (its timings go to docs/benchmarks.md, not into tests); here the
workload it defines is checked against float64 arithmetic and against both samplers' outputs,
and the script runs end to end at a shape that compiles in seconds.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.inference import generate, generate_continuous
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from benchmarks import ragged

TINY = [
    "--vocab", "64", "--hidden", "16", "--mlp", "32", "--layers", "1", "--heads", "2",
    "--kv-heads", "1", "--head-dim", "8",
]  # fmt: skip


def _tiny_lm(max_positions: int = 128) -> CausalLM:
    config = CausalLMConfig(
        model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=max_positions,
        eos_token_id=ragged.EOS, pad_token_id=ragged.PAD,
    )  # fmt: skip
    return CausalLM(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(("median", "min_new"), [(100.0, 16), (10.0, 4), (7.5, 1)])
def test_the_hazard_gives_the_median(median, min_new):
    p = ragged.hazard(median, min_new)
    steps = median - min_new + 1  # draws that may end the completion, up to the median
    np.testing.assert_allclose(1.0 - (1.0 - np.float64(p)) ** steps, 0.5, rtol=1e-12)


def test_the_end_token_is_impossible_then_p_likely():
    lm = _tiny_lm()
    p, min_new = 0.2, 5
    wrapped = ragged.make_ragged(lm, prompt_length=6, min_new=min_new, p=p)
    hidden = jax.random.normal(jax.random.key(0), (6, 16))
    generated = jnp.asarray([0.0, 1.0, 2.0, 3.0, 4.0, 300.0])  # token indices being drawn
    logits = wrapped.logits_from_hidden(jnp.concatenate([hidden, generated[:, None]], -1))
    z = np.asarray(lm.logits_from_hidden(hidden), np.float64)
    probs = np.exp(np.asarray(logits, np.float64) - np.asarray(logits, np.float64).max(-1)[:, None])
    probs /= probs.sum(-1, keepdims=True)
    eos = probs[:, ragged.EOS]
    np.testing.assert_array_equal(eos[:4], 0.0)  # indices 0-3: lengths 1-4 < min_new
    np.testing.assert_allclose(eos[4:], p, rtol=1e-5)
    # the other tokens keep their relative probabilities
    others = np.delete(probs, ragged.EOS, axis=1)
    ref = np.exp(np.delete(z, ragged.EOS, axis=1))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(others / others.sum(-1, keepdims=True), ref, rtol=1e-5)


def test_the_cache_gives_the_index_of_the_token_drawn():
    lm = _tiny_lm()
    wrapped = ragged.make_ragged(lm, prompt_length=3, min_new=2, p=0.5)
    ids = jnp.asarray([[0, 5, 6, 7], [4, 5, 6, 7]])
    mask = jnp.asarray([[0, 1, 1, 1], [1, 1, 1, 1]])  # row 0 left-padded: its prompt is 3
    cache = wrapped.init_cache(2, 8)
    hidden, cache = wrapped.hidden_states(ids, attention_mask=mask, cache=cache)
    np.testing.assert_array_equal(hidden[:, -1, -1], [0.0, 1.0])
    hidden, cache = wrapped.hidden_states(jnp.asarray([[9], [9]]), cache=cache)
    np.testing.assert_array_equal(hidden[:, -1, -1], [1.0, 2.0])
    np.testing.assert_allclose(hidden[..., :-1], lm.hidden_states(
        jnp.asarray([[0, 5, 6, 7, 9], [4, 5, 6, 7, 9]]),
        attention_mask=jnp.asarray([[0, 1, 1, 1, 1], [1] * 5]),
    )[0][:, -1:], rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("sampler", ["generate", "generate_continuous"])
def test_both_samplers_draw_the_workload_lengths(sampler):
    min_new, median, max_new, prompt_length = 4, 10.0, 64, 6
    lm = _tiny_lm()
    wrapped = ragged.make_ragged(lm, prompt_length, min_new, ragged.hazard(median, min_new))
    prompts = np.random.default_rng(0).integers(2, 64, (16, prompt_length)).astype(np.int32)
    kw = dict(key=jax.random.key(3), num_generations=8, max_new_tokens=max_new, temperature=1.0)
    if sampler == "generate":
        out = generate(wrapped, prompts, **kw)
    else:
        out = generate_continuous(wrapped, prompts, num_slots=16, steps_per_call=8, **kw)
    lengths = np.asarray(out.lengths)
    ids = np.asarray(out.completion_ids)
    assert lengths.min() >= min_new and lengths.max() <= max_new
    ended = ~np.asarray(out.truncated)
    assert (ids[np.flatnonzero(ended), lengths[ended] - 1] == ragged.EOS).all()
    for row, n in enumerate(lengths):  # no end token before a completion's last one
        assert not (ids[row, : n - 1] == ragged.EOS).any()
    # 128 lengths of min_new - 1 + Geometric(p): the median's standard error is about 1.2
    assert 6 <= np.median(lengths) <= 14


def test_the_script_runs_at_a_tiny_shape_and_reprints_its_table(tmp_path, capsys):
    out = tmp_path / "ragged.json"
    args = [
        *TINY, "--prompts", "2", "--k", "2", "--prompt-length", "4", "--max-new", "16",
        "--min-new", "2", "--median", "5", "--slots", "2", "--steps-per-call", "4",
        "--update-prompts", "1", "--windows", "1", "--max-retries", "0", "--clean", "1",
        "--no-peer", "--json", str(out),
    ]  # fmt: skip
    assert ragged.main(args) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert set(record["results"]) == {
        "rollout/new", "rollout/old", "update/new", "update/old", "update/trimmed",
    }  # fmt: skip
    for name, runs in record["results"].items():
        assert len(runs) == 2 and all(r["tokens"] > 0 and r["seconds"] > 0 for r in runs), name
    assert record["update_batch"]["rows"] == 2
    lengths = np.asarray(record["lengths"]["key 0"])
    assert lengths.min() >= 2 and lengths.max() <= 16
    table = [line for line in printed.splitlines() if line.startswith("| rollout/new")]
    assert len(table) == 1
    assert ragged.main(["--from-json", str(out)]) == 0
    assert table[0] in capsys.readouterr().out
