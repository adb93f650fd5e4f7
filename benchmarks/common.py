"""Shared helpers for the benchmarks: timing, FLOP counts, the machine's matmul peak."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def block(x: Any) -> Any:
    """Waits for every array in ``x``."""
    return jax.block_until_ready(x)


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 5) -> dict[str, float]:
    """Median/min wall time of ``fn()`` (which must block) after ``warmup`` calls."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def compiled_flops(jitted: Any, *args: Any, **kwargs: Any) -> float:
    """FLOPs of one call according to XLA's cost analysis of the compiled function."""
    compiled = jitted.lower(*args, **kwargs).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def update_cost(trainer: Any, batch: Any, *, remat: bool | int = False) -> dict[str, float]:
    """FLOPs and bytes accessed of one GRPO update (``trainer.compiled_step()``), by XLA's count.

    XLA's cost analysis counts a loop body once: the chunked log-probs (a scan over chunks of
    rows) and scanned layers would be counted for one chunk or one layer. The count is taken on
    the same update with the log-probs in one piece and the layers unrolled (compiled, never
    run); it has no chunk recomputation either, so it counts the update's own FLOPs. The batch
    is converted as ``train_step`` converts it (``prepare_batch`` marks prompts shared within
    groups, each encoded once per group, which a raw sampler batch does not say).

    Args:
        trainer: The ``GRPOTrainer`` whose update is counted (model, optimizer, reference and
            config are reused).
        batch: A batch as passed to ``train_step``.
        remat: Whether the counted update rematerializes the layers (True), or every n-th one
            (an int n), as ``GRPOConfig.remat_option``.

    Returns:
        ``{"flops": ..., "bytes_accessed": ...}`` of one update.

    Raises:
        RuntimeError: If the converted batch does not share prompts within groups.
    """
    from artifex.generative_models.training import GRPOTrainer
    from artifex.generative_models.training.rl import causal_lm_log_probs_fn

    whole = GRPOTrainer(
        trainer.model,
        trainer.optimizer,
        # the same update as one program (per-layer programs have no single cost analysis)
        dataclasses.replace(trainer.config, layerwise_update=False, optimizer_by_layer=False),
        reference_model=trainer.reference_model,
        log_prob_fn=causal_lm_log_probs_fn(chunk_size=2**31 - 1, remat=remat),
    )
    prepared = whole.prepare_batch(batch)
    if not prepared.shared_prompts:
        msg = "the sampler's batch should have its prompts shared within groups"
        raise RuntimeError(msg)
    cost = whole.compiled_step().lower(whole.state, prepared).compile().cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    return {
        "flops": float(cost.get("flops", float("nan"))),
        "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
    }


def workload_trainer(
    directory: str,
    workload: dict[str, Any],
    *,
    dtype: str = "float32",
    remat: bool = False,
    remat_every: int = 1,
    scan_update: bool = False,
    stack_layers: bool = False,
    scan_layers: bool = False,
    layerwise_update: bool = False,
    optimizer_by_layer: bool = True,
) -> Any:
    """Our ``GRPOTrainer`` on a workload directory, as the benchmark workers build it.

    Policy and reference come from ``CausalLM.from_pretrained(directory)``; with
    ``stack_layers`` both store their layers stacked (before the optimizer is built, since it
    holds the arrays it is built on); AdamW at the workload's learning rate.

    Args:
        directory: The workload directory (``benchmarks/hfdir.py``).
        workload: Its ``workload.json``.
        dtype: Parameter dtype.
        remat: ``GRPOConfig.remat``.
        remat_every: ``GRPOConfig.remat_every``.
        scan_update: ``GRPOConfig.scan_layers`` (the update scans the layers).
        stack_layers: ``CausalLM.stack_layers()`` on the policy and the reference.
        scan_layers: ``CausalLM.scan_layers`` (the sampler scans them too).
        layerwise_update: ``GRPOConfig.layerwise_update`` (the update as per-layer programs).
        optimizer_by_layer: ``GRPOConfig.optimizer_by_layer`` (False: the optimizer in the
            update's one program).

    Returns:
        The trainer.
    """
    import optax
    from flax import nnx

    from artifex.generative_models.models.causal_lm import CausalLM
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer

    policy = CausalLM.from_pretrained(directory, dtype=dtype)
    reference = CausalLM.from_pretrained(directory, dtype=dtype)
    policy.scan_layers = reference.scan_layers = scan_layers
    if stack_layers:
        policy.stack_layers()
        reference.stack_layers()
    optimizer = nnx.Optimizer(policy, optax.adamw(workload["learning_rate"]), wrt=nnx.Param)
    config = GRPOConfig(
        num_generations=workload["num_generations"],
        beta=workload["beta"],
        remat=remat,
        remat_every=remat_every,
        scan_layers=scan_update,
        layerwise_update=layerwise_update,
        optimizer_by_layer=optimizer_by_layer,
    )
    return GRPOTrainer(policy, optimizer, config, reference_model=reference)


def toy_reward_batch(out: Any, group_size: int) -> Any:
    """The GRPO batch of one rollout (``generate``'s output), scored by the toy reward.

    The reward is ``benchmarks.workloads.toy_reward`` (the fraction of even token ids), computed
    on the host and uploaded with ``jax.device_put`` (no program to compile, as in the loop).

    Args:
        out: What ``artifex.generative_models.inference.generate`` returned.
        group_size: Completions per prompt.

    Returns:
        A ``GRPOBatch``.
    """
    import numpy as np

    from artifex.generative_models.training.rl import GRPOBatch
    from benchmarks.workloads import toy_reward

    return GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jax.device_put(toy_reward(np.asarray(jax.device_get(out.completion_ids)))),
        group_size=group_size,
    )


def entry_operations(compiled: Any) -> int:
    """Operations at the top level of a compiled program's optimized HLO, bookkeeping excluded.

    XLA:CPU orders these operations with a pairwise dependency check when it compiles, so its
    compile time grows with their square (nested loop bodies and branches are ordered apart).

    Args:
        compiled: A ``jax.stages.Compiled``.

    Returns:
        The number of instructions of the entry computation other than parameters, constants,
        tuples, tuple elements and bitcasts.
    """
    text = compiled.as_text()
    entry = text[text.index("\nENTRY ") :].split("\n}\n", 1)[0]
    trivial = ("parameter(", "get-tuple-element(", "tuple(", "bitcast(", "constant(")
    count = 0
    for line in entry.splitlines()[1:]:
        if " = " in line and not any(f" {op}" in line.split(" = ", 1)[1][:80] for op in trivial):
            count += 1
    return count


def compiled_memory(jitted: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
    """XLA memory analysis of the compiled function (bytes)."""
    mem = jitted.lower(*args, **kwargs).compile().memory_analysis()
    return {
        "temp_bytes": float(mem.temp_size_in_bytes),
        "argument_bytes": float(mem.argument_size_in_bytes),
        "output_bytes": float(mem.output_size_in_bytes),
        "alias_bytes": float(mem.alias_size_in_bytes),
    }


def matmul_peak(n: int = 2048, dtype: Any = jnp.float32, repeats: int = 5) -> float:
    """Achieved FLOP/s of a square ``n x n`` matmul: the machine's practical peak."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    t = time_fn(lambda: f(a, b), warmup=2, repeats=repeats)["min_s"]
    return 2 * n**3 / t


def machine() -> str:
    """One line describing this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = jax.devices()[0]
    return (
        f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {dev.platform} "
        f"({dev.device_kind})"
    )


def fmt_bytes(n: float) -> str:
    """Human-readable bytes."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
