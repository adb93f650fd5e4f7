"""The compiled update grows linearly with the number of layers.

The non-finite guard decides once whether the update is applied. Written as one `where` per
parameter and optimizer leaf, XLA fused the and-reduction over every leaf's check into each
leaf's select: a program quadratic in the number of leaves (158 MB of optimized HLO and about
three minutes of compilation for SmolLM2-135M's 30 layers). With one branch over the whole state
the program text per layer stays constant; this test compiles the same tiny model at 2 and 8
layers and bounds the growth: 3.0x with one branch, 8.0x with the per-leaf selects.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch


def _program_chars(num_layers: int) -> int:
    config = CausalLMConfig.tiny(num_layers=num_layers, vocab_size=64, hidden_size=32,
                                 intermediate_size=64, num_heads=2, num_kv_heads=1,
                                 head_dim=16)  # fmt: skip
    policy = CausalLM(config, rngs=nnx.Rngs(0))
    reference = CausalLM(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(policy, optax.adamw(1e-3), wrt=nnx.Param)
    trainer = GRPOTrainer(
        policy, optimizer, GRPOConfig(num_generations=2, beta=0.04), reference_model=reference
    )
    rng = np.random.default_rng(0)
    batch = GRPOBatch(
        prompt_ids=jnp.asarray(rng.integers(0, 64, (4, 3)), jnp.int32),
        prompt_mask=jnp.ones((4, 3), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(0, 64, (4, 4)), jnp.int32),
        completion_mask=jnp.ones((4, 4), jnp.int32),
        rewards=jnp.array([1.0, 0.0, 0.5, 0.25]),
        group_size=2,
    )
    compiled = trainer.compiled_step().lower(trainer.state, batch).compile()
    return len(compiled.as_text())


def test_update_program_grows_linearly_with_layers():
    small, large = _program_chars(2), _program_chars(8)
    assert large / small < 6.0, (small, large)
