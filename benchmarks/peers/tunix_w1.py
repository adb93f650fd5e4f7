"""W1 with Google Tunix's GRPOLearner on the CPU: seconds per whole step.

Run in the Tunix venv (see ``benchmarks/peers/README.md``), not in the project's Python:

    /tmp/artifex-peers/tunix/bin/python benchmarks/peers/tunix_w1.py [--steps 8] [--warmup 2]

Builds everything locally (no hub access): Tunix's own ``tunix.models.qwen2.model.Qwen2`` from a
``ModelConfig`` of W1's shapes (vocabulary 4096, width 256, 4 layers, 4 query / 2 key-value heads
of width 64, MLP 768, tied embeddings, q/k/v biases, RoPE base 1e6, fp32), random init, a
separate reference model with the same initial weights, a word-level tokenizer over
"t0".."t4095", and prompts of exactly 32 tokens. One step is 8 prompts x 4 generations = 32
completions of exactly 96 tokens by Tunix's KV-cache sampler (the ``vanilla`` rollout engine,
temperature 1, top_p 1), a reference forward (``beta=0.04``), the rewards, one AdamW update
(``num_iterations=1``: no old-policy forward, as ours). The tokenizer's EOS and pad ids are 4096
and 4097, outside the model's vocabulary, so sampling never stops early and no sampled token
is mistaken for padding.

Prints a human-readable summary and, last, one line ``PEER_RESULT {json}`` that
``benchmarks/run.py --only peers`` parses. The run fails (exit 1) when a step did not do W1's
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
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen2 import model as qwen2_lib
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


def build_model(seed: int) -> qwen2_lib.Qwen2:
    """A random-init W1 Qwen2 (Tunix's class); ``RLCluster`` puts it on its mesh."""
    return qwen2_lib.Qwen2(model_config(), rngs=nnx.Rngs(seed))


def toy_reward(prompts, completions, **kwargs):
    """The fraction of even token ids in each completion (W1's toy reward)."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in text.split()]
        out.append(sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.WARNING)

    # One CPU device; Auto axes, as Tunix's examples make their meshes.
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    policy = build_model(args.seed)
    reference = build_model(args.seed)  # same initial weights, its own buffers
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))

    rng = np.random.default_rng(args.seed + 1)
    data = [
        {
            # A NumPy array, as Tunix's grain pipelines give: the learner repeats it G times.
            "prompts": np.array(
                [
                    " ".join(f"t{t}" for t in rng.integers(0, VOCAB, PROMPT_LEN))
                    for _ in range(NUM_PROMPTS)
                ]
            )
        }
        for _ in range(args.steps)
    ]

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
            eval_every_n_steps=10**9,
            max_steps=args.steps,
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
        out = run_global_step(*a, **k)
        cur["step_s"] = time.perf_counter() - cur.pop("t0")
        steps.append(dict(cur))
        return out

    learner._run_global_step = timed_global_step
    wrap(cluster, "generate", "generation_s", block_out)
    wrap(cluster, "get_ref_per_token_logps", "reference_s", block_out)
    wrap(cluster, "update_actor", "training_s", block_actor)
    wrap(learner, "_generate_and_compute_advantage", "rollout_s", check_example)

    t0 = time.perf_counter()
    learner.train(data)
    total_s = time.perf_counter() - t0

    med = statistics.median
    timed = steps[args.warmup :]
    step_s = [s["step_s"] for s in timed]
    gen_s = [s["generation_s"] for s in timed]
    ref_s = [s["reference_s"] for s in timed]
    rollout_s = [s["rollout_s"] for s in timed]
    train_s = [s["training_s"] for s in timed]
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
    if len(steps) != args.steps:
        problems.append(f"{len(steps)} steps run, want {args.steps}")
    if cluster.actor_trainer.train_steps != args.steps:
        problems.append(
            f"{cluster.actor_trainer.train_steps} optimizer updates for {args.steps} steps"
        )

    versions = {
        p: importlib.metadata.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")
    }
    checks = [s.get("check", {}) for s in steps]
    result = {
        "peer": "tunix",
        "versions": versions,
        "devices": str(jax.devices()),
        "params": int(n_params),
        "steps_timed": len(step_s),
        "step_s": med(step_s),
        "step_s_all": [round(s, 4) for s in step_s],
        # step start to next step start: the loop's whole period, weight sync and metrics included
        "step_period_s": med([b - a for a, b in itertools.pairwise(starts)][args.warmup :]),
        "generation_s": med(gen_s),
        "reference_s": med(ref_s),
        "rollout_s": med(rollout_s),
        "training_s": med(train_s),
        "total_train_s": total_s,
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
    print(
        f"Tunix {versions['google-tunix']} (jax {versions['jax']}, flax {versions['flax']}), "
        f"{n_params / 1e6:.2f}M params\n"
        f"W1 step: median {med(step_s) * 1e3:.0f} ms over {len(step_s)} steps "
        f"(generation {med(gen_s) * 1e3:.0f} ms, reference fwd {med(ref_s) * 1e3:.0f} ms, "
        f"rollout incl. rewards {med(rollout_s) * 1e3:.0f} ms, "
        f"update {med(train_s) * 1e3:.0f} ms)\n"
        f"checks: {json.dumps(result['check'])}",
        flush=True,
    )
    print("PEER_RESULT " + json.dumps(result), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
