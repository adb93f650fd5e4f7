"""The compiled update grows linearly with the number of layers.

The non-finite guard decides once whether the update is applied. Written as one `where` per
parameter and optimizer leaf, XLA fused the and-reduction over every leaf's check into each
leaf's select: a program quadratic in the number of leaves (158 MB of optimized HLO and about
three minutes of compilation for SmolLM2-135M's 30 layers). With one branch over the whole state
the program text per layer stays constant; this test compiles the same tiny model at 2 and 8
layers and bounds the growth: 3.0x with one branch, 8.0x with the per-leaf selects.

XLA:CPU also orders the top-level operations of a program pairwise when it compiles it, so the
compile time grows with their square: with prompts shared within groups each layer runs once
for the prompt and its completions together (one row per group), not once for the prompts and
again for the completions.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch
from benchmarks.common import entry_operations


def _compiled_update(num_layers: int, batch: GRPOBatch | None = None):
    config = CausalLMConfig.tiny(num_layers=num_layers, vocab_size=64, hidden_size=32,
                                 intermediate_size=64, num_heads=2, num_kv_heads=1,
                                 head_dim=16)  # fmt: skip
    policy = CausalLM(config, rngs=nnx.Rngs(0))
    reference = CausalLM(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(policy, optax.adamw(1e-3), wrt=nnx.Param)
    trainer = GRPOTrainer(
        policy,
        optimizer,
        GRPOConfig(num_generations=2, beta=0.04, optimizer_by_layer=False),
        reference_model=reference,
    )
    rng = np.random.default_rng(0)
    batch = batch or GRPOBatch(
        prompt_ids=jnp.asarray(rng.integers(0, 64, (4, 3)), jnp.int32),
        prompt_mask=jnp.ones((4, 3), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(0, 64, (4, 4)), jnp.int32),
        completion_mask=jnp.ones((4, 4), jnp.int32),
        rewards=jnp.array([1.0, 0.0, 0.5, 0.25]),
        group_size=2,
    )
    return trainer.compiled_step().lower(trainer.state, batch).compile()


def test_update_program_grows_linearly_with_layers():
    small, large = (len(_compiled_update(n).as_text()) for n in (2, 8))
    assert large / small < 6.0, (small, large)


def test_shared_prompts_run_each_layer_once():
    def per_layer(shared: bool) -> float:
        batch = GRPOBatch.zeros(2, 2, 4, 4).replace(shared_prompts=shared)
        small, large = (entry_operations(_compiled_update(n, batch)) for n in (2, 6))
        return (large - small) / 4

    # Measured: 1.45x the operations per layer of the unshared program (the prompt's attention
    # and the completions' two-part attention); 1.80x when the layers ran twice.
    ratio = per_layer(True) / per_layer(False)
    assert ratio < 1.6, ratio
