"""Image rewards in the training loop's reward protocol.

The loop calls every reward function as ``f(prompts, completions, **columns)`` with one entry
per row. For a flow model a row's completion is its image, ``(H, W, C)`` float32 in
``[-1, 1]``, and its prompt is the dataset's prompt (a caption, or a class label).
:func:`image_reward` turns an image reward of
:mod:`~artifex.generative_models.models.flow` (``fn(images, prompts) -> (B,)``) into such a
function; :func:`compositional` is the GenEval-style compositional reward ready for
``--reward artifex.generative_models.flow.rewards:compositional``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from artifex.generative_models.models.flow.compositional import compositional_reward

__all__ = ["compositional", "image_reward"]


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
        >>> from artifex.generative_models.models.flow import brightness_reward
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


def compositional(
    prompts: Sequence[str], completions: Sequence[Any], **columns: Any
) -> list[float]:
    """The compositional reward of images against their captions, in the loop's protocol.

    The fraction of GenEval-style checks an image passes (each group present, its count, the
    relation, nothing else;
    :func:`~artifex.generative_models.models.flow.compositional_reward`), for
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
        >>> from artifex.generative_models.flow import compositional
        >>> from artifex.generative_models.models.flow import draw_scene, parse_caption
        >>> image = draw_scene(parse_caption("two red squares"), np.random.default_rng(0))
        >>> [round(r, 3) for r in compositional(["two red squares", "a red square"], [image] * 2)]
        [1.0, 0.667]
    """
    return _compositional(prompts, completions, **columns)
