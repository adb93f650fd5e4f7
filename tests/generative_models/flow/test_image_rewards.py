"""Image rewards and their combination."""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from artifex.generative_models.flow import (
    DigitClassifier,
    brightness_reward,
    classifier_reward,
    combine_image_rewards,
    compressibility_reward,
    load_digits_images,
    train_classifier,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_brightness_and_compressibility_against_numpy(seed):
    x = np.random.default_rng(seed).uniform(-1.2, 1.2, size=(4, 8, 8))
    flat = np.clip(x.reshape(4, -1), -1, 1)
    np.testing.assert_allclose(brightness_reward(x), ((flat + 1) / 2).mean(1), rtol=1e-6)
    q = np.round((flat + 1) * 127.5).astype(np.uint8)
    ref = [1 - len(zlib.compress(r.tobytes(), 9)) / 64 for r in q]
    np.testing.assert_allclose(compressibility_reward(x), ref, rtol=1e-6)
    flat_img = -np.ones((1, 8, 8))
    assert compressibility_reward(flat_img)[0] > compressibility_reward(x).max()


@pytest.mark.parametrize("seed", [0, 1])
def test_classifier_reward_is_softmax_of_requested_class(seed):
    clf = DigitClassifier(rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(5, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=5)
    logits = np.asarray(clf(jnp.asarray(x)), np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    got = classifier_reward(clf)(x, y)
    np.testing.assert_allclose(got, p[np.arange(5), y], rtol=1e-5)


@pytest.mark.slow
def test_trained_classifier_is_accurate():
    images, labels = load_digits_images()
    clf = DigitClassifier(hidden_dim=32, rngs=nnx.Rngs(0))
    acc = train_classifier(clf, images, labels, num_steps=150)
    assert acc > 0.9
    r = classifier_reward(clf)(images[:50], labels[:50])
    assert r.mean() > 0.7


def test_combine_image_rewards_like_text_rewards():
    x = np.random.default_rng(0).uniform(-1, 1, size=(4, 8, 8))
    y = np.zeros(4, np.int32)

    def half_missing(images, labels):
        return np.array([1.0, np.nan, 2.0, np.nan])

    got = combine_image_rewards([brightness_reward, half_missing], x, y, weights=[2.0, 0.5])
    want = 2.0 * brightness_reward(x) + 0.5 * np.nan_to_num(half_missing(x, y))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    normalized = combine_image_rewards([brightness_reward], x, y, mode="normalized", group_size=2)
    b = brightness_reward(x).astype(np.float64).reshape(2, 2)
    z = (b - b.mean(1, keepdims=True)) / (b.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(normalized, z.reshape(-1), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="must return shape"):
        combine_image_rewards([lambda imgs, labs: np.zeros(3)], x, y)
    with pytest.raises(ValueError, match="at least one"):
        combine_image_rewards([], x, y)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_images_get_an_error_not_a_score(bad):
    x = np.zeros((3, 8, 8))
    x[1, 2, 3] = bad
    clf = DigitClassifier(rngs=nnx.Rngs(0))
    for name, fn in (
        ("brightness_reward", brightness_reward),
        ("compressibility_reward", compressibility_reward),
        ("classifier_reward", lambda im, lab: classifier_reward(clf)(im, lab)),
    ):
        with pytest.raises(ValueError, match=rf"{name}: images must be finite.*first row 1"):
            fn(x, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="brightness_reward: images must be finite"):
        combine_image_rewards([brightness_reward], x, None)
