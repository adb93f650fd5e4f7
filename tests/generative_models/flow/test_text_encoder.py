"""Pretraining the text encoder alone, the layout probe and a frozen encoder in flow training."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    FlowModel,
    FlowModelConfig,
    FlowTrainConfig,
    TextFlowDiT,
    TextFlowDiTConfig,
    make_shapes_dataset,
    train_flow_matching,
)
from artifex.generative_models.flow.text_encoder import (
    LAYOUT_SLOTS,
    TEXT_ENCODER,
    TextPretrainConfig,
    layout_accuracy,
    layout_targets,
    pretrain_text_encoder,
)

# pairs with the same words and opposite layouts: a bag of words cannot tell them apart
SWAPPED = [
    "a red square left of a blue circle",
    "a blue circle left of a red square",
    "a green triangle above a yellow square",
    "a yellow square above a green triangle",
    "a red circle right of a green square",
    "a green square right of a red circle",
]


def _model(text_layers=1, seed=0):
    cfg = TextFlowDiTConfig(hidden_dim=32, num_blocks=1, num_heads=2, text_layers=text_layers)
    return TextFlowDiT(cfg, rngs=nnx.Rngs(seed))


def _params(model, which):
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, which))
    }


def test_layout_targets_name_each_slot():
    colour = {"none": 0, "red": 1, "green": 2, "blue": 3, "yellow": 4}
    shape = {"none": 0, "square": 1, "circle": 2, "triangle": 3}
    got = layout_targets(
        [
            "three yellow triangles",
            "two red squares left of a blue circle",
            "a green circle right of a red triangle",
            "two blue triangles above a yellow square",
            "a red circle below a green square",
        ]
    )
    assert got.shape == (5, len(LAYOUT_SLOTS), 3) and got.dtype == np.int32
    expected = np.zeros_like(got)
    slot = {s: i for i, s in enumerate(LAYOUT_SLOTS)}
    expected[0, slot["only"]] = (colour["yellow"], shape["triangle"], 3)
    expected[1, slot["left"]] = (colour["red"], shape["square"], 2)
    expected[1, slot["right"]] = (colour["blue"], shape["circle"], 1)
    expected[2, slot["right"]] = (colour["green"], shape["circle"], 1)
    expected[2, slot["left"]] = (colour["red"], shape["triangle"], 1)
    expected[3, slot["top"]] = (colour["blue"], shape["triangle"], 2)
    expected[3, slot["bottom"]] = (colour["yellow"], shape["square"], 1)
    expected[4, slot["bottom"]] = (colour["red"], shape["circle"], 1)
    expected[4, slot["top"]] = (colour["green"], shape["square"], 1)
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="purple"):
        layout_targets(["a purple square"])


def test_pretraining_reads_word_order_and_touches_only_the_encoder():
    model = _model()
    encoder_before = _params(model, TEXT_ENCODER)
    rest = nnx.All(nnx.Param, nnx.Not(TEXT_ENCODER))
    rest_before = _params(model, rest)
    assert {k.split("'")[1] for k in encoder_before} == {
        "word",
        "word_position",
        "text_layers",
        "text_norm",
    }
    history = pretrain_text_encoder(model, SWAPPED, TextPretrainConfig(num_steps=200))
    assert len(history["loss"]) == len(history["exact"]) == 200
    assert history["loss"][-1] < 0.1 * history["loss"][0]
    assert history["exact"][-1] == 1.0
    assert layout_accuracy(model, SWAPPED) == 1.0
    for name, value in _params(model, rest).items():
        np.testing.assert_array_equal(value, rest_before[name], err_msg=name)
    after = _params(model, TEXT_ENCODER)
    changed = {
        k.split("'")[1] for k, v in after.items() if not np.array_equal(v, encoder_before[k])
    }
    assert changed == {"word", "word_position", "text_layers", "text_norm"}


def test_the_probe_caps_a_bag_of_words_encoder_at_half_the_swapped_pairs():
    model = _model(text_layers=0)  # no text layers: the pooled output is a mean over tokens...
    model.word_position[...] = np.zeros_like(np.asarray(model.word_position[...]))  # ...of words
    pairs = SWAPPED[:2] + SWAPPED[4:]  # two pairs with the same words
    assert layout_accuracy(model, pairs, num_steps=400) <= 0.5
    with pytest.raises(ValueError, match="at least one caption"):
        layout_accuracy(model, [])
    with pytest.raises(ValueError, match="num_steps"):
        layout_accuracy(model, pairs, num_steps=0)


def test_a_frozen_encoder_stays_bit_for_bit_while_the_rest_trains():
    model = _model()
    images, captions = make_shapes_dataset(16, seed=0)
    tokens = model.config.tokenizer().encode(captions)
    encoder_before = _params(model, TEXT_ENCODER)
    rest = nnx.All(nnx.Param, nnx.Not(TEXT_ENCODER))
    rest_before = _params(model, rest)
    config = FlowTrainConfig(num_steps=3, batch_size=4, freeze_text_encoder=True)
    train_flow_matching(model, images, tokens, config)
    for name, value in _params(model, TEXT_ENCODER).items():
        np.testing.assert_array_equal(value, encoder_before[name], err_msg=name)
    moved = [k for k, v in _params(model, rest).items() if not np.array_equal(v, rest_before[k])]
    assert len(moved) > 0.5 * len(rest_before)
    # without freezing, the encoder trains too
    train_flow_matching(model, images, tokens, FlowTrainConfig(num_steps=3, batch_size=4))
    after = _params(model, TEXT_ENCODER)
    assert any(not np.array_equal(after[k], encoder_before[k]) for k in after)


def test_bad_input():
    class_model = FlowModel(
        FlowModelConfig(image_shape=(4, 4), hidden_dim=8, num_blocks=1, time_features=8),
        rngs=nnx.Rngs(0),
    )
    config = FlowTrainConfig(num_steps=1, batch_size=2, freeze_text_encoder=True)
    needs = r"FlowTrainConfig\.freeze_text_encoder needs a text-conditioned model"
    with pytest.raises(ValueError, match=needs):
        train_flow_matching(class_model, np.zeros((2, 4, 4)), np.zeros(2, np.int32), config)
    with pytest.raises(TypeError, match="freeze_text_encoder must be a bool"):
        FlowTrainConfig(freeze_text_encoder=1)
    with pytest.raises(TypeError, match="TextFlowDiT"):
        pretrain_text_encoder(class_model, SWAPPED)
    with pytest.raises(TypeError, match="TextPretrainConfig"):
        pretrain_text_encoder(_model(), SWAPPED, {"num_steps": 3})
    with pytest.raises(ValueError, match="at least one caption"):
        pretrain_text_encoder(_model(), [])
    for field, value in (("num_steps", 0), ("batch_size", 0), ("learning_rate", 0.0)):
        with pytest.raises(ValueError, match=field):
            TextPretrainConfig(**{field: value})


def test_caption_lists_and_seeds_are_checked():
    model = _model()
    with pytest.raises(TypeError, match="captions must be a list of captions, got one string"):
        layout_targets("a red square")
    with pytest.raises(TypeError, match="captions must hold strings, got int at row 1"):
        layout_targets(["a red square", 3])
    with pytest.raises(TypeError, match="one string"):
        pretrain_text_encoder(model, "a red square")
    with pytest.raises(TypeError, match="held_out must be a list of captions"):
        layout_accuracy(model, SWAPPED, held_out="a red square")
    with pytest.raises(ValueError, match="purple"):
        layout_accuracy(model, SWAPPED, held_out=["a purple square"])
    with pytest.raises(TypeError, match="seed"):
        layout_accuracy(model, SWAPPED, seed=True)


def test_a_diverging_text_pretraining_leaves_the_model_as_it_was():
    model = _model()
    before = _params(model, nnx.Param)
    config = TextPretrainConfig(num_steps=5, learning_rate=1e30)
    with pytest.raises(FloatingPointError, match="non-finite at step"):
        pretrain_text_encoder(model, SWAPPED, config)
    for name, value in _params(model, nnx.Param).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
