"""``GRPOConfig.scan_layers``: the update scans the decoder layers; the sampler does not.

The scanned update must give the unrolled update's values and gradients (the unrolled path is
checked against Hugging Face elsewhere), hold one layer in its compiled program whatever the
depth, and leave ``model.scan_layers`` (which the sampler follows) alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import (
    CausalLM,
    LoRAConfig,
    apply_lora,
)
from artifex.generative_models.training import GRPOConfig, GRPOTrainer
from artifex.generative_models.training.rl import (
    GRPOBatch,
    causal_lm_log_probs,
    default_log_prob_fn,
)
from tests.generative_models.training.rl import test_remat as remat_tests
from tests.generative_models.training.rl.test_remat import VOCAB, assert_bool_config_option, flat


def tiny_lm(num_layers: int = 3, seed: int = 0) -> CausalLM:
    return remat_tests.tiny_lm(num_layers, seed)


def lm_batch(seed: int = 0, prompts: int = 2, g: int = 3) -> GRPOBatch:
    """Prompts shared within groups (one left-padded), ragged completions, old/ref log-probs."""
    return remat_tests.lm_batch(seed, prompts=prompts, g=g)


# The prompt paths and remat are independent parts of the code: both prompt paths (the shared
# prompt's cache and every row on its own) feed the same layer loop, and remat wraps the scanned
# layer inside it whatever feeds it. Each prompt path and each remat setting runs once (the 2 x 2
# product compiled twice the programs and reached no other code).
@pytest.mark.parametrize(
    ("shared", "remat"),
    [(True, False), (False, True)],
    ids=["shared_prompt_cache-plain", "every_row-remat"],
)
def test_scanned_layers_give_the_unrolled_log_probs_and_gradients(shared, remat):
    model = tiny_lm()
    assert model.scan_layers is False
    batch = lm_batch().replace(shared_prompts=shared)
    remat_tests.assert_same_log_probs_and_gradients(
        model, batch, {"remat": remat}, {"remat": remat, "scan_layers": True}
    )


def _trainer(num_layers: int, scan: bool) -> GRPOTrainer:
    """A policy and a reference of ``num_layers``, remat on, the layers scanned or not.

    Both trainer tests below build these (3 layers): their update programs compile once.
    """
    policy, reference = tiny_lm(num_layers, seed=0), tiny_lm(num_layers, seed=5)
    optimizer = nnx.Optimizer(policy, optax.sgd(0.1), wrt=nnx.Param)
    config = GRPOConfig(
        num_generations=3, beta=0.04, remat=True, scan_layers=scan, optimizer_by_layer=False
    )
    return GRPOTrainer(policy, optimizer, config, reference_model=reference)


def _batch() -> GRPOBatch:
    return lm_batch(seed=1).replace(ref_log_probs=None)


def _dots_in_update(num_layers: int, scan: bool) -> int:
    """Dot operations in the optimized program of the whole update (policy and reference)."""
    trainer = _trainer(num_layers, scan)
    batch = trainer.prepare_batch(_batch())  # what train_step compiles for
    text = trainer.compiled_step().lower(trainer.state, batch).compile().as_text()
    return text.count(" dot(")


def test_the_scanned_update_holds_one_layer_whatever_the_depth():
    # measured at 2, 3 and 5 layers: 132, 196 and 324 dots unrolled, 68 scanned
    unrolled = _dots_in_update(2, False), _dots_in_update(3, False)
    scanned = _dots_in_update(2, True), _dots_in_update(3, True)
    assert unrolled[1] > unrolled[0] > 0, unrolled  # a copy of the layer per layer
    assert scanned[0] == scanned[1] > 0, scanned  # one loop body
    assert scanned[1] < unrolled[1], (scanned, unrolled)


def test_trainer_step_with_scan_layers_matches_the_unrolled_step(monkeypatch):
    seen = []
    run_layers = CausalLM._run_layers  # under hidden_states and shared_prefix_hidden_states

    def spy(self, h, cos, sin, mask, kv, index, remat, layer_stack, *rest, **options):
        seen.append(layer_stack is not None)
        return run_layers(self, h, cos, sin, mask, kv, index, remat, layer_stack, *rest, **options)

    monkeypatch.setattr(CausalLM, "_run_layers", spy)
    batch = _batch()
    updated, metrics = [], []
    for scan in (False, True):
        trainer = _trainer(3, scan)  # remat on both sides (remat alone: test_remat.py)
        policy, reference = trainer.model, trainer.reference_model
        seen.clear()
        metrics.append(trainer.train_step(batch))
        assert seen and set(seen) == {scan}, seen  # policy and reference, every call
        # the sampler follows model.scan_layers, which the option leaves as it was
        assert policy.scan_layers is False and reference.scan_layers is False
        updated.append(flat(nnx.state(policy, nnx.Param)))
    assert metrics[1]["total_loss"] == pytest.approx(metrics[0]["total_loss"], rel=1e-6)
    assert metrics[1]["kl"] == pytest.approx(metrics[0]["kl"], rel=1e-5)
    assert metrics[1]["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-5)
    for name, expected in updated[0].items():
        np.testing.assert_allclose(updated[1][name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_layers_that_differ_run_unrolled_with_the_same_values():
    model = tiny_lm(num_layers=2)
    # an adapter on the first layer only: the layers no longer share one structure
    apply_lora(model, LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj",)), nnx.Rngs(1))
    model.layers[1].attn.q_proj.lora = None
    lora_b = model.layers[0].attn.q_proj.lora.lora_b
    lora_b[...] = jnp.full_like(lora_b[...], 0.01)
    assert model.layer_stack() is None
    batch = lm_batch()
    scanned = causal_lm_log_probs(
        model, batch.prompt_ids, batch.completion_ids, prompt_mask=batch.prompt_mask,
        scan_layers=True,
    )  # fmt: skip
    plain = causal_lm_log_probs(
        model, batch.prompt_ids, batch.completion_ids, prompt_mask=batch.prompt_mask
    )
    np.testing.assert_array_equal(np.asarray(scanned[0]), np.asarray(plain[0]))


def test_scan_layers_option_is_checked_and_reaches_the_cli():
    assert_bool_config_option("scan_layers")


def test_a_model_without_layer_stack_is_refused_by_name():
    class Plain:
        def hidden_states(self, ids, attention_mask=None, **kwargs):
            return jnp.zeros((*ids.shape, 4)), None

        def output_embedding(self):
            return jnp.zeros((4, VOCAB))

    batch = lm_batch()
    with pytest.raises(TypeError, match="scan_layers=True needs a model with layer_stack"):
        causal_lm_log_probs(Plain(), batch.prompt_ids, batch.completion_ids, scan_layers=True)
    # the trainer's default log-prob function applies the option only where it can
    fn = default_log_prob_fn(Plain(), scan_layers=True)
    logp, _ = fn(Plain(), batch.replace(shared_prompts=False))
    assert logp.shape == batch.completion_ids.shape
