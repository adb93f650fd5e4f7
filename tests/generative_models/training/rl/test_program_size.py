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

import optax
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import GRPOBatch
from benchmarks.common import entry_operations


def _batch(shared: bool) -> GRPOBatch:
    """2 prompts x 2 completions of 4 tokens; the same batch (shapes) in both tests, so the
    2-layer unshared program compiles once per run (the compilation cache)."""
    return GRPOBatch.zeros(2, 2, 4, 4).replace(shared_prompts=shared)


def _compiled_update(num_layers: int, batch: GRPOBatch):
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
    return trainer.compiled_step().lower(trainer.state, batch).compile()


def test_update_program_grows_linearly_with_layers():
    # Measured: 3.05x (955 kB at 2 layers, 2.9 MB at 8).
    small, large = (len(_compiled_update(n, _batch(False)).as_text()) for n in (2, 8))
    assert large / small < 6.0, (small, large)


def test_shared_prompts_run_each_layer_once():
    def per_layer(shared: bool) -> float:
        # the entry operations grow by the same count with each layer (measured from 1 to 3
        # and at 6 and 8 layers): one layer's are the difference between 2 layers and 1
        small, large = (entry_operations(_compiled_update(n, _batch(shared))) for n in (1, 2))
        return large - small

    # Measured: 1.50x the operations per layer of the unshared program (178 against 119: the
    # prompt's attention and the completions' two-part attention); 1.80x when the layers ran
    # twice.
    ratio = per_layer(True) / per_layer(False)
    assert ratio < 1.6, ratio
