"""The flow rollout and evaluation stages: the batch the sampler and to_grpo_batch make."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowEvaluator,
    FlowModel,
    FlowModelConfig,
    FlowRollout,
    SDEConfig,
    TextFlowDiT,
    TextFlowDiTConfig,
    brightness_reward,
    compositional,
    encode_flow_prompts,
    image_reward,
    to_grpo_batch,
)
from artifex.generative_models.training.rl import (
    GRPOConfig,
    Policy,
    RewardCombiner,
    RolloutConfig,
)

CFG = TextFlowDiTConfig(
    image_shape=(8, 8, 3), patch_size=4, hidden_dim=16, num_blocks=1, num_heads=2, time_features=8
)
ROWS = [
    {"prompt": "a red square", "answer": 1},
    {"prompt": "two blue circles left of a green triangle", "answer": 2},
]


def _model(seed=0):
    model = TextFlowDiT(CFG, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(state))))
    nnx.update(
        model, jax.tree.map(lambda p: p + 0.2 * jax.random.normal(next(keys), p.shape), state)
    )
    return model


def test_the_rollout_is_the_sampler_and_to_grpo_batch():
    model = _model()
    seen = {}

    def answer_bonus(prompts, completions, answer, **columns):
        seen["answer"], seen["prompts"] = list(answer), list(prompts)
        return [0.1 * a for a in answer]

    combiner = RewardCombiner([compositional, answer_bonus], weights=[1.0, 2.0])
    sde = SDEConfig(num_steps=4, noise_level=0.8, window_size=2)
    key = jax.random.key(7)
    policy = Policy(model, GRPOConfig(num_generations=3))
    rollout = FlowRollout(sde)
    for need_old in (True, False):
        ro = rollout(
            policy, None, ROWS, combiner, RolloutConfig(), key=key, need_old_log_probs=need_old
        )
        k_sample, k_steps = jax.random.split(key)
        traj = rollout.sampler(
            model, CFG.tokenizer().encode([r["prompt"] for r in ROWS]), 3, k_sample
        )
        images = np.asarray(traj.images).reshape(6, 8, 8, 3)
        captions = [r["prompt"] for r in ROWS for _ in range(3)]
        comp = np.asarray(compositional(captions, list(images)), np.float64)
        bonus = np.repeat([0.1, 0.2], 3)
        np.testing.assert_allclose(ro.rewards_per_function[:, 0], comp, rtol=1e-6)
        np.testing.assert_allclose(ro.rewards_per_function[:, 1], bonus, rtol=1e-6)
        want = to_grpo_batch(traj, comp + 2.0 * bonus, group_size=3, key=k_steps)
        np.testing.assert_allclose(np.asarray(ro.batch.rewards), comp + 2.0 * bonus, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(ro.batch.prompt_ids), np.asarray(want.prompt_ids))
        np.testing.assert_array_equal(ro.batch.completion_ids, want.completion_ids)
        if need_old:
            np.testing.assert_array_equal(ro.batch.old_log_probs, want.old_log_probs)
        else:
            assert ro.batch.old_log_probs is None
        np.testing.assert_array_equal(ro.images, images)
        assert ro.window_start == int(np.argmax(np.asarray(traj.stochastic[0])))
        assert ro.metrics()["flow/window_start"] == ro.window_start
        assert ro.metrics()["rewards/compositional"] == pytest.approx(comp.mean())
    assert rollout.sampler.num_compilations == 1
    assert seen["answer"] == [1, 1, 1, 2, 2, 2] and seen["prompts"] == captions
    assert ro.prompts == [r["prompt"] for r in ROWS] and len(ro.completions) == 6
    assert ro.completions[0].startswith("image 8x8x3, mean ")
    assert ro.batch.completion_ids.shape == (6, 2) and ro.lengths.tolist() == [2] * 6


def test_class_labels_and_prompt_errors():
    cfg = FlowModelConfig(
        image_shape=(4, 4), num_classes=3, hidden_dim=8, num_blocks=1, time_features=8
    )
    model = FlowModel(cfg, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(
        encode_flow_prompts(model, None, [2, "1", np.int64(0)]), [2, 1, 0]
    )
    with pytest.raises(ValueError, match=r"class labels must be in \[0, 3\), got 3 at row 1"):
        encode_flow_prompts(model, None, [0, 3])
    with pytest.raises(TypeError, match="integer class labels, got str 'a red square' at row 0"):
        encode_flow_prompts(model, None, ["a red square"])
    with pytest.raises(TypeError, match="integer class labels, got bool"):
        encode_flow_prompts(model, None, [True])
    with pytest.raises(TypeError, match=r"takes captions \(strings\), got int at row 1"):
        encode_flow_prompts(_model(), None, ["a red square", 3])
    with pytest.raises(ValueError, match="word 'purple' is not in the vocabulary"):
        encode_flow_prompts(_model(), None, ["a purple square"])
    rollout = FlowRollout(SDEConfig(num_steps=2))
    policy = Policy(model, GRPOConfig(num_generations=2))
    combiner = RewardCombiner([image_reward(brightness_reward)])
    ro = rollout(
        policy,
        None,
        [{"label": 2}],
        combiner,
        RolloutConfig(prompt_column="label"),
        key=jax.random.key(0),
    )
    assert ro.images.shape == (2, 4, 4, 1) and ro.batch.conditioning.prompts.tolist() == [2, 2]
    with pytest.raises(ValueError, match="row 0 has no prompt column 'prompt'"):
        rollout(policy, None, [{"label": 2}], combiner, RolloutConfig(), key=jax.random.key(0))
    with pytest.raises(ValueError, match="a placement is not supported"):
        rollout(
            policy,
            None,
            [{"prompt": 2}],
            combiner,
            RolloutConfig(),
            key=jax.random.key(0),
            placement=object(),
        )
    with pytest.raises(ValueError, match="noise_level > 0"):
        FlowRollout(SDEConfig(num_steps=2, noise_level=0.0))
    with pytest.raises(TypeError, match="sde must be an SDEConfig"):
        FlowRollout({"num_steps": 2})
    with pytest.raises(TypeError, match="describe must be callable"):
        FlowRollout(SDEConfig(num_steps=2), describe="shapes")
    with pytest.raises(ValueError, match=r"window_start needs SDEConfig\.window_size"):
        FlowRollout(SDEConfig(num_steps=4), window_start=0)
    with pytest.raises(ValueError, match="window_start"):
        FlowRollout(SDEConfig(num_steps=4, window_size=2), window_start=3)


def test_a_fixed_window_start():
    sde = SDEConfig(num_steps=4, window_size=2)
    policy = Policy(_model(), GRPOConfig(num_generations=2))
    combiner = RewardCombiner([compositional])
    for start in (0, 2):
        ro = FlowRollout(sde, window_start=start)(
            policy, None, ROWS[:1], combiner, RolloutConfig(), key=jax.random.key(start)
        )
        assert ro.window_start == start
        np.testing.assert_array_equal(ro.batch.completion_ids, [[start, start + 1]] * 2)


def test_the_evaluator_is_deterministic_pads_and_writes_grids(tmp_path):
    model = _model(1)
    rows = [{"prompt": p} for p in ("a red square", "two blue circles", "a green triangle")]
    steps = iter([0, 5])
    ev = FlowEvaluator(
        4,
        images_per_prompt=2,
        image_dir=tmp_path,
        step_fn=lambda: next(steps),
        batch_size=2,
        grid_images=4,
        describe=lambda im: f"{im.shape[0]}px",
    )
    policy = Policy(model, GRPOConfig(num_generations=2))
    m1 = ev(policy, None, rows, compositional, RolloutConfig(), pass_threshold=0.5)
    images = ev.sample(model, None, [r["prompt"] for r in rows])
    assert images.shape == (6, 8, 8, 3) and ev.sampler.num_compilations == 1  # padded chunk
    scores = np.asarray(compositional([r["prompt"] for r in rows for _ in range(2)], list(images)))
    assert m1 == {
        "eval/pass@1": pytest.approx(float(np.mean(scores >= 0.5))),
        "eval/reward_mean": pytest.approx(float(scores.astype(np.float64).mean())),
    }
    m2 = ev(policy, None, rows, compositional, RolloutConfig(), pass_threshold=0.5)
    assert m1 == m2  # the same noise at every evaluation
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "eval_000000.jsonl",
        "eval_000000.png",
        "eval_000005.jsonl",
        "eval_000005.png",
    ]
    lines = [json.loads(x) for x in (tmp_path / "eval_000005.jsonl").read_text().splitlines()]
    assert [(x["row"], x["in_grid"], x["description"]) for x in lines[:5:2]] == [
        (0, True, "8px"),
        (1, True, "8px"),
        (2, False, "8px"),
    ]
    assert [x["reward"] for x in lines] == pytest.approx(scores.tolist())

    def none_for_first(prompts, completions, **columns):
        return [None] + [1.0] * (len(completions) - 1)

    m3 = FlowEvaluator(4)(policy, None, rows[:2], none_for_first, RolloutConfig())
    assert m3 == {"eval/pass@1": 0.5, "eval/reward_mean": 1.0}  # no reward: a failure
    with pytest.raises(ValueError, match="eval row 0 has no prompt column 'text'"):
        FlowEvaluator(4)(policy, None, rows, compositional, RolloutConfig(prompt_column="text"))
    with pytest.raises(ValueError, match="num_steps must be"):
        FlowEvaluator(1)
