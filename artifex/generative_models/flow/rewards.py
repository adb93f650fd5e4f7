"""Image rewards: plain callables on arrays, their combination, and the training loop's protocol.

An image reward is ``fn(images, labels) -> (B,)``: ``images`` ``(B, H, W)`` (or flattened) in
``[-1, 1]`` as NumPy or JAX arrays, ``labels`` ``(B,)`` the requested classes; a value may be
NaN ("no reward"). :func:`combine_image_rewards` combines several of them exactly as text
rewards are combined (weighted sum, or GDPO-style per-reward normalization), through
:func:`~artifex.generative_models.training.rl.rewards.combine_reward_columns`.

The training loop calls every reward function as ``f(prompts, completions, **columns)`` with
one entry per row. For a flow model a row's completion is its image, ``(H, W, C)`` float32 in
``[-1, 1]``, and its prompt is the dataset's prompt (a caption, or a class label).
:func:`image_reward` turns an image reward into such a function; :func:`compositional` is the
GenEval-style compositional reward ready for
``--reward artifex.generative_models.flow.rewards:compositional``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from artifex.generative_models.flow.detection import compositional_reward
from artifex.generative_models.training.rl.rewards import CombineMode, combine_reward_columns

__all__ = [
    "DigitClassifier",
    "ImageReward",
    "brightness_reward",
    "classifier_reward",
    "combine_image_rewards",
    "compositional",
    "compositional_correct",
    "compositional_counts",
    "compressibility_reward",
    "image_reward",
    "train_classifier",
]

ImageReward = Callable[[Any, Any], Any]


def _finite_images(images: Any, name: str) -> np.ndarray:
    """``images`` as float64 rows ``(B, -1)``; ``ValueError`` naming the rows that are not finite.

    A NaN or infinite image would otherwise get a real score (clipped to the brightest value,
    or compressed as whatever bytes the cast makes).
    """
    x = np.asarray(images, np.float64)
    x = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, 1)
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if bad.size:
        msg = (
            f"{name}: images must be finite, got NaN or infinite values in {bad.size} row(s), "
            f"first row {bad[0]}"
        )
        raise ValueError(msg)
    return x


class DigitClassifier(nnx.Module):
    """A small MLP classifier ``images -> logits`` for flattened tiny images.

    Args:
        data_dim: Pixels per image.
        num_classes: Number of classes.
        hidden_dim: Hidden width.
        rngs: Initialization randomness.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import DigitClassifier
        >>> clf = DigitClassifier(data_dim=16, num_classes=3, hidden_dim=8, rngs=nnx.Rngs(0))
        >>> clf(jnp.zeros((2, 4, 4))).shape  # images are flattened
        (2, 3)
    """

    def __init__(
        self, data_dim: int = 64, num_classes: int = 10, hidden_dim: int = 128, *, rngs: nnx.Rngs
    ):
        self.fc1 = nnx.Linear(data_dim, hidden_dim, rngs=rngs)
        self.fc2 = nnx.Linear(hidden_dim, hidden_dim, rngs=rngs)
        self.out = nnx.Linear(hidden_dim, num_classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        """Logits of ``images``.

        Args:
            images: ``(B, ...)`` images in ``[-1, 1]`` (flattened inside).

        Returns:
            ``(B, num_classes)`` float32 logits.
        """
        x = jnp.asarray(images, jnp.float32).reshape(images.shape[0], -1)
        return self.out(nnx.gelu(self.fc2(nnx.gelu(self.fc1(x)))))


def train_classifier(
    classifier: DigitClassifier,
    images: np.ndarray | jax.Array,
    labels: np.ndarray | jax.Array,
    *,
    num_steps: int = 500,
    batch_size: int = 128,
    learning_rate: float = 3e-3,
    noise_std: float = 0.1,
    seed: int = 0,
) -> float:
    """Trains ``classifier`` in place with cross-entropy (Adam, one compiled scan).

    Gaussian input noise (``noise_std``) makes it less brittle on generated images.

    Args:
        classifier: The classifier (updated in place).
        images: ``(N, ...)`` images in ``[-1, 1]``.
        labels: ``(N,)`` int labels.
        num_steps: Optimizer steps.
        batch_size: Images per step.
        learning_rate: Adam learning rate.
        noise_std: Standard deviation of the input noise.
        seed: Seeds batches and noise.

    Returns:
        The accuracy on ``images`` after training.

    Examples:
        >>> import numpy as np
        >>> from flax import nnx
        >>> from artifex.generative_models.flow import DigitClassifier, train_classifier
        >>> rng = np.random.default_rng(0)
        >>> labels = rng.integers(0, 2, 64)
        >>> images = np.where(labels[:, None] == 1, 0.8, -0.8) + 0.1 * rng.normal(size=(64, 16))
        >>> clf = DigitClassifier(data_dim=16, num_classes=2, hidden_dim=8, rngs=nnx.Rngs(0))
        >>> accuracy = train_classifier(clf, images, labels, num_steps=50, batch_size=32)
        >>> accuracy
        1.0
    """
    images = jnp.asarray(images, jnp.float32)
    labels = jnp.asarray(labels, jnp.int32)
    n = images.shape[0]
    optimizer = nnx.Optimizer(classifier, optax.adam(learning_rate), wrt=nnx.Param)
    graphdef, state = nnx.split((classifier, optimizer))

    def loss_fn(model: DigitClassifier, x: jax.Array, y: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    @jax.jit
    def run(state: nnx.State, key: jax.Array) -> nnx.State:
        def step(state: nnx.State, key: jax.Array) -> tuple[nnx.State, None]:
            model, opt = nnx.merge(graphdef, state)
            k_idx, k_noise = jax.random.split(key)
            idx = jax.random.randint(k_idx, (batch_size,), 0, n)
            x = images[idx] + noise_std * jax.random.normal(k_noise, images[idx].shape)
            grads = nnx.grad(loss_fn)(model, x, labels[idx])
            opt.update(model, grads)
            return nnx.state((model, opt)), None

        return jax.lax.scan(step, state, jax.random.split(key, num_steps))[0]

    nnx.update((classifier, optimizer), run(state, jax.random.key(seed)))
    return float(jnp.mean(jnp.argmax(classifier(images), axis=-1) == labels))


def classifier_reward(classifier: Callable[[jax.Array], jax.Array]) -> ImageReward:
    """Reward = the classifier's probability of the requested class.

    ``r_i = softmax(classifier(x_i))_{y_i}``, in ``[0, 1]``.

    Args:
        classifier: ``images -> (B, C)`` logits (e.g. a trained :class:`DigitClassifier`).

    Returns:
        ``fn(images, labels) -> (B,)`` float32 NumPy rewards; it raises ``ValueError`` for NaN
        or infinite images.

    Examples:
        >>> import jax.numpy as jnp
        >>> from artifex.generative_models.flow import classifier_reward
        >>> logits = lambda images: jnp.log(jnp.array([[0.25, 0.75]] * images.shape[0]))
        >>> reward = classifier_reward(logits)
        >>> reward(jnp.zeros((2, 4)), jnp.array([1, 0])).round(3).tolist()
        [0.75, 0.25]
    """
    graphdef, state = nnx.split(classifier) if isinstance(classifier, nnx.Module) else (None, None)

    @jax.jit
    def probs(state: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        model = classifier if graphdef is None else nnx.merge(graphdef, state)
        p = jax.nn.softmax(jnp.asarray(model(images), jnp.float32), axis=-1)
        return jnp.take_along_axis(p, labels[:, None], axis=-1)[:, 0]

    def reward(images: Any, labels: Any) -> np.ndarray:
        _finite_images(images, "classifier_reward")
        images = jnp.asarray(images, jnp.float32)
        return np.asarray(probs(state, images, jnp.asarray(labels, jnp.int32)))

    reward.__name__ = "classifier_reward"
    return reward


def brightness_reward(images: Any, labels: Any = None) -> np.ndarray:
    """Mean brightness of each image mapped to ``[0, 1]``: ``mean((x + 1) / 2)``.

    Args:
        images: ``(B, ...)`` images in ``[-1, 1]``.
        labels: Unused (the reward ignores the prompt).

    Returns:
        ``(B,)`` float32 rewards.

    Raises:
        ValueError: NaN or infinite images.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow import brightness_reward
        >>> brightness_reward(np.stack([np.full((2, 2), -1.0), np.ones((2, 2))])).tolist()
        [0.0, 1.0]
    """
    x = _finite_images(images, "brightness_reward")
    return np.mean((np.clip(x, -1.0, 1.0) + 1.0) / 2.0, axis=1).astype(np.float32)


def compressibility_reward(images: Any, labels: Any = None) -> np.ndarray:
    """Compressibility: ``1 - len(zlib(q)) / len(q)`` of the image quantized to 8 bits ``q``.

    Simpler images (large flat regions) compress better and score higher (the "compressibility"
    reward of DDPO, with zlib instead of JPEG).

    Args:
        images: ``(B, ...)`` images in ``[-1, 1]``.
        labels: Unused.

    Returns:
        ``(B,)`` float32 rewards (may be slightly negative for incompressible tiny images).

    Raises:
        ValueError: NaN or infinite images.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow import compressibility_reward
        >>> flat = np.zeros((1, 8, 8))
        >>> noisy = np.random.default_rng(0).uniform(-1, 1, (1, 8, 8))
        >>> bool(compressibility_reward(flat)[0] > compressibility_reward(noisy)[0])
        True

    References:
        Black et al., 2023, "Training Diffusion Models with Reinforcement Learning",
        arXiv:2305.13301.
    """
    x = _finite_images(images, "compressibility_reward")
    q = np.round((np.clip(x, -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8)
    out = [1.0 - len(zlib.compress(row.tobytes(), 9)) / row.size for row in q]
    return np.asarray(out, np.float32)


def combine_image_rewards(
    funcs: Sequence[ImageReward],
    images: Any,
    labels: Any,
    *,
    weights: Sequence[float] | None = None,
    mode: CombineMode = "sum",
    group_size: int | None = None,
) -> np.ndarray:
    """Evaluates image rewards and combines them like text rewards.

    Each function gives a column of ``(B, F)`` rewards (NaN = no reward), combined by
    :func:`~artifex.generative_models.training.rl.rewards.combine_reward_columns`
    (``"sum"``: weighted sum; ``"normalized"``: per-reward standardization first).

    Args:
        funcs: Image rewards ``fn(images, labels) -> (B,)``.
        images: ``(B, ...)`` images.
        labels: ``(B,)`` requested classes.
        weights: One weight per function; ``None`` means all ones.
        mode: ``"sum"`` or ``"normalized"``.
        group_size: For ``"normalized"``: standardize within groups of this many rows.

    Returns:
        ``(B,)`` float32 combined rewards.

    Raises:
        ValueError: No functions, or a function returned the wrong shape.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow import (
        ...     brightness_reward, combine_image_rewards)
        >>> images = np.stack([np.full((2, 2), -1.0), np.ones((2, 2))])
        >>> combine_image_rewards([brightness_reward, brightness_reward], images, None,
        ...                       weights=[1.0, 0.5]).tolist()
        [0.0, 1.5]
    """
    if not funcs:
        msg = "combine_image_rewards needs at least one reward function"
        raise ValueError(msg)
    b = np.shape(images)[0]
    columns = []
    for fn in funcs:
        col = np.asarray(fn(images, labels), np.float64)
        if col.shape != (b,):
            name = getattr(fn, "__name__", type(fn).__name__)
            msg = f"image reward {name} must return shape ({b},), got {col.shape}"
            raise ValueError(msg)
        columns.append(col)
    return combine_reward_columns(
        np.stack(columns, axis=1), weights=weights, mode=mode, group_size=group_size
    )


def image_reward(fn: Callable[[Any, Any], Any], name: str | None = None) -> Callable[..., Any]:
    """A loop reward ``f(prompts, completions, **columns)`` scoring images with ``fn``.

    Args:
        fn: ``fn(images, prompts) -> (B,)``: ``images`` ``(B, H, W, C)`` stacked from the
            completions, ``prompts`` the rows' prompts as given (captions or class labels).
        name: The reward's name in the logs (default ``fn``'s ``__name__``).

    Returns:
        The reward function; it returns ``B`` floats and raises ``ValueError`` for
        completions that are not images of one shape.

    Raises:
        TypeError: ``fn`` is not callable.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow.rewards import image_reward
        >>> from artifex.generative_models.flow import brightness_reward
        >>> reward = image_reward(brightness_reward)
        >>> reward(["a", "b"], [np.ones((2, 2, 3)), -np.ones((2, 2, 3))]), reward.__name__
        ([1.0, 0.0], 'brightness_reward')
    """
    if not callable(fn):
        msg = f"fn must be callable (images, prompts) -> rewards, got {type(fn).__name__}"
        raise TypeError(msg)
    label = name or getattr(fn, "__name__", type(fn).__name__)

    def reward(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        shapes = {np.shape(c) for c in completions}
        if len(shapes) != 1 or len(next(iter(shapes))) not in (2, 3):
            msg = (
                f"{label}: completions must be images of one shape (H, W[, C]), got shapes "
                f"{sorted(shapes)[:3]}"
            )
            raise ValueError(msg)
        images = np.stack([np.asarray(c, np.float32) for c in completions])
        values = np.asarray(fn(images, list(prompts)), np.float64).reshape(-1)
        return [float(v) for v in values]

    reward.__name__ = label
    reward.__qualname__ = label
    return reward


_compositional = image_reward(compositional_reward(), name="compositional")
_compositional_correct = image_reward(
    compositional_reward(score="correct"), name="compositional_correct"
)
_compositional_counts = image_reward(
    compositional_reward(score="counts"), name="compositional_counts"
)


def compositional(
    prompts: Sequence[str], completions: Sequence[Any], **columns: Any
) -> list[float]:
    """The compositional reward of images against their captions, in the loop's protocol.

    The fraction of GenEval-style checks an image passes (each group present, its count, the
    relation, nothing else;
    :func:`~artifex.generative_models.flow.compositional_reward`), for
    ``--reward artifex.generative_models.flow.rewards:compositional``.

    Args:
        prompts: ``B`` captions of the shapes grammar.
        completions: ``B`` images ``(H, W, 3)`` in ``[-1, 1]``.
        **columns: Other dataset columns (unused).

    Returns:
        ``B`` rewards in ``[0, 1]``.

    Raises:
        ValueError: Captions outside the grammar, images that are not finite or not of one
            shape.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow import compositional, draw_scene, parse_caption
        >>> image = draw_scene(parse_caption("two red squares"), np.random.default_rng(0))
        >>> [round(r, 3) for r in compositional(["two red squares", "a red square"], [image] * 2)]
        [1.0, 0.667]
    """
    return _compositional(prompts, completions, **columns)


def compositional_correct(
    prompts: Sequence[str], completions: Sequence[Any], **columns: Any
) -> list[float]:
    """1 for an image that passes every compositional check of its caption, else 0.

    GenEval's score of an image (the compositional accuracy as a reward;
    ``compositional_reward(score="correct")``), for
    ``--reward artifex.generative_models.flow.rewards:compositional_correct``. Unlike
    :func:`compositional`, it gives no partial credit: a model cannot raise it by drawing
    extra shapes to pass the *present* checks.

    Args:
        prompts: ``B`` captions of the shapes grammar.
        completions: ``B`` images ``(H, W, 3)`` in ``[-1, 1]``.
        **columns: Other dataset columns (unused).

    Returns:
        ``B`` rewards, each 0.0 or 1.0.

    Raises:
        ValueError: As :func:`compositional`.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow import (
        ...     compositional_correct, draw_scene, parse_caption)
        >>> image = draw_scene(parse_caption("two red squares"), np.random.default_rng(0))
        >>> compositional_correct(["two red squares", "a red square"], [image] * 2)
        [1.0, 0.0]
    """
    return _compositional_correct(prompts, completions, **columns)


def compositional_counts(
    prompts: Sequence[str], completions: Sequence[Any], **columns: Any
) -> list[float]:
    """The fraction of an image's compositional checks passed, leaving out *present*.

    Each group's count, the relation (for two groups) and *nothing else*
    (``compositional_reward(score="counts")``), for
    ``--reward artifex.generative_models.flow.rewards:compositional_counts``: partial credit
    as :func:`compositional`, without the *present* checks that an image with extra shapes
    passes.

    Args:
        prompts: ``B`` captions of the shapes grammar.
        completions: ``B`` images ``(H, W, 3)`` in ``[-1, 1]``.
        **columns: Other dataset columns (unused).

    Returns:
        ``B`` rewards in ``[0, 1]``.

    Raises:
        ValueError: As :func:`compositional`.

    Examples:
        >>> import numpy as np
        >>> from artifex.generative_models.flow import (
        ...     compositional_counts, draw_scene, parse_caption)
        >>> image = draw_scene(parse_caption("two red squares"), np.random.default_rng(0))
        >>> [round(r, 3) for r in compositional_counts(["two red squares", "a red square"],
        ...                                            [image] * 2)]
        [1.0, 0.5]
    """
    return _compositional_counts(prompts, completions, **columns)
