"""W1 with Google Tunix's GRPOLearner on the CPU: seconds per whole step.

Run in the Tunix venv (see ``benchmarks/peers/README.md``), not in the project's Python:

    /tmp/artifex-peers/tunix/bin/python benchmarks/peers/tunix_w1.py --model-dir DIR \
        [--windows 5] [--max-retries 10]

Loads the shared W1 directory written by ``benchmarks/hfdir.py`` (the same ``model.safetensors``
ours and TRL load) into Tunix's own ``tunix.models.qwen2.model.Qwen2`` with Tunix's own loader
(``tunix.models.qwen2.params.create_model_from_safe_tensors``; W1's shapes: vocabulary 4096, width
256, 4 layers, 4 query / 2 key-value heads of width 64, MLP 768, tied embeddings, q/k/v biases,
RoPE base 1e6, fp32), twice (policy and reference, separate buffers), and the prompt ids of
``DIR/prompts.json`` (as the text "t<id> ..." that the word-level adapter below maps back to the
same ids). Steps are timed as clean windows (``benchmarks/cleanwin.py``). One step is 8 prompts
x 4 generations = 32 completions of exactly 96 tokens by Tunix's KV-cache sampler (the
``vanilla`` rollout engine, temperature 1, top_p 1), a reference forward (``beta=0.04``), the
rewards, one AdamW update (``num_iterations=1``: no old-policy forward, as ours). The
tokenizer's EOS and pad ids are 4096 and 4097, outside the model's vocabulary, so sampling never
stops early and no sampled token is mistaken for padding.

Prints a human-readable summary and, last, one line ``RESULT {json}`` that
``benchmarks/honest.py`` parses. The run fails (exit 1) when a step did not do W1's
work: a completion that is not 96 tokens, a batch that is not 8 x 4, no reference forward.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import logging
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cleanwin
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen2 import params as qwen2_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout

VOCAB = 4096
NUM_PROMPTS = 8
NUM_GENERATIONS = 4
PROMPT_LEN = 32
COMPLETION_LEN = 96
BETA = 0.04
EOS, PAD = VOCAB, VOCAB + 1  # outside the vocabulary: never sampled


class W1Tokenizer:
    """Word-level tokenizer over "t0".."t4095" with the methods Tunix's adapter asks for."""

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(f"t{int(i)}" for i in ids if int(i) < VOCAB)

    def bos_id(self):
        return None  # no BOS prepended: prompts stay exactly 32 tokens

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


def model_config() -> qwen2_lib.ModelConfig:
    return qwen2_lib.ModelConfig(
        num_layers=4,
        vocab_size=VOCAB,
        embed_dim=256,
        hidden_dim=768,
        num_heads=4,
        head_dim=64,
        num_kv_heads=2,
        rope_theta=1_000_000,
        norm_eps=1e-6,
        use_tied_embedding=True,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )


