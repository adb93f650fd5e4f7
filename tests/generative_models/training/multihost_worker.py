"""One process of the two-process tests (tests/generative_models/training/test_multihost.py);
its one-layer model (``make_model``) is also the one tests/test_cli_multihost.py trains.

Run as ``python -m tests.generative_models.training.multihost_worker MODE OUT --coordinator
127.0.0.1:PORT --num-processes 2 --process-id I`` with two CPU devices per process
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``); the processes form one mesh over the
four devices (``data=2, fsdp=2``) and talk over gloo. Modes:

- ``first``: three ``train_step`` calls on fixed batches, each process feeding its rows
  (``process_row_range`` + ``shard_batch(process_local=True)``); then the whole loop, uninterrupted
  (3 steps, checkpoints every step, evaluation, logs, ``save_pretrained``); then the same loop
  (the same trainer, set back to its initial state) on another checkpoint directory, killed with
  SIGKILL right after its step-2 checkpoint (so the processes exit with -9).
- ``resume``: the loop again on the killed run's checkpoint directory (resumes at step 2).

Each process writes the parameters (gathered) to ``OUT/<mode>-p<I>.npz`` and is given its own
log directory ``OUT/logs-<run>-p<I>``, so the test can see who wrote what.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time

import numpy as np

STEP_MESH = {"data": 2, "fsdp": 2}


def make_mesh_for_test(devices=None):
    """The mesh of these tests (``data=2, fsdp=2``) over ``devices`` (default: all)."""
    from artifex.generative_models.training.sharding import make_mesh

    return make_mesh(**STEP_MESH, devices=devices)


def make_model(tok, seed=0):
    """A one-layer Llama-style model for the demo tokenizer (width 32, 4 query / 2 kv heads).

    The demo model's shape with one layer instead of three and half the width: what these tests
    check (the processes' reductions, checkpoints, logs) does not depend on the depth, and the
    programs compile in about half the time.
    """
    from flax import nnx

    from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig

    config = CausalLMConfig.tiny(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_ids,
        pad_token_id=tok.pad_id,
    )
    return CausalLM(config, rngs=nnx.Rngs(seed))


def make_trainer(mesh=None, seed=0):
    """The one-layer model (with a reference) and its trainer, built the same in every process."""
    import optax
    from flax import nnx

    from artifex.demos.addition import demo_tokenizer
    from artifex.generative_models.training import GRPOConfig, GRPOTrainer

    tok = demo_tokenizer()
    model = make_model(tok, seed=seed)
    ref = make_model(tok, seed=seed + 100)
    opt = nnx.Optimizer(
        model, optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), wrt=nnx.Param
    )
    config = GRPOConfig(num_generations=4, beta=0.05)
    return GRPOTrainer(model, opt, config, reference_model=ref, mesh=mesh), tok


def step_batch(step: int, vocab: int):
    """The fixed global batch of ``train_step`` number ``step`` (16 rows, groups of 4)."""
    from artifex.generative_models.training.rl.batch import GRPOBatch

    rng = np.random.default_rng(100 + step)
    b, p, t = 16, 5, 6
    lengths = rng.integers(1, t + 1, size=b)
    prompt_mask = np.ones((b, p), np.int32)
    prompt_mask[::3, :2] = 0
    prompt_ids = rng.integers(4, vocab, (b // 4, p)).repeat(4, axis=0).astype(np.int32)
    return GRPOBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask[::4].repeat(4, axis=0),
        completion_ids=rng.integers(4, vocab, (b, t)).astype(np.int32),
        completion_mask=(np.arange(t)[None] < lengths[:, None]).astype(np.int32),
        rewards=rng.normal(size=b).astype(np.float32),
        group_size=4,
        shared_prompts=True,
    )


def flat_params(trainer) -> dict[str, np.ndarray]:
    """Every parameter and optimizer array, full value (gathered across processes)."""
    import jax
    from flax import nnx

    from artifex.generative_models.training.sharding import host_array

    out = {}
    for prefix, obj in (("model", trainer.model), ("opt", trainer.optimizer)):
        leaves = jax.tree_util.tree_flatten_with_path(nnx.state(obj))[0]
        for path, x in leaves:
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            out[prefix + "/" + jax.tree_util.keystr(path)] = host_array(x)
    return out


def run_steps(trainer, mesh, num_steps: int = 3) -> list[dict[str, float]]:
    """``num_steps`` train steps; each process passes only its rows of each global batch."""
    import jax

    from artifex.generative_models.training.sharding import process_row_range, shard_batch

    history = []
    for step in range(num_steps):
        batch = step_batch(step, trainer.model.config.vocab_size)
        lo, hi = process_row_range(batch.batch_size, mesh)
        local = jax.tree.map(lambda x, lo=lo, hi=hi: x[lo:hi], batch)
        history.append(trainer.train_step(shard_batch(local, mesh, process_local=True)))
    return history


def digit_reward(prompts, completions, **columns):
    """A reward with signal even for an untrained model: the fraction of digit characters."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def run_loop(out: str, name: str, ckpt: str, mesh, kill_after: int | None = None, trainer=None):
    """The whole loop (3 steps, checkpoint every step, evaluation) on the two-process mesh.

    ``trainer``: a trainer of ``make_trainer`` to train (default: a new one).
    """
    import jax

    from artifex.demos.addition import addition_dataset, demo_tokenizer
    from artifex.generative_models.training import checkpointing
    from artifex.generative_models.training.rl.loop import TrainConfig, train
    from artifex.generative_models.training.rl.rewards import math_answer_reward
    from artifex.generative_models.training.rl.rollout import RolloutConfig

    if kill_after is not None:
        save = checkpointing.CheckpointManager.save

        def save_then_die(self, step, state, metadata):
            save(self, step, state, metadata)
            if step == kill_after:
                # Both processes have finished the save before either dies; the other process
                # dies first, so process 0 (which hosts the coordination service) is not seen to
                # vanish mid-save by a peer that would then abort instead of being killed.
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("checkpoint saved, about to be killed")
                if jax.process_index() == 0:
                    time.sleep(1.0)
                cpu = time.process_time()
                print(f"[CPU {cpu:6.1f} s] killed after step {step}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, like a lost host

        checkpointing.CheckpointManager.save = save_then_die
    rows, eval_rows = addition_dataset(seed=0, num_eval=6)
    trainer = make_trainer(mesh)[0] if trainer is None else trainer
    tok = demo_tokenizer()
    config = TrainConfig(
        num_steps=3,
        prompts_per_step=4,
        num_iterations=2,
        progress=False,
        seed=3,
        checkpoint_dir=ckpt,
        checkpoint_every=1,
        log_dir=os.path.join(out, f"logs-{name}-p{jax.process_index()}"),
        log_completions_every=1,
        completions_to_print=0,
        # a tracker too, where its package is installed: process 1 must not write it either
        report_to="tensorboard" if importlib.util.find_spec("tensorboardX") else "none",
    )
    result = train(
        trainer,
        tok,
        rows[:64],
        [math_answer_reward(last_number_fallback=True, backend="builtin"), digit_reward],
        config,
        RolloutConfig(max_new_tokens=4),
        eval_dataset=eval_rows,
    )
    trainer.model.save_pretrained(os.path.join(out, f"model-{name}-p{jax.process_index()}"))
    return trainer, result


def main(argv: list[str] | None = None) -> int:
    """Runs one mode in this process (see the module docstring).

    Args:
        argv: Command-line arguments.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("first", "resume"))
    parser.add_argument("out")
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    args = parser.parse_args(argv)

    from artifex.generative_models.training.sharding import initialize_distributed

    t0 = time.perf_counter()
    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    import jax
    import jax.numpy as jnp

    def mark(what: str) -> None:
        wall, cpu = time.perf_counter() - t0, time.process_time()
        print(f"[{wall:6.1f} s, CPU {cpu:6.1f} s] {what}", file=sys.stderr, flush=True)

    mark("initialized")

    mesh = make_mesh_for_test()
    primary = jax.process_index() == 0
    results: dict[str, np.ndarray] = {}
    if args.mode == "first":
        trainer, _ = make_trainer(mesh)
        history = run_steps(trainer, mesh)
        mark("train steps")
        results.update({f"steps/{k}": v for k, v in flat_params(trainer).items()})
        results["steps/loss"] = np.asarray([h["total_loss"] for h in history])
        trainer = make_trainer(mesh)[0]
        # A copy of its initial state (the step donates the state's buffers), for the killed run.
        initial = jax.tree.map(jnp.copy, trainer.state)
        trainer, result = run_loop(
            args.out, "full", os.path.join(args.out, "ckpt-full"), mesh, trainer=trainer
        )
    else:
        trainer, result = run_loop(args.out, "resume", os.path.join(args.out, "ckpt-killed"), mesh)
    mark("loop")
    results.update({f"loop/{k}": v for k, v in flat_params(trainer).items()})
    results["loop/start_step"] = np.asarray(result.start_step)
    results["loop/reward_mean"] = np.asarray([h["reward_mean"] for h in result.history])
    results["loop/eval"] = np.asarray([m["eval/pass@1"] for _, m in result.evaluations])
    # Every process records what it computed (the test compares them); process 0's is the run's.
    np.savez(os.path.join(args.out, f"{args.mode}-p{jax.process_index()}.npz"), **results)
    if primary:
        print(f"{args.mode}: done, start_step={result.start_step}", flush=True)
    if args.mode == "first":
        # Last: the same loop on its own checkpoint directory, killed after its step-2 save, from
        # the same initial state: the same trainer, set back to it, so that its compiled programs
        # are reused (JAX writes the persistent compilation cache from process 0 only, under
        # keys of its own, so process 1 would compile a new trainer's programs again).
        trainer.load_state(initial)
        ckpt = os.path.join(args.out, "ckpt-killed")
        run_loop(args.out, "killed", ckpt, mesh, kill_after=2, trainer=trainer)
        msg = "the killed run was not killed"
        raise RuntimeError(msg)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
