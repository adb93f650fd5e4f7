"""Decoding in concurrent row groups: the draws of one run, checked arguments, the auto rule."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.inference import sampling
from artifex.generative_models.inference.sampling import auto_row_groups, generate, sample_logits
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from tests.generative_models.inference.test_sampling import model, np_logsoftmax

__all__ = ["model"]  # the tiny model fixture of the sampler's tests, used here too


def prompts():
    ids = np.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5], [0, 0, 0, 0, 9], [0, 8, 7, 6, 5]], np.int32)
    return ids, (ids != 0).astype(np.int32)


# ------------------------------------------------------------------ sample_logits on row slices
@pytest.mark.parametrize("kw", [{}, {"top_k": 5}, {"top_p": 0.7}, {"temperature": 0.5}], ids=str)
def test_row_slices_draw_what_the_whole_batch_draws(kw):
    logits = jax.random.normal(jax.random.key(0), (12, 50)) * 3.0
    key = jax.random.key(5)
    tokens, logp = sample_logits(logits, key, **kw)
    sliced = jax.jit(
        lambda z, off: sample_logits(z, key, batch_rows=12, row_offset=off, **kw)
    )  # a traced offset, as the sampler passes it
    for off in (0, 4, 8):
        t, lp = sample_logits(logits[off : off + 4], key, batch_rows=12, row_offset=off, **kw)
        np.testing.assert_array_equal(t, tokens[off : off + 4])
        np.testing.assert_array_equal(lp, logp[off : off + 4])
        t, lp = sliced(logits[off : off + 4], jnp.int32(off))
        np.testing.assert_array_equal(t, tokens[off : off + 4])
    with pytest.raises(TypeError, match="row_offset must be an integer scalar, got a traced"):
        jax.jit(lambda z, off: sample_logits(z, key, batch_rows=12, row_offset=off, **kw))(
            logits[:4], jnp.float32(4.0)
        )
    # A slice that does not say where it sits draws the first rows' numbers: other tokens.
    other = [sample_logits(logits[off : off + 4], key, **kw)[0] for off in (4, 8)]
    assert any(
        not np.array_equal(o, tokens[off : off + 4]) for o, off in zip(other, (4, 8), strict=True)
    )


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(batch_rows=3), ValueError, "batch_rows must be an int >= 4, got 3"),
        (dict(batch_rows=8, row_offset=5), ValueError, r"row_offset must be in \[0, 4\]"),
        (dict(batch_rows=8, row_offset=-1), ValueError, "row_offset must be in"),
        (dict(batch_rows=8, row_offset=1.5), TypeError, "row_offset must be an integer"),
        (dict(batch_rows=8.0), TypeError, "batch_rows must be an int"),
        (dict(row_offset=4), ValueError, r"row_offset must be in \[0, 0\]"),  # no batch_rows
        (dict(row_offset="x", greedy=True), TypeError, "row_offset must be an integer"),
    ],
)
def test_bad_row_slices_are_refused(kw, err, match):
    with pytest.raises(err, match=match):
        sample_logits(jnp.zeros((4, 10)), jax.random.key(0), **kw)


# ------------------------------------------------------------------ generate(row_groups=...)
@pytest.mark.parametrize("eos", [(), tuple(range(1, 9))], ids=["no-eos", "eos"])
def test_row_groups_give_the_completions_of_one_run(model, eos):
    ids, mask = prompts()
    kw = dict(key=jax.random.key(11), num_generations=3, max_new_tokens=8, eos_ids=eos)
    one = generate(model, ids, mask, row_groups=1, **kw)
    for groups in (2, 4):
        out = generate(model, ids, mask, row_groups=groups, **kw)
        for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
            np.testing.assert_array_equal(getattr(out, field), getattr(one, field), err_msg=field)
        np.testing.assert_array_equal(out.truncated, one.truncated)
        np.testing.assert_array_equal(out.lengths, one.lengths)
        np.testing.assert_allclose(out.log_probs, one.log_probs, atol=1e-5)
    if eos:  # EOS ends rows early, at different steps, in every group
        lengths = np.asarray(one.lengths)
        assert not np.asarray(one.truncated).all() and len(set(lengths.tolist())) > 2


def test_grouped_log_probs_equal_teacher_forced(model):
    ids, mask = prompts()
    k, n = 2, 6
    out = generate(
        model,
        ids,
        mask,
        key=jax.random.key(2),
        num_generations=k,
        max_new_tokens=n,
        eos_ids=(),
        row_groups=2,
    )
    seq = np.concatenate([np.repeat(ids, k, 0), np.asarray(out.completion_ids)], axis=1)
    full = np.concatenate([np.repeat(mask, k, 0), np.ones((len(seq), n), np.int32)], axis=1)
    logits = np.asarray(model(jnp.asarray(seq), attention_mask=jnp.asarray(full)))
    p = ids.shape[1]
    lp = np_logsoftmax(logits[:, p - 1 : -1])
    want = np.take_along_axis(lp, np.asarray(out.completion_ids)[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.log_probs, want, atol=2e-5)


def test_groups_run_on_threads_of_their_own_with_their_offsets(model, monkeypatch):
    calls = []
    inner = sampling._generate

    def spy(*args, **kwargs):
        calls.append((threading.current_thread().name, int(kwargs["row_offset"])))
        return inner(*args, **kwargs)

    monkeypatch.setattr(sampling, "_generate", spy)
    ids, mask = prompts()
    generate(
        model, ids, mask, key=jax.random.key(0), num_generations=2, max_new_tokens=3, row_groups=4
    )
    assert sorted(offset for _, offset in calls) == [0, 2, 4, 6]
    threads = {name for name, _ in calls}
    assert len(threads) >= 2 and threading.current_thread().name in threads


@pytest.mark.parametrize(
    "groups,err,match",
    [
        (0, ValueError, "row_groups must be an int >= 1"),
        (3, ValueError, "row_groups must divide the number of prompts 4, got 3"),
        ("2", TypeError, "row_groups must be an int"),
        (True, TypeError, "row_groups must be an int"),
    ],
)
def test_bad_row_groups_are_refused_before_tracing(model, groups, err, match, monkeypatch):
    monkeypatch.setattr(sampling, "_generate", None)  # nothing may run
    ids, mask = prompts()
    with pytest.raises(err, match=match):
        generate(model, ids, mask, key=jax.random.key(0), row_groups=groups)


def test_prompts_over_several_devices_run_as_one_group(model):
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (the test configuration forces 8 CPU devices)")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    ids, mask = prompts()
    ids_d, mask_d = jax.device_put(ids, rows), jax.device_put(mask, rows)
    kw = dict(key=jax.random.key(4), num_generations=2, max_new_tokens=4, eos_ids=())
    out = generate(model, ids_d, mask_d, **kw)  # auto: one group, data-parallel
    one = generate(model, ids, mask, row_groups=1, **kw)
    np.testing.assert_array_equal(out.completion_ids, one.completion_ids)
    with pytest.raises(ValueError, match="row_groups=2 needs the prompts and the model on one"):
        generate(model, ids_d, mask_d, row_groups=2, **kw)


def test_a_model_on_another_device_takes_host_prompts_in_groups(model):
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (the test configuration forces 8 CPU devices)")
    moved = CausalLM(model.config, rngs=nnx.Rngs(0))
    nnx.update(moved, jax.device_put(nnx.state(moved), jax.devices()[1]))
    ids, mask = prompts()  # host arrays: uploaded without a device, they follow the model
    kw = dict(key=jax.random.key(6), num_generations=2, max_new_tokens=4, eos_ids=())
    out = generate(moved, ids, mask, row_groups=2, **kw)
    one = generate(model, ids, mask, row_groups=1, **kw)
    np.testing.assert_array_equal(out.completion_ids, one.completion_ids)
    assert out.completion_ids.devices() == {jax.devices()[1]}
    # The model spread over two devices: no groups by default.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    spread = CausalLM(model.config, rngs=nnx.Rngs(0))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    nnx.update(spread, jax.device_put(nnx.state(spread), replicated))
    assert auto_row_groups(spread, 4) == 1


# ------------------------------------------------------------------ auto_row_groups
def test_auto_row_groups_one_per_core_dividing_the_prompts(model, monkeypatch):
    monkeypatch.setattr(sampling.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert [auto_row_groups(model, b) for b in (8, 6, 7, 1, 2)] == [4, 3, 1, 1, 2]
    monkeypatch.setattr(sampling.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert auto_row_groups(model, 8) == 1
    with pytest.raises(ValueError, match="num_prompts must be an int >= 1, got 0"):
        auto_row_groups(model, 0)


def test_auto_row_groups_only_for_small_weight_matrices(monkeypatch):
    monkeypatch.setattr(sampling.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = CausalLMConfig(
        vocab_size=16, hidden_size=32, intermediate_size=256, num_layers=4, num_heads=2
    )
    m = CausalLM(cfg, rngs=nnx.Rngs(0))
    largest = 32 * 256  # one MLP matrix's elements
    monkeypatch.setattr(sampling, "ROW_GROUP_MAX_MATRIX_SIZE", largest)
    assert auto_row_groups(m, 4) == 2
    monkeypatch.setattr(sampling, "ROW_GROUP_MAX_MATRIX_SIZE", largest - 1)
    assert auto_row_groups(m, 4) == 1
    # Layers stored stacked are sliced one layer at a time by the sampler: one layer counts.
    monkeypatch.setattr(sampling, "ROW_GROUP_MAX_MATRIX_SIZE", largest)
    assert auto_row_groups(m.stack_layers(), 4) == 2


def test_the_worker_pool_grows_and_is_made_anew_in_a_forked_child(monkeypatch):
    monkeypatch.setattr(sampling, "_ROW_GROUP_POOL", None)
    parts = [dict(x=i) for i in range(4)]
    assert sampling._run_row_groups(lambda x: x * 10, parts[:2]) == [0, 10]
    one = sampling._ROW_GROUP_POOL[0]
    sampling._run_row_groups(lambda x: x, parts[:2])
    assert sampling._ROW_GROUP_POOL[0] is one
    assert sampling._run_row_groups(lambda x: x, parts) == [0, 1, 2, 3]  # 3 workers: grown
    three = sampling._ROW_GROUP_POOL[0]
    assert three is not one and three._max_workers == 3
    pid = sampling.os.getpid()
    monkeypatch.setattr(sampling.os, "getpid", lambda: pid + 1)  # as in a forked child
    assert sampling._run_row_groups(lambda x: x, parts[:2]) == [0, 1]
    assert sampling._ROW_GROUP_POOL[0] is not three


def test_a_failing_group_raises_after_every_group_has_finished():
    finished = threading.Event()

    def run(x):
        if x == 0:
            raise ValueError("group zero")
        if x == 1:
            time.sleep(0.2)
            finished.set()
            return x
        raise RuntimeError("group two")

    with pytest.raises(ValueError, match="group zero") as info:
        sampling._run_row_groups(run, [dict(x=0), dict(x=1), dict(x=2)])
    assert finished.is_set()  # the other groups ran to their end before the error came
    assert any("RuntimeError: group two" in note for note in info.value.__notes__)
