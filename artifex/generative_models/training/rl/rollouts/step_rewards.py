r"""Step rewards from single-turn reward functions (process supervision).

A *step reward function* scores the reasoning steps of each completion instead of the whole
completion. The completion's text is cut into steps after every ``separator`` (kept at the end
of its step; a last piece without it is a step too, an empty one is not), and the function is
called as

    ``f(prompts, completions, steps, **columns) -> list[Sequence[float | None] | None]``

with ``steps[i]`` the list of step texts of completion ``i``; it returns, per row, one reward per
step (``None`` or NaN: no reward for that step) or ``None`` for the whole row. The rollout puts
step ``k``'s reward at the completion token where the text of step ``k`` ends (the first token
whose decoded prefix covers the step's last character; the last step's at the last completion
token, EOS included) into ``GRPOBatch.step_rewards``, NaN elsewhere, and the advantages come
from :func:`~artifex.generative_models.training.rl.core.advantages.process_advantages`
(DeepSeekMath, sec. 4.1.3): all step rewards of a group normalized together,

.. math::

    \tilde r = \frac{r - \operatorname{mean}(R)}{\operatorname{std}(R) + \varepsilon}, \qquad
    \hat A_{i,t} = \sum_{s \ge t} \gamma^{s - t}\, \tilde r_{i,s},

with ``gamma = GRPOConfig.gamma``. The outcome rewards are still computed, logged and used by
dynamic sampling; to fold the outcome into the steps, add it to the last step's reward.

References:
    Shao et al., 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.3; Lightman et al., 2023,
    "Let's Verify Step by Step", arXiv:2305.20050.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from artifex.generative_models.training.rl.rewards.base import RewardFunctionError, callable_name
from artifex.generative_models.utils.validation import check_callable, check_str

__all__ = ["StepRewards", "split_steps", "step_end_tokens"]


def split_steps(completion: str, separator: str) -> list[str]:
    r"""The steps of a completion: pieces ending with ``separator`` (kept), then the rest.

    Args:
        completion: The decoded completion.
        separator: A non-empty string that ends a step (e.g. ``"\n"``).

    Returns:
        The steps; joined they give ``completion`` back. An empty completion has none.

    Raises:
        TypeError: ``completion`` or ``separator`` is not a string.
        ValueError: ``separator`` is empty.

    Examples:
        >>> from artifex.generative_models.training.rl.rollouts.step_rewards import split_steps
        >>> split_steps("a=1\nb=2\nso 3", "\n")
        ['a=1\n', 'b=2\n', 'so 3']
        >>> split_steps("a=1\n", "\n"), split_steps("", "\n")
        (['a=1\n'], [])
    """
    check_str("separator", separator)
    if not isinstance(completion, str):
        msg = f"completion must be a str, got {type(completion).__name__}"
        raise TypeError(msg)
    pieces = completion.split(separator)
    steps = [p + separator for p in pieces[:-1]]
    if pieces[-1]:
        steps.append(pieces[-1])
    return steps


def step_end_tokens(
    tokenizer: Any, ids: Sequence[int], ends: Sequence[int], *, text_length: int | None = None
) -> list[int]:
    """For each character offset in ``ends``, the first token whose decoded prefix reaches it.

    ``tokenizer.decode(ids[:j + 1])`` (special tokens skipped) is searched by bisection for the
    smallest ``j`` whose text is at least ``end`` characters long; an offset at or past the end
    of the text maps to the last token (EOS included).

    Args:
        tokenizer: Anything with ``decode(ids, skip_special_tokens=True) -> str``.
        ids: The completion's token ids (padding excluded, EOS included).
        ends: Character offsets in the decoded completion, each ``> 0``.
        text_length: The decoded completion's length, when known.

    Returns:
        One token index per offset.

    Examples:
        >>> from artifex.generative_models.models.causal_lm import Tokenizer
        >>> from artifex.generative_models.training.rl.rollouts.step_rewards import step_end_tokens
        >>> tok = Tokenizer.for_characters("0123456789+=")
        >>> ids = tok.encode("12+3=15", add_special_tokens=False) + [tok.eos_ids[0]]
        >>> step_end_tokens(tok, ids, [3, 5, 7])  # "12+" | "3=" | "15" + EOS
        [2, 4, 7]
    """
    ids = [int(i) for i in ids]
    if not ids:
        return []
    if text_length is None:
        text_length = len(tokenizer.decode(ids, skip_special_tokens=True))
    cache: dict[int, int] = {}

    def length(j: int) -> int:  # decoded length of ids[: j + 1]
        if j not in cache:
            cache[j] = len(tokenizer.decode(ids[: j + 1], skip_special_tokens=True))
        return cache[j]

    out = []
    for end in ends:
        if end >= text_length:
            out.append(len(ids) - 1)
            continue
        lo, hi = 0, len(ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if length(mid) >= end:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return out


def _step_reward(value: Any, where: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = f"{where} must be a number or None, got {value!r}"
        raise ValueError(msg)
    value = float(value)
    if math.isinf(value):
        msg = f"{where} is infinite ({value}); use None or NaN for no reward"
        raise ValueError(msg)
    return value


@dataclasses.dataclass(frozen=True)
class StepRewards:
    r"""A step reward function and the text that ends a step.

    Args:
        fn: ``fn(prompts, completions, steps, **columns)`` returning, per row, one reward per
            step (``None``/NaN: none) or ``None`` (see the module docstring).
        separator: The text that ends a step (kept at the end of its step).

    Attributes:
        fn: The step reward function.
        separator: The step separator.

    Raises:
        TypeError: ``fn`` is not callable or ``separator`` not a string.
        ValueError: ``separator`` is empty.

    Examples:
        >>> from artifex.generative_models.training.rl.rollouts.step_rewards import StepRewards
        >>> def digits_per_step(prompts, completions, steps, **columns):
        ...     return [[float(any(c.isdigit() for c in s)) for s in row] for row in steps]
        >>> rewards = StepRewards(digits_per_step, separator="\n")
        >>> rewards.score(["q"], ["x=1\nok"])
        [[1.0, 0.0]]
        >>> rewards.name, rewards.fingerprint
        ('digits_per_step', {'name': 'digits_per_step', 'separator': '\n'})
    """

    fn: Callable[..., Any]
    separator: str = "\n"

    def __post_init__(self) -> None:
        check_callable("StepRewards.fn", self.fn)
        check_str("StepRewards.separator", self.separator)

    @property
    def name(self) -> str:
        """The function's ``__name__`` (its class name for a callable object without one)."""
        return callable_name(self.fn)

    @property
    def fingerprint(self) -> dict[str, str]:
        """What a resumed run must share: the function's name and the separator."""
        return {"name": self.name, "separator": self.separator}

    def score(
        self, prompts: list[str], completions: list[str], **columns: Any
    ) -> list[list[float]]:
        """Calls the function on the completions' steps and checks what it returns.

        Args:
            prompts: ``B`` prompts.
            completions: ``B`` decoded completions.
            **columns: Dataset columns, each ``B`` values (a column ``steps`` is an error).

        Returns:
            Per row, one float per step (NaN: no reward).

        Raises:
            RewardFunctionError: The function raised (chained).
            ValueError: A ``steps`` column, or an output of the wrong length or with a value
                that is not a finite number or ``None``, naming the function and the row.
        """
        if "steps" in columns:
            msg = f"step reward {self.name}: the dataset column 'steps' clashes with its steps"
            raise ValueError(msg)
        steps = [split_steps(c, self.separator) for c in completions]
        try:
            out = self.fn(prompts, completions, steps=steps, **columns)
        except Exception as err:
            msg = f"step reward function {self.name} raised {type(err).__name__}: {err}"
            raise RewardFunctionError(
                msg, function_name=self.name, function_index=0, row=None
            ) from err
        if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence | np.ndarray):
            msg = f"step reward {self.name} must return a list of B rows, got {type(out).__name__}"
            raise ValueError(msg)
        if len(out) != len(completions):
            msg = f"step reward {self.name} returned {len(out)} rows for {len(completions)}"
            raise ValueError(msg)
        rows: list[list[float]] = []
        for i, (row, row_steps) in enumerate(zip(out, steps, strict=True)):
            if row is None:
                rows.append([math.nan] * len(row_steps))
                continue
            if isinstance(row, str | bytes) or not isinstance(row, Sequence | np.ndarray):
                msg = (
                    f"step reward {self.name}, row {i}: expected one reward per step (a list), "
                    f"got {type(row).__name__}"
                )
                raise ValueError(msg)
            if len(row) != len(row_steps):
                msg = (
                    f"step reward {self.name}, row {i}: {len(row)} rewards for "
                    f"{len(row_steps)} steps (split at {self.separator!r})"
                )
                raise ValueError(msg)
            where = f"step reward {self.name}, row {i}"
            rows.append([_step_reward(v, f"{where}, step {k}") for k, v in enumerate(row)])
        return rows

    def token_rewards(
        self,
        tokenizer: Any,
        prompts: list[str],
        completions: list[str],
        completion_ids: Any,
        lengths: Any,
        **columns: Any,
    ) -> np.ndarray:
        """The ``(B, T)`` step rewards of a batch: :meth:`score` placed at each step's last token.

        Args:
            tokenizer: The tokenizer the completions were decoded with.
            prompts: ``B`` prompts.
            completions: ``B`` decoded completions.
            completion_ids: ``(B, T)`` completion token ids.
            lengths: ``(B,)`` completion lengths in tokens (EOS included).
            **columns: Dataset columns.

        Returns:
            ``(B, T)`` float32, NaN where no step ends.
        """
        ids = np.asarray(completion_ids)
        out = np.full(ids.shape, np.nan, np.float32)
        scored = self.score(prompts, completions, **columns)
        for i, (row, text) in enumerate(zip(scored, completions, strict=True)):
            if not row:
                continue
            ends = np.cumsum([len(s) for s in split_steps(text, self.separator)]).tolist()
            n = int(lengths[i])
            tokens = step_end_tokens(tokenizer, ids[i, :n], ends, text_length=len(text))
            for t, value in zip(tokens, row, strict=True):
                if not math.isnan(value):
                    if not math.isnan(out[i, t]):  # two steps end in one token: add them
                        value += float(out[i, t])
                    out[i, t] = value
        return out
