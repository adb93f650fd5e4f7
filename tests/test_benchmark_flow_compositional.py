"""benchmarks/flow_compositional.py on a tiny task, so that the script keeps running.

The measured runs (hundreds of steps) are in docs/flow-grpo.md; here a shapes model of width 16
pretrained for 3 steps goes through 2 GRPO steps. The per-check
rates the script prints are checked against the loop's own evaluations of the same images:
its "fraction" and "correct" before and after training are the evaluation's mean reward and
compositional accuracy (pass@1) at steps 0 and 2, which FlowEvaluator computes through the
reward function, not through the script's scene_checks loop. The tiny model's images pass
some checks (the mean reward is above 0), so the comparison is not of zeros.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from artifex.flow_shapes import main as prepare
from artifex.generative_models.flow import (
    SHAPES_VOCABULARY,
    TextFlowDiT,
    WordTokenizer,
    draw_scene,
    load_flow_model,
    parse_caption,
    split_captions,
)
from artifex.generative_models.flow.text_encoder import TEXT_ENCODER
from benchmarks import flow_compositional


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("task") / "shapes"
    argv = ["--out", str(out), "--num-images", "16", "--hidden-dim", "16", "--num-blocks", "1",
            "--num-heads", "2", "--pretrain-steps", "3", "--batch-size", "4"]  # fmt: skip
    assert prepare(argv) == 0
    return out


@pytest.mark.slow
def test_the_script_trains_records_and_saves(task, tmp_path):
    # one training reward: the three are the script's REWARDS table over functions that
    # tests/generative_models/flow/test_shapes.py checks against scene_checks
    reward = "counts"
    out = tmp_path / "grpo"
    argv = ["--task", str(task), "--out", str(out), "--grpo-steps", "2", "--eval-every", "2",
            "--prompts-per-step", "2", "--generations", "2", "--sde-steps", "3",
            "--reward", reward, "--beta", "0", "--freeze-text-encoder"]  # fmt: skip
    summary = flow_compositional.main(argv)
    assert json.loads((out / "results.json").read_text()) == summary
    assert [e["step"] for e in summary["evaluations"]] == [0, 2]
    assert len(summary["train_reward"]) == 2
    before, after = summary["checks"]["before"], summary["checks"]["after"]
    assert set(before) == set(after) >= {"present_0", "count_0", "no_extra", "correct"}
    for rates in (before, after):
        for name, value in rates.items():
            assert name == "shapes_over" or 0.0 <= value <= 1.0
    first, last = summary["evaluations"][0], summary["evaluations"][-1]
    assert first["eval/reward_mean"] > 0
    assert before["fraction"] == pytest.approx(first["eval/reward_mean"], rel=1e-6)
    assert after["fraction"] == pytest.approx(last["eval/reward_mean"], rel=1e-6)
    assert before["correct"] == pytest.approx(first["eval/pass@1"])
    assert after["correct"] == pytest.approx(last["eval/pass@1"])
    for probe in summary["relation_probe"].values():  # its meaning: the stand-in models below
        assert set(probe) == {"loss_true", "loss_flipped", "gain"}
        assert all(np.isfinite(v) for v in probe.values())
    model = load_flow_model(out / "model")
    assert isinstance(model, TextFlowDiT) and model.config.hidden_dim == 16
    # --freeze-text-encoder: the encoder is the pretrained one, the rest has trained
    start = load_flow_model(task / "model")
    for which, same in ((TEXT_ENCODER, True), (nnx.All(nnx.Param, nnx.Not(TEXT_ENCODER)), False)):
        pairs = zip(
            jax.tree.leaves(nnx.state(model, which)),
            jax.tree.leaves(nnx.state(start, which)),
            strict=True,
        )
        assert all(np.array_equal(a, b) for a, b in pairs) == same


class _MeanImageModel:
    """A stand-in flow model whose velocity points at the mean drawn scene of its caption.

    ``reads_relation=False`` uses the mean over the caption and its flipped twin instead, so
    its output cannot depend on the relation.
    """

    def __init__(self, reads_relation: bool):
        self.reads_relation = reads_relation
        self.config = SimpleNamespace(tokenizer=lambda: WordTokenizer(SHAPES_VOCABULARY, 8))
        self._means: dict[str, np.ndarray] = {}

    def _mean(self, caption: str) -> np.ndarray:
        if caption not in self._means:
            rng = np.random.default_rng(0)
            scene = parse_caption(caption)
            self._means[caption] = np.mean(
                [draw_scene(scene, rng).reshape(-1) for _ in range(200)], axis=0
            )
        return self._means[caption]

    def __call__(self, x, t, tokens):
        captions = self.config.tokenizer().decode(np.asarray(tokens))
        means = []
        for caption in captions:
            mean = self._mean(caption)
            if not self.reads_relation:
                relation = parse_caption(caption).relation
                twin = caption.replace(relation, flow_compositional.FLIP[relation])
                mean = (mean + self._mean(twin)) / 2
            means.append(mean)
        t = np.asarray(t)[:, None]
        return (np.asarray(x) - np.stack(means)) / t


def test_the_relation_probe_tells_a_model_that_reads_the_relation():
    captions = [c for c in split_captions(0.2, seed=0)[1] if parse_caption(c).relation][:12]
    reader = flow_compositional.relation_probe(_MeanImageModel(True), captions, seed=1)
    blind = flow_compositional.relation_probe(_MeanImageModel(False), captions, seed=1)
    assert reader["gain"] > 0.01  # knowing the side of each group lowers the loss
    assert blind["gain"] == 0.0  # the same output for the true and the flipped caption
    assert blind["loss_true"] > reader["loss_true"]
    with pytest.raises(ValueError, match="no caption with a relation"):
        flow_compositional.relation_probe(_MeanImageModel(True), ["a red square"])
    with pytest.raises(ValueError, match=r"t_min must be in \[0, 1\)"):
        flow_compositional.relation_probe(_MeanImageModel(True), captions, t_min=1.0)
