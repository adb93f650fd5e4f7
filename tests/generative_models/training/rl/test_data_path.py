"""A rollout's data, followed from the loop to the update, visits each stage once.

``train()`` is a sequence of stages (docs/architecture.md): the rollout makes a batch, the
trainer places it on the devices, the loop scores its old log-probs (when an update runs more
than once on it), computes its advantages, and hands it to the updates. These tests run the
real loop on a tiny model with every stage counted, and record every call into the library
while a rollout runs: each stage runs once per step, in that order, and nothing in the
rollout calls into the update layer (the trainer, its step engines) or the run layer.
"""

from __future__ import annotations

import sys

import optax
import pytest
from flax import nnx

from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig, Tokenizer
from artifex.generative_models.training import (
    GRPOConfig,
    GRPOTrainer,
    RolloutConfig,
    TrainConfig,
    train,
)
from artifex.generative_models.training.rl.run import loop as loop_module

RL = "artifex.generative_models.training.rl."
STEPS = 2


def first_better(prompts, completions, **columns):
    """1 for the first completion of each pair: every group has an advantage signal."""
    return [float(i % 2 == 0) for i in range(len(completions))]


def tiny_run() -> tuple[GRPOTrainer, Tokenizer]:
    tok = Tokenizer.for_characters("0123456789+=")
    cfg = CausalLMConfig(
        vocab_size=tok.vocab_size, hidden_size=8, intermediate_size=16, num_layers=1,
        num_heads=2, eos_token_id=tok.eos_ids[0],
    )  # fmt: skip
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    config = GRPOConfig(num_generations=2, beta=0.0)
    return GRPOTrainer(model, optimizer, config), tok


@pytest.mark.parametrize("num_iterations", [1, 2], ids=["mu=1", "mu=2"])
def test_each_stage_runs_once_per_step_in_order(monkeypatch, num_iterations):
    trainer, tok = tiny_run()
    events: list[str] = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)

        return wrapped

    for name in ("collect_generation_batch", "score_old_log_probs", "add_advantages"):
        monkeypatch.setattr(loop_module, name, spy(name, getattr(loop_module, name)))
    monkeypatch.setattr(trainer, "place_batch", spy("place_batch", trainer.place_batch))
    monkeypatch.setattr(trainer, "apply_prepared", spy("update", trainer.apply_prepared))

    dataset = [{"prompt": f"{a}+{a}="} for a in range(4)]
    config = TrainConfig(
        num_steps=STEPS, prompts_per_step=2, progress=False, compile_ahead=False,
        num_iterations=num_iterations,
    )  # fmt: skip
    result = train(trainer, tok, dataset, first_better, config, RolloutConfig(max_new_tokens=2))
    assert len(result.history) == STEPS

    scored = ["score_old_log_probs"] if num_iterations > 1 else []
    one_step = [
        "collect_generation_batch",
        "place_batch",
        *scored,
        "add_advantages",
        *["update"] * num_iterations,
    ]
    assert events == one_step * STEPS


def callback_profiler(found: list[tuple[str, str]]):
    """A ``sys.setprofile`` function recording each call into the update or run layer made
    while a rollout module's frame is on the stack below it: ``(module, function)``."""

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith((RL + "update.", RL + "run.")):
            return
        caller = frame.f_back
        while caller is not None:
            if caller.f_globals.get("__name__", "").startswith(RL + "rollouts."):
                found.append((module, frame.f_code.co_name))
                return
            caller = caller.f_back

    return profile


def test_a_rollout_never_calls_back_into_the_update_or_the_run(monkeypatch):
    """With mu = 2 the old log-probs are scored; the loop does it, not the rollout."""
    trainer, tok = tiny_run()
    callbacks: list[tuple[str, str]] = []
    profiled = {"rollouts": 0}
    collect = loop_module.collect_generation_batch

    def profiled_collect(*args, **kwargs):
        profiled["rollouts"] += 1
        previous = sys.getprofile()
        sys.setprofile(callback_profiler(callbacks))
        try:
            return collect(*args, **kwargs)
        finally:
            sys.setprofile(previous)

    monkeypatch.setattr(loop_module, "collect_generation_batch", profiled_collect)
    dataset = [{"prompt": f"{a}+{a}="} for a in range(4)]
    config = TrainConfig(
        num_steps=1, prompts_per_step=2, progress=False, compile_ahead=False, num_iterations=2
    )
    result = train(trainer, tok, dataset, first_better, config, RolloutConfig(max_new_tokens=2))
    assert len(result.history) == 1 and profiled["rollouts"] == 1
    assert callbacks == []


def test_the_callback_check_sees_a_rollout_calling_the_trainer():
    """The profiler above catches a call from a rollout module into the update layer."""
    trainer, _ = tiny_run()
    callbacks: list[tuple[str, str]] = []
    # a function compiled as if defined in a rollout module, calling back into the trainer
    namespace = {"__name__": RL + "rollouts.fake", "trainer": trainer}
    exec("def call_back():\n    return trainer.policy()\n", namespace)
    sys.setprofile(callback_profiler(callbacks))
    try:
        namespace["call_back"]()
    finally:
        sys.setprofile(None)
    assert (RL + "update.trainer_batches", "policy") in callbacks
