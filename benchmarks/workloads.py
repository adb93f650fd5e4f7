"""Benchmark workloads, built the same way in every benchmark and in the docs.

W1 (the project's speed yardstick): a Qwen2-shaped policy (vocab 4096, hidden 256, 4 layers,
4 query / 2 kv heads, MLP 768, tied embeddings, fp32), 8 prompts x 4 generations, prompt 32 and
completion 96 tokens (no early stop), beta 0.04 so a reference runs, one update per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.inference import generate
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch


@dataclasses.dataclass(frozen=True)
class Workload:
    """Shapes of a GRPO step."""

    name: str
    model: CausalLMConfig
    num_prompts: int
    num_generations: int
    prompt_length: int
    completion_length: int
    beta: float

    @property
    def batch_size(self) -> int:
        return self.num_prompts * self.num_generations


W1 = Workload(
    name="W1",
    model=CausalLMConfig.qwen2_w1(),
    num_prompts=8,
    num_generations=4,
    prompt_length=32,
    completion_length=96,
    beta=0.04,
)


# A ~26M-parameter Qwen2-shaped policy (vocab 16384, width 512, 6 layers, 8 query / 2 kv heads,
# MLP 1536, tied embeddings, q/k/v biases, fp32), with W1's batch shape.
Q26M = Workload(
    name="Q26M",
    model=CausalLMConfig.qwen2_w1(
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
    ),
    num_prompts=8,
    num_generations=4,
    prompt_length=32,
    completion_length=96,
    beta=0.04,
)


def frozen_copy(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with its own buffers."""
    copy = nnx.clone(model)
    nnx.update(copy, jax.tree.map(lambda x: jnp.array(x, copy=True), nnx.state(copy)))
    return copy


def build_trainer(w: Workload, *, seed: int = 0, lr: float = 1e-5) -> GRPOTrainer:
    """Policy, AdamW optimizer, frozen reference (when beta > 0) and trainer for ``w``."""
    model = CausalLM(w.model, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    reference = frozen_copy(model) if w.beta > 0 else None
    # One program: the benchmarks that use these trainers take XLA's cost analysis of it.
    config = GRPOConfig(num_generations=w.num_generations, beta=w.beta, optimizer_by_layer=False)
    return GRPOTrainer(model, optimizer, config, reference_model=reference)


def random_batch(w: Workload, *, seed: int = 0, with_old_log_probs: bool = False) -> GRPOBatch:
    """A GRPOBatch of ``w``'s shapes with random tokens, left-padded prompts, full completions."""
    k = jax.random.split(jax.random.key(seed), 4)
    b, t, v = w.batch_size, w.completion_length, w.model.vocab_size
    # One prompt per group, repeated for its generations (prompt-major), as a rollout makes.
    prompt_ids, prompt_mask = random_prompts(w, seed=seed)
    prompt_ids = jnp.repeat(prompt_ids, w.num_generations, axis=0)
    prompt_mask = jnp.repeat(prompt_mask, w.num_generations, axis=0)
    completion_ids = jax.random.randint(k[2], (b, t), 1, v)
    return GRPOBatch(
        prompt_ids=prompt_ids.astype(jnp.int32),
        prompt_mask=prompt_mask,
        completion_ids=completion_ids.astype(jnp.int32),
        completion_mask=jnp.ones((b, t), jnp.int32),
        rewards=jax.random.bernoulli(k[3], 0.5, (b,)).astype(jnp.float32),
        old_log_probs=(jnp.full((b, t), -8.0, jnp.float32) if with_old_log_probs else None),
        group_size=w.num_generations,
    )


def random_prompts(w: Workload, *, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """``w.num_prompts`` left-padded random prompts of up to ``w.prompt_length`` tokens."""
    k = jax.random.split(jax.random.key(seed + 1000), 2)
    p, v = w.prompt_length, w.model.vocab_size
    lens = jax.random.randint(k[0], (w.num_prompts,), p // 2, p + 1)
    mask = (jnp.arange(p)[None, :] >= (p - lens)[:, None]).astype(jnp.int32)
    ids = (jax.random.randint(k[1], (w.num_prompts, p), 1, v) * mask).astype(jnp.int32)
    return ids, mask


def toy_reward(completion_ids: np.ndarray) -> np.ndarray:
    """A cheap host-side reward: the fraction of even token ids in each completion."""
    return (np.asarray(completion_ids) % 2 == 0).mean(axis=1).astype(np.float32)


def w1_step(
    trainer: GRPOTrainer, w: Workload, prompts: tuple[jax.Array, jax.Array], key: jax.Array
) -> dict[str, float]:
    """One whole W1 step: generate K completions per prompt, score them, one update."""
    out = generate(
        trainer.model,
        prompts[0],
        prompts[1],
        key=key,
        num_generations=w.num_generations,
        max_new_tokens=w.completion_length,
        eos_ids=(),  # no early stop: every completion is completion_length tokens
    )
    rewards = toy_reward(jax.device_get(out.completion_ids))
    batch = GRPOBatch(
        prompt_ids=out.prompt_ids,
        prompt_mask=out.prompt_mask,
        completion_ids=out.completion_ids,
        completion_mask=out.completion_mask,
        rewards=jnp.asarray(rewards),
        group_size=w.num_generations,
    )
    return trainer.train_step(batch)
