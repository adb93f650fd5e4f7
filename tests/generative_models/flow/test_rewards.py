"""Image rewards in the loop's reward protocol: the same values as the image functions."""

from __future__ import annotations

import numpy as np
import pytest

from artifex.generative_models.flow import (
    brightness_reward,
    compositional,
    compositional_reward,
    image_reward,
    make_shapes_dataset,
)
from artifex.generative_models.training.rl import RewardCombiner, RewardFunctionError


def test_image_reward_gives_the_image_functions_values():
    images, captions = make_shapes_dataset(12, seed=4)
    wrong = captions[1:] + captions[:1]
    want = compositional_reward()(images, wrong)
    assert compositional(wrong, list(images)) == pytest.approx(want.tolist())
    assert compositional.__name__ == "compositional"
    x = np.random.default_rng(0).uniform(-1, 1, (3, 4, 4, 3))
    reward = image_reward(brightness_reward)
    expected = np.mean((x.reshape(3, -1).astype(np.float64) + 1) / 2, axis=1)
    np.testing.assert_allclose(reward([0, 1, 2], list(x)), expected, rtol=1e-6)
    assert reward.__name__ == "brightness_reward"
    assert image_reward(brightness_reward, name="bright").__name__ == "bright"


def test_bad_completions_and_functions():
    with pytest.raises(TypeError, match="fn must be callable"):
        image_reward(3)
    with pytest.raises(ValueError, match="completions must be images of one shape"):
        compositional(["a red square"] * 2, [np.zeros((4, 4, 3)), np.zeros((8, 8, 3))])
    with pytest.raises(ValueError, match="completions must be images of one shape"):
        compositional(["a red square"], ["not an image"])
    combiner = RewardCombiner([compositional])
    images = np.full((2, 32, 32, 3), -1.0, np.float32)
    with pytest.raises(
        RewardFunctionError,
        match=r"(?s)'compositional' raised ValueError at row 1.*expected a colour",
    ):
        combiner(["a red square", "a pink square"], list(images), group_size=2)
