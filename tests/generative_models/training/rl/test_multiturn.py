"""Tests of multi-turn episodes: completion masks, log-probs, environments, faulty tools."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from artifex.demos.tools import TOOL_CHAT_TEMPLATE, multiply, tool_demo_tokenizer
from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig
from artifex.generative_models.training.rl.configs import GRPOConfig
from artifex.generative_models.training.rl.grpo import GRPOTrainer
from artifex.generative_models.training.rl.logprobs import causal_lm_log_probs
from artifex.generative_models.training.rl.multiturn import (
    Environment,
    MultiTurnConfig,
    MultiTurnRollout,
    ToolEnvironment,
    environment_reward,
    run_episodes,
    turn_step_rewards,
)
from artifex.generative_models.training.rl.rewards import RewardCombiner
from artifex.generative_models.training.rl.rollout import RolloutConfig


def _model(tokenizer, seed: int = 0) -> CausalLM:
    config = CausalLMConfig.tiny(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_ids,
        pad_token_id=tokenizer.pad_id,
    )
    return CausalLM(config, rngs=nnx.Rngs(seed))


ROWS = [{"prompt": "3*4", "answer": "12"}, {"prompt": "5*6", "answer": "30"}]


def _trainer(tok, **grpo) -> GRPOTrainer:
    """A trainer of a fresh tiny model (4 generations, no KL unless ``grpo`` says so)."""
    model = _model(tok)
    config = GRPOConfig(**{"num_generations": 4, "beta": 0.0, **grpo})
    return GRPOTrainer(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), config)


def _scripted_rollout(**config) -> MultiTurnRollout:
    """Two-turn scripted episodes (see ``ScriptedModelEnv``)."""
    settings = {"max_turns": 3, "max_new_tokens": 5, "max_completion_tokens": 64, **config}
    return MultiTurnRollout(lambda: ScriptedModelEnv(2), MultiTurnConfig(**settings))


class ScriptedModelEnv:
    """An environment that always answers with an observation until ``turns`` turns."""

    def __init__(self, turns: int = 3):
        self.turns = turns
        self.seen: list[str] = []

    def reset(self, row):
        self.seen = []
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, completion):
        self.seen.append(completion)
        reward = float(len(self.seen))
        if len(self.seen) >= self.turns:
            return None, reward, True
        return [{"role": "tool", "content": f"obs {len(self.seen)}"}], reward, False


def _runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs (start, end, value) of a 0/1 row."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, int(mask[start])))
            start = i
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_completion_mask_covers_exactly_the_model_tokens(seed: int) -> None:
    tok = tool_demo_tokenizer()
    model = _model(tok, seed)
    envs: list[ScriptedModelEnv] = []

    def factory() -> ScriptedModelEnv:
        envs.append(ScriptedModelEnv(turns=3))
        return envs[-1]

    cfg = MultiTurnConfig(
        max_turns=4, max_new_tokens=6, max_completion_tokens=80, stop_strings=("7",)
    )
    rows = [{"prompt": "12*3"}, {"prompt": "456*78"}]
    ep = run_episodes(model, tok, rows, factory, cfg, key=jax.random.key(seed), num_generations=3)
    assert ep.completion_ids.shape[0] == 6
    for r in range(6):
        ids, mask = ep.completion_ids[r], ep.completion_mask[r]
        n = int((np.cumsum(mask[::-1]) > 0)[::-1].sum())  # up to the last model token
        runs = _runs(mask[:n])
        model_runs = [tok.decode(ids[a:b], skip_special_tokens=True) for a, b, v in runs if v]
        # each model turn is one run of mask 1 and the environment saw exactly those texts
        assert model_runs[: len(envs[r].seen)] == envs[r].seen
        assert len(model_runs) == ep.turns[r]
        # the appended runs (mask 0) are the template's rendering of the observations
        for a, b, v in runs:
            if not v:
                text = tok.decode(ids[a:b], skip_special_tokens=False)
                assert "<tool_response>obs " in text and text.endswith("<|assistant|>")
        # prompt + completion is the chat template's rendering of the whole conversation,
        # with the model's turns as written (completed episodes end with the model's EOS)
        full = tok.apply_chat_template(ep.messages[r], tokenize=False)
        prompt = tok.decode(ep.prompt_ids[r][ep.prompt_mask[r] == 1], skip_special_tokens=False)
        got = prompt + tok.decode(ids[:n], skip_special_tokens=False)
        if not ep.token_limit[r] and not ep.turn_limit[r]:
            assert got == full
        # per-turn rewards and their sum
        seen = len(envs[r].seen)
        np.testing.assert_array_equal(ep.turn_rewards[r, :seen], np.arange(1, seen + 1))
        assert np.isnan(ep.turn_rewards[r, seen:]).all()
    # the sampler's log-probs equal the trainer's teacher-forced log-probs on model tokens
    lp, _ = causal_lm_log_probs(
        model,
        jnp.asarray(ep.prompt_ids),
        jnp.asarray(ep.completion_ids),
        prompt_mask=jnp.asarray(ep.prompt_mask),
    )
    m = ep.completion_mask == 1
    np.testing.assert_allclose(np.asarray(lp)[m], ep.log_probs[m], rtol=1e-4, atol=1e-4)
    assert (ep.log_probs[~m] == 0).all()
    # per-turn rewards as step rewards: at the last model token of each turn
    steps = turn_step_rewards(ep)
    for r in range(6):
        mask = ep.completion_mask[r]
        ends = [b - 1 for a, b, v in _runs(mask) if v]
        seen = len(envs[r].seen)
        np.testing.assert_array_equal(np.flatnonzero(~np.isnan(steps[r])), ends[:seen])
        np.testing.assert_array_equal(steps[r][ends[:seen]], np.arange(1, seen + 1))
    metrics = ep.metrics()
    assert metrics["multiturn/turns_mean"] == pytest.approx(ep.turns.mean())
    assert "multiturn/turn_reward_1" in metrics


def test_limits_are_counted() -> None:
    tok = tool_demo_tokenizer()
    model = _model(tok, 3)
    rows = [{"prompt": "1*2"}]
    # never-ending environment: every episode hits the turn limit (unless a token limit first)
    cfg = MultiTurnConfig(max_turns=2, max_new_tokens=4, max_completion_tokens=200)
    ep = run_episodes(
        model,
        tok,
        rows,
        lambda: ScriptedModelEnv(99),
        cfg,
        key=jax.random.key(0),
        num_generations=4,
    )
    assert ((ep.turns == 2) | ep.token_limit).all()
    assert (ep.turn_limit | ep.token_limit).all()
    # a tiny token budget: every episode ends by the token limit
    cfg = MultiTurnConfig(max_turns=5, max_new_tokens=4, max_completion_tokens=6)
    ep = run_episodes(
        model,
        tok,
        rows,
        lambda: ScriptedModelEnv(99),
        cfg,
        key=jax.random.key(1),
        num_generations=4,
    )
    assert ep.token_limit.all() and (ep.completion_mask.sum(1) + 0 <= 6).all()
    assert (np.asarray([len(c) for c in ep.completion_ids]) >= 6).all()


def boom(a: int, b: int) -> str:
    """Raises.

    Args:
        a: A.
        b: B.
    """
    raise ZeroDivisionError("no")


def hang(a: int, b: int) -> str:
    """Hangs.

    Args:
        a: A.
        b: B.
    """
    time.sleep(30)
    return "late"


def not_text(a: int, b: int) -> dict:
    """Returns a dict, not text.

    Args:
        a: A.
        b: B.
    """
    return {"a": a}


class CallingEnv(ToolEnvironment):
    """A tool environment whose model turns are replaced by a scripted call (the model is
    random, so the test feeds the calls it wants through ``step``)."""

    script = ""

    def step(self, completion):
        return super().step(self.script if not getattr(self, "_called", False) else completion)


@pytest.mark.parametrize("name", ["boom", "hang", "not_text", "nosuch", "multiply"])
def test_faulty_tools_leave_the_run_going(name: str) -> None:
    tok = tool_demo_tokenizer()
    model = _model(tok)

    class Env(CallingEnv):
        script = f'<tool_call>{{"name":"{name}","arguments":{{"a":2,"b":3}}}}</tool_call>'

        def step(self, completion):
            first = not getattr(self, "_called", False)
            self._called = True
            if first:
                return ToolEnvironment.step(self, self.script)
            return None, None, True

    factory = lambda: Env([boom, hang, not_text, multiply], timeout=0.2)  # noqa: E731
    # the model is random: every token ends its turn, so each turn reaches the environment
    every = tuple(
        tok.decode([i], skip_special_tokens=False)
        for i in range(tok.vocab_size)
        if i not in tok.eos_ids
    )
    cfg = MultiTurnConfig(
        max_turns=3, max_new_tokens=4, max_completion_tokens=120, stop_strings=every
    )
    t0 = time.monotonic()
    ep = run_episodes(
        model, tok, [{"prompt": "2*3"}], factory, cfg, key=jax.random.key(0), num_generations=2
    )
    assert time.monotonic() - t0 < 25
    assert (ep.tool_calls == 1).all()
    assert (ep.tool_errors == (0 if name == "multiply" else 1)).all()
    assert (ep.turns == 2).all()
    text = ep.transcripts[0]
    assert ("<tool_response>6</tool_response>" in text) == (name == "multiply")
    if name != "multiply":
        # (the demo alphabet has no capitals: "Error" decodes as "<unk>rror")
        assert "<tool_response><unk>rror: " in text


def test_multi_turn_rollout_trains_one_step() -> None:
    """The rollout plugs into the unchanged trainer: one GRPO step on a multi-turn batch."""
    tok = tool_demo_tokenizer()
    trainer = _trainer(tok)
    ro_fn = _scripted_rollout()
    rewards = RewardCombiner([environment_reward])
    rows = ROWS
    ro = ro_fn(
        trainer,
        tok,
        rows,
        rewards,
        RolloutConfig(),
        key=jax.random.key(0),
        need_old_log_probs=True,
    )
    b = ro.batch.validate()
    assert b.batch_size == 8 and b.shared_prompts
    np.testing.assert_array_equal(
        np.asarray(b.old_log_probs) * (np.asarray(b.completion_mask) == 0), 0.0
    )
    metrics = trainer.train_step(b)
    assert np.isfinite(metrics["total_loss"])
    assert "multiturn/tool_calls_mean" in ro.metrics()
    # Every token's text is a stop string, so every greedy turn ends after one token whatever
    # the model is (the step above may leave it unchanged: equal rewards, no advantage).
    every = tuple(
        tok.decode([i], skip_special_tokens=False)
        for i in range(tok.vocab_size)
        if i not in tok.eos_ids
    )
    ev = _scripted_rollout(stop_strings=every).evaluate(
        trainer, tok, rows, environment_reward, RolloutConfig(), pass_threshold=3
    )
    assert ev["eval/pass@1"] == 1.0  # two turns: rewards 1 + 2
    assert b.step_rewards is None
    # per-turn rewards as process-supervision step rewards train too
    ro_fn = _scripted_rollout(turn_rewards_as_step_rewards=True)
    ro2 = ro_fn(trainer, tok, rows, rewards, RolloutConfig(), key=jax.random.key(1))
    assert ro2.batch.step_rewards is not None
    assert np.isfinite(trainer.train_step(ro2.batch)["total_loss"])


def test_sampler_log_probs_feed_the_mismatch_correction() -> None:
    """Multi-turn batches carry the sampler's log-probs of the model's tokens, so the sampler
    correction and its metrics work as in the single-turn rollout (top-k sampling makes the
    sampler differ from the trainer)."""
    tok = tool_demo_tokenizer()
    trainer = _trainer(tok, entropy_coeff=0.0, sampler_correction="truncate", sampler_ratio_max=2.0)
    ro_fn, rewards = _scripted_rollout(), RewardCombiner([environment_reward])
    key = jax.random.key(3)
    config = RolloutConfig(top_k=3)
    ro = ro_fn(trainer, tok, ROWS, rewards, config, key=key, need_old_log_probs=True)
    b = ro.batch.validate()
    mask = np.asarray(b.completion_mask) > 0
    assert mask.sum() > 0 and b.sampler_log_probs is not None
    np.testing.assert_array_equal(np.asarray(b.sampler_log_probs), ro.episodes.log_probs)
    sampler = np.asarray(b.sampler_log_probs)[mask]
    trainer_lp = np.asarray(b.old_log_probs)[mask]
    # Top-k renormalizes over 3 tokens: the sampler's probabilities are higher.
    assert (sampler >= trainer_lp - 1e-5).all() and (sampler > trainer_lp + 1e-3).any()
    metrics = trainer.train_step(b)
    d = trainer_lp - sampler
    np.testing.assert_allclose(metrics["sampler_logp_diff_mean"], np.abs(d).mean(), rtol=1e-4)
    assert metrics["sampler_ratio_max"] <= 2.0 + 1e-6
    # Without a correction (nor an off-policy mask) the batch does not carry them.
    ro = ro_fn(_trainer(tok), tok, ROWS, rewards, config, key=key)
    assert ro.batch.sampler_log_probs is None


def test_environment_protocol_and_config_checks() -> None:
    assert isinstance(ScriptedModelEnv(), Environment)
    assert isinstance(ToolEnvironment([multiply]), Environment)
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnConfig(max_turns=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        MultiTurnConfig(max_new_tokens=10, max_completion_tokens=5)
    with pytest.raises(ValueError, match="stop_strings"):
        MultiTurnConfig(stop_strings=("",))
    # A value of the wrong type is a TypeError (it was a ValueError before utils.validation).
    with pytest.raises(TypeError, match=r"MultiTurnConfig.max_turns must be an int, got 2.0"):
        MultiTurnConfig(max_turns=2.0)
    with pytest.raises(TypeError, match="turn_rewards_as_step_rewards must be a bool"):
        MultiTurnConfig(turn_rewards_as_step_rewards=1)
    with pytest.raises(TypeError, match="stop_strings must be a tuple"):
        MultiTurnConfig(stop_strings=["</tool_call>"])
    with pytest.raises(ValueError, match=r"completion_buckets\[1\] must be an int >= 1"):
        MultiTurnConfig(completion_buckets=(64, 0))
    with pytest.raises(TypeError, match="environment_factory must be callable"):
        MultiTurnRollout(None, MultiTurnConfig())
    assert TOOL_CHAT_TEMPLATE


def test_episodes_compile_once_per_shape() -> None:
    """Turns and episodes reuse the compiled decode and append programs: after a first batch of
    episodes, more episodes (other prompts of the same bucket, other keys, other turn counts)
    compile nothing new."""
    from artifex.generative_models.inference import multiturn as kv

    tok = tool_demo_tokenizer()
    model = _model(tok)
    cfg = MultiTurnConfig(
        max_turns=4,
        max_new_tokens=8,
        max_completion_tokens=128,
        stop_strings=tuple("0123456789*"),  # turns end early: several turns per episode
    )

    def run(rows, seed, turns):
        return run_episodes(
            model,
            tok,
            rows,
            lambda: ScriptedModelEnv(turns),
            cfg,
            key=jax.random.key(seed),
            num_generations=2,
        )

    ep = run([{"prompt": "3*4"}, {"prompt": "5*6"}], 0, 3)
    assert ep.turns.max() >= 2  # several turns went through the same programs
    decode, append = kv._decode._cache_size(), kv._append._cache_size()
    assert decode >= 1 and append >= 1
    for seed, turns, rows in (
        (1, 2, [{"prompt": "7*8"}, {"prompt": "9*2"}]),
        (2, 3, [{"prompt": "12*4"}, {"prompt": "6*66"}]),
    ):
        run(rows, seed, turns)
    assert kv._decode._cache_size() == decode
    assert kv._append._cache_size() == append


def test_stacked_layers_are_sliced_once_per_rollout(monkeypatch) -> None:
    """A model with stacked, unrolled layers runs the episodes of its per-layer twin, and its
    layers are sliced once for the rollout, not at each of the sampler's calls per turn."""
    from artifex.generative_models.inference import _layer_slices

    tok = tool_demo_tokenizer()
    cfg = MultiTurnConfig(max_turns=3, max_new_tokens=5, max_completion_tokens=64)
    slices = []
    layer_slice = _layer_slices._layer_slice

    def counting(stacks, layer):
        slices.append(int(layer))
        return layer_slice(stacks, layer)

    monkeypatch.setattr(_layer_slices, "_layer_slice", counting)
    episodes = []
    for stacked in (False, True):
        model = _model(tok, seed=3)
        if stacked:
            model.stack_layers()
        key = jax.random.key(2)
        episodes.append(run_episodes(model, tok, ROWS, lambda: ScriptedModelEnv(2), cfg, key=key))
        assert model.layers_stacked == stacked  # the caller's model keeps its storage
    assert slices == [0, 1]  # two layers, sliced once, for the stacked run only
    assert max(episodes[1].turns) == 2  # several sampler calls did run
    np.testing.assert_array_equal(episodes[0].completion_ids, episodes[1].completion_ids)
    np.testing.assert_array_equal(episodes[0].completion_mask, episodes[1].completion_mask)
    np.testing.assert_allclose(episodes[0].log_probs, episodes[1].log_probs, atol=1e-5)


def test_the_loop_scores_multi_turn_batches_itself() -> None:
    """With several updates per batch the loop scores old log-probs as its own stage: the
    rollout gets a policy without a scorer and never calls back into the trainer."""
    from artifex.generative_models.training.rl import TrainConfig, train

    tok = tool_demo_tokenizer()
    trainer = _trainer(tok, update_without_advantage=True)  # the scripted rewards tie
    inner, seen = _scripted_rollout(), []

    def rollout_fn(policy, *args, **kwargs):
        seen.append((policy.score, kwargs["need_old_log_probs"]))
        return inner(policy, *args, **kwargs)

    config = TrainConfig(num_steps=1, prompts_per_step=2, num_iterations=2, progress=False)
    result = train(trainer, tok, ROWS, environment_reward, config, rollout_fn=rollout_fn)
    assert seen == [(None, True)]
    assert np.isfinite(result.history[-1]["total_loss"]) and int(trainer.optimizer.step[...]) == 2