def toy_reward(prompts, completions, **kwargs):
    """The fraction of even token ids in each completion (W1's toy reward)."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in text.split()]
        out.append(sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1))
    return out


_SPLITS = ("generation_s", "reference_s", "rollout_s", "training_s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="workload directory (hfdir.py)")
    parser.add_argument("--windows", type=int, default=5, help="clean timed steps wanted")
    parser.add_argument("--max-retries", type=int, default=10, help="extra steps for noisy ones")
    parser.add_argument("--threshold", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out")
    parser.add_argument(
        "--reuse-host-memory",
        action="store_true",
        help="the process settings of ours' reuse_host_memory(), applied here the same way: "
        "programs run in the calling thread, glibc keeps freed blocks in its heap",
    )
    parser.add_argument(
        "--train-micro-batch",
        type=int,
        default=None,
        help="RLTrainingConfig(train_micro_batch_size=N): the update accumulates the gradient "
        "over micro-batches of N prompts (their G completions each), still one optimizer update "
        "per step; generation and the reference forward stay whole (rollout and log-prob "
        "micro-batches of all the prompts)",
    )
    args = parser.parse_args(argv)
    if args.train_micro_batch is not None and (
        args.train_micro_batch < 1 or NUM_PROMPTS % args.train_micro_batch
    ):
        parser.error(f"--train-micro-batch must divide the {NUM_PROMPTS} prompts")
    if args.reuse_host_memory:
        import ctypes

        jax.config.update("jax_cpu_enable_async_dispatch", False)  # before any computation
        libc = ctypes.CDLL("libc.so.6")
        if not (libc.mallopt(-4, 0) and libc.mallopt(-1, 2**31 - 1)):  # M_MMAP_MAX, M_TRIM_...
            parser.error("--reuse-host-memory: mallopt refused")
    logging.getLogger("absl").setLevel(logging.WARNING)
    t_start = time.perf_counter()
    with open(os.path.join(args.model_dir, "prompts.json")) as fh:
        prompt_ids = json.load(fh)["ids"]
    if len(prompt_ids) != NUM_PROMPTS or {len(p) for p in prompt_ids} != {PROMPT_LEN}:
        print(f"prompts.json is not W1's {NUM_PROMPTS} x {PROMPT_LEN}", file=sys.stderr)
        return 1
    max_steps = args.warmup + args.windows + args.max_retries
    windows = cleanwin.Windows(args.windows, args.max_retries, args.threshold)

    # One CPU device; Auto axes, as Tunix's examples make their meshes.
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    policy = qwen2_params.create_model_from_safe_tensors(args.model_dir, model_config(), mesh)
    reference = qwen2_params.create_model_from_safe_tensors(args.model_dir, model_config(), mesh)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
    load_s = time.perf_counter() - t_start

    def data():
        # The same prompts every step, as ours; stops once enough clean windows were timed.
        # A NumPy array, as Tunix's grain pipelines give: the learner repeats it G times.
        text = np.array([" ".join(f"t{t}" for t in row) for row in prompt_ids])
        for i in range(max_steps):
            if i > args.warmup and windows.done():
                return
            yield {"prompts": text}

    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(1e-5),
            **(
                {}
                if args.train_micro_batch is None
                else {
                    "mini_batch_size": NUM_PROMPTS,
                    "train_micro_batch_size": args.train_micro_batch,
                    "rollout_micro_batch_size": NUM_PROMPTS,
                    "compute_logps_micro_batch_size": NUM_PROMPTS,
                }
            ),
            eval_every_n_steps=10**9,
            max_steps=max_steps,
            checkpoint_root_directory=None,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=COMPLETION_LEN,
            max_prompt_length=PROMPT_LEN,
            kv_cache_size=PROMPT_LEN + COMPLETION_LEN,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=policy,
        reference=reference,
        tokenizer=W1Tokenizer(),
        cluster_config=cluster_config,
    )
    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=[toy_reward],
        algo_config=grpo_lib.GRPOConfig(
            num_generations=NUM_GENERATIONS, num_iterations=1, beta=BETA, epsilon=0.2
        ),
    )

    # Timers and checks, wrapped around Tunix's own calls (instance attributes shadow methods).
    steps: list[dict] = []
    cur: dict = {}

    def wrap(obj, name, key, after=None):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if after is not None:
                after(out)
            cur[key] = cur.get(key, 0.0) + time.perf_counter() - t0
            return out

        setattr(obj, name, timed)

    def block_out(out):
        jax.block_until_ready(out)

    def block_actor(_):
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))

    def check_example(ex):
        jax.block_until_ready(ex.advantages)
        prompts = np.asarray(ex.prompt_ids)
        keys = [tuple(r) for r in prompts.tolist()]
        groups = [keys[i : i + NUM_GENERATIONS] for i in range(0, len(keys), NUM_GENERATIONS)]
        mask = np.asarray(ex.completion_mask)
        cur["check"] = {
            "completions": int(mask.shape[0]),
            "completion_width": int(mask.shape[1]),
            "completion_lengths": sorted(set(mask.sum(1).tolist())),
            "prompt_width": int(prompts.shape[1]),
            "prompt_lengths": sorted(set(np.asarray(ex.prompt_mask).sum(1).tolist())),
            "unique_prompts": len(set(keys)),
            "groups_of_one_prompt": all(len(set(g)) == 1 for g in groups),
            "ref_logps_shape": (
                None if ex.ref_per_token_logps is None else list(ex.ref_per_token_logps.shape)
            ),
            "old_logps": ex.old_per_token_logps is not None,
        }

    def step_begin():
        cur.clear()
        cur["t0"] = time.perf_counter()

    run_global_step = learner._run_global_step

    starts: list[float] = []

    def timed_global_step(*a, **k):
        step_begin()
        starts.append(cur["t0"])
        snap = cleanwin.snapshot()
        out = run_global_step(*a, **k)
        cur["step_s"] = time.perf_counter() - cur.pop("t0")
        cur["other_cpu"] = cleanwin.other_fraction(snap, cleanwin.snapshot())
        steps.append(dict(cur))
        if len(steps) > args.warmup:
            r = windows.records
            r.append(
                {
                    "seconds": cur["step_s"],
                    "other_cpu": cur["other_cpu"],
                    "clean": cur["other_cpu"] <= args.threshold,
                    **{key: cur.get(key, 0.0) for key in _SPLITS},
                }
            )
        return out

    learner._run_global_step = timed_global_step
    wrap(cluster, "generate", "generation_s", block_out)
    wrap(cluster, "get_ref_per_token_logps", "reference_s", block_out)
    wrap(cluster, "update_actor", "training_s", block_actor)
    wrap(learner, "_generate_and_compute_advantage", "rollout_s", check_example)

    t0 = time.perf_counter()
    learner.train(data())
    total_s = time.perf_counter() - t0

    batch = NUM_PROMPTS * NUM_GENERATIONS
    problems = []
    for i, s in enumerate(steps):
        c = s.get("check")
        if c is None:
            problems.append(f"step {i}: no rollout")
            continue
        if c["completions"] != batch:
            problems.append(f"step {i}: {c['completions']} completions, want {batch}")
        if c["completion_lengths"] != [COMPLETION_LEN] or c["completion_width"] != COMPLETION_LEN:
            problems.append(f"step {i}: completion lengths {c['completion_lengths']}")
        if c["prompt_lengths"] != [PROMPT_LEN]:
            problems.append(f"step {i}: prompt lengths {c['prompt_lengths']}")
        if c["unique_prompts"] != NUM_PROMPTS or not c["groups_of_one_prompt"]:
            problems.append(f"step {i}: {c['unique_prompts']} prompts, want {NUM_PROMPTS} x 4")
        if c["ref_logps_shape"] != [batch, COMPLETION_LEN] or "reference_s" not in s:
            problems.append(f"step {i}: no reference forward")
        if "training_s" not in s:
            problems.append(f"step {i}: no update")
    if cluster.actor_trainer.train_steps != len(steps):
        problems.append(
            f"{cluster.actor_trainer.train_steps} optimizer updates for {len(steps)} steps"
        )
    if not windows.records:
        problems.append("no timed step after the warm-up")

    versions = {
        p: importlib.metadata.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")
    }
    checks = [s.get("check", {}) for s in steps]
    summary = windows.summary(_SPLITS)
    result = {
        "system": "tunix",
        "versions": versions,
        "device": str(jax.devices()[0].device_kind),
        "reuse_host_memory": args.reuse_host_memory,
        "train_micro_batch": args.train_micro_batch,
        "params": int(n_params),
        "load_s": load_s,
        "first_step_s": steps[0]["step_s"] if steps else None,
        "step_period_s": statistics.median(
            [b - a for a, b in itertools.pairwise(starts)][args.warmup :] or [float("nan")]
        ),
        "total_train_s": total_s,
        "peak_rss_bytes": cleanwin.peak_rss_bytes(),
        "generated_tokens": batch * COMPLETION_LEN,
        **summary,
        "check": {
            "completions_per_step": sorted({c.get("completions") for c in checks}),
            "completion_lengths": sorted(
                {x for c in checks for x in c.get("completion_lengths", [])}
            ),
            "prompt_lengths": sorted({x for c in checks for x in c.get("prompt_lengths", [])}),
            "unique_prompts_per_step": sorted({c.get("unique_prompts") for c in checks}),
            "ref_logps_shape": checks[-1].get("ref_logps_shape") if checks else None,
            "old_policy_forward": any(c.get("old_logps") for c in checks),
            "optimizer_updates": int(cluster.actor_trainer.train_steps),
            "problems": problems,
        },
    }
    cleanwin.emit("RESULT", result)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
