"""Math answers: extraction, exact number parsing, comparison, and the correctness reward."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import threading
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from artifex.generative_models.training.rl.rewards.base import (
    RewardFunction,
    _check_name,
    _check_reward_value,
    _column,
)
from artifex.generative_models.utils.validation import check_bool, check_choice, check_str

__all__ = [
    "AnswerExtraction",
    "MathBackend",
    "answers_equal",
    "extract_answer",
    "math_answer_reward",
    "normalize_number",
]

# --------------------------------------------------------------------------------------------
# Math answers: extraction, number normalization, comparison
# --------------------------------------------------------------------------------------------

_MAX_ANSWER_CHARS = 512  # longer "answers" are compared as text only
_MAX_EXPONENT = 400  # |k| in 1e{k} or \times 10^{k}
_MAX_DEPTH = 8

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BOXED_TOKEN_RE = re.compile(r"[^\s$]+")
_HASH_RE = re.compile(r"####[ \t]*([-+\u2212$\\(.*0-9][^\n]*)")
_NUMBER_IN_TEXT_RE = re.compile(
    r"(?:(?<![0-9A-Za-z])[-+\u2212])?"
    r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+(?:\.[0-9]+)?)?|\.[0-9]+)"
)
_DECIMAL_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?")
_THOUSANDS_RE = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?")
_TIMES_TEN_RE = re.compile(r"(.+)\\(?:times|cdot)10\^(?:\{([+-]?[0-9]+)\}|([0-9]))")
_TEXT_UNIT_RE = re.compile(
    r"^(.*?[0-9}.])\s*\\(?:text|textrm|mbox|mathrm)\{\s*[A-Za-z][A-Za-z\s.]*\}\s*$"
)
_TEXT_WRAP_RE = re.compile(
    r"\\(?:text|textrm|textbf|textit|mbox|mathrm|mathbf|boxed|fbox)\{([^{}]*)\}"
)
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_WIDE_SPACE_RE = re.compile(r"\\(?:qquad|quad)(?![A-Za-z])|\\[;: ]|~")
_DEGREES_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_VARIABLE_RE = re.compile(r"^[A-Za-z]\s*=\s*")
_SPACES_NOT_BETWEEN_DIGITS_RE = re.compile(r"(?<![0-9])\s+|\s+(?![0-9])")
_CLOSING = {"(": ")", "[": "]", "{": "}"}


def _match_brace(text: str, start: int) -> int | None:
    r"""Index of the ``}`` closing the ``{`` at ``start`` (``\{``/``\}`` escaped), else None."""
    return _brace_pairs(text, start).get(start)


def _brace_pairs(text: str, start: int) -> dict[int, int]:
    r"""Maps each ``{`` at or after ``start`` to its closing ``}`` (one pass, escapes skipped)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _last_boxed(text: str) -> tuple[int, str] | None:
    r"""Start and content of the last well-formed, non-empty ``\boxed``/``\fbox``."""
    matches = list(_BOXED_RE.finditer(text))
    pairs = _brace_pairs(text, matches[0].start()) if matches else {}
    for match in reversed(matches):
        i = match.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            close = pairs.get(i)
            if close is None:
                continue
            content = text[i + 1 : close].strip()
        else:
            token = _BOXED_TOKEN_RE.match(text, i)
            content = token.group(0) if token else ""
        if content:
            return match.start(), content
    return None


def _last_hash(text: str) -> tuple[int, str] | None:
    """Start and content of the last ``#### answer`` line (cut at a closing tag)."""
    for match in reversed(list(_HASH_RE.finditer(text))):
        content = match.group(1).split("</", 1)[0].strip()
        if content:
            return match.start(), content
    return None


def _last_answer_tag(text: str) -> tuple[int, str] | None:
    """Start and content of the last complete ``<answer>...</answer>`` block."""
    close = text.rfind("</answer>")
    if close < 0:
        return None
    start = text.rfind("<answer>", 0, close)
    if start < 0:
        return None
    content = text[start + len("<answer>") : close].strip()
    return (start, content) if content else None


def extract_answer(text: str, *, last_number_fallback: bool = False) -> str | None:
    r"""Extracts the final answer from a solution or completion.

    Three markers are recognized; the one that starts last in the text wins (so a ``\boxed``
    inside an ``<answer>`` block wins over the block, and the last of several boxes wins):

    - LaTeX ``\boxed{...}`` / ``\fbox{...}`` with nested braces, or the brace-less
      ``\boxed 5`` form (the next whitespace-free token). Unclosed boxes are skipped.
    - GSM8K ``#### 42``: the rest of the line, which must start like a number (a digit, sign,
      ``$``, ``\``, ``(``, ``.`` or Markdown bold ``**``), so a Markdown heading
      ``#### Step 2`` is not an answer.
    - ``<answer>...</answer>`` (the R1-style format): the last complete block's content.

    When no marker is found, ``last_number_fallback=True`` returns the last number in the text
    (integers, decimals, ``1,234``-style thousands and ``a/b`` fractions, with a sign);
    otherwise ``None``. The fallback is off by default: it rewards unformatted answers and
    can pick up a number that is not the answer.

    Args:
        text: the completion or reference solution.
        last_number_fallback: fall back to the last number when no marker is present.

    Returns:
        The answer string as written (not normalized), or ``None`` when there is none.

    Raises:
        TypeError: if ``text`` is not a string.

    Examples:
        >>> from artifex.generative_models.training.rl import extract_answer
        >>> extract_answer("So the total is 12 apples. #### 12")
        '12'
        >>> extract_answer("<answer>3/4</answer>")
        '3/4'
        >>> extract_answer("I think it is 7", last_number_fallback=True), extract_answer("no idea")
        ('7', None)

    References:
        Cobbe et al., "Training Verifiers to Solve Math Word Problems" (GSM8K),
        arXiv:2110.14168, 2021; Hendrycks et al., "Measuring Mathematical Problem Solving With
        the MATH Dataset", arXiv:2103.03874, 2021.
    """
    if not isinstance(text, str):
        msg = f"text must be a str, got {type(text).__name__}"
        raise TypeError(msg)
    candidates = [
        c for c in (_last_boxed(text), _last_hash(text), _last_answer_tag(text)) if c is not None
    ]
    if candidates:
        return max(candidates, key=lambda c: c[0])[1]
    if last_number_fallback:
        return _last_number(text)
    return None


def _clean(answer: str) -> str:
    r"""Removes LaTeX presentation and units so that equal answers are written alike.

    Drops ``\left``/``\right``, spacing commands, ``$``, ``%``, degree marks, a leading
    ``x =``, Markdown bold, a trailing period, a trailing ``\text{unit}`` after a number (the MATH
    convention), unwraps ``\text{...}``, maps ``\dfrac``/``\tfrac`` to ``\frac``, the
    unicode minus to ``-`` and ``{,}`` to ``,``, and removes whitespace except between digits.
    """
    s = answer.strip().replace("\u2212", "-")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT_RE.sub("", s)
    s = s.replace("{,}", ",").replace("\\,", "").replace("\\!", "")
    s = _WIDE_SPACE_RE.sub(" ", s)
    s = _DEGREES_RE.sub("", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.strip()
    unit = _TEXT_UNIT_RE.match(s)
    if unit:
        s = unit.group(1)
    for _ in range(_MAX_DEPTH):
        unwrapped = _TEXT_WRAP_RE.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = s.strip().strip("*").strip().rstrip(".").strip()
    s = _VARIABLE_RE.sub("", s)
    return _SPACES_NOT_BETWEEN_DIGITS_RE.sub("", s)


def _latex_args(s: str, start: int, count: int) -> tuple[list[str], int] | None:
    """Reads ``count`` LaTeX arguments (``{...}`` groups or single characters) from ``start``."""
    args: list[str] = []
    i = start
    for _ in range(count):
        if i >= len(s):
            return None
        if s[i] == "{":
            close = _match_brace(s, i)
            if close is None:
                return None
            args.append(s[i + 1 : close])
            i = close + 1
        elif s[i] == "\\":
            command = re.match(r"\\[A-Za-z]+|\\.", s[i:])
            if command is None:
                return None
            args.append(command.group(0))
            i += len(command.group(0))
        else:
            args.append(s[i])
            i += 1
    return args, i


def _parse_decimal(s: str) -> Fraction | None:
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    match = _DECIMAL_RE.fullmatch(s)
    if match is None:
        return None
    if match.group(1) is not None and abs(int(match.group(1))) > _MAX_EXPONENT:
        return None
    try:
        return Fraction(s)
    except ValueError:  # more digits than int() converts
        return None


def _parse_number(s: str, depth: int = 0) -> Fraction | None:
    """Parses a cleaned answer into an exact rational, or ``None``."""
    if depth > _MAX_DEPTH or not s:
        return None
    if s[0] in _CLOSING and s[-1] == _CLOSING[s[0]]:
        if s[0] == "{":
            close = _match_brace(s, 0)
        else:  # parentheses and brackets: the first opener must close at the very end
            level, close = 0, None
            for i, char in enumerate(s):
                level += char == s[0]
                level -= char == _CLOSING[s[0]]
                if level == 0:
                    close = i
                    break
        if close == len(s) - 1:
            return _parse_number(s[1:-1], depth + 1)
    if s[0] in "+-":
        if len(s) > 1 and s[1] in "+-":
            return None
        value = _parse_number(s[1:], depth + 1)
        if value is None:
            return None
        return -value if s[0] == "-" else value
    if s.startswith("\\frac"):
        parsed = _latex_args(s, len("\\frac"), 2)
        if parsed is None or parsed[1] != len(s):
            return None
        numerator = _parse_number(parsed[0][0], depth + 1)
        denominator = _parse_number(parsed[0][1], depth + 1)
        if numerator is None or not denominator:
            return None
        return numerator / denominator
    times_ten = _TIMES_TEN_RE.fullmatch(s)
    if times_ten:
        exponent = int(times_ten.group(2) or times_ten.group(3))
        mantissa = _parse_number(times_ten.group(1), depth + 1)
        if mantissa is None or abs(exponent) > _MAX_EXPONENT:
            return None
        return mantissa * Fraction(10) ** exponent
    if s.count("/") == 1:
        top, bottom = s.split("/")
        numerator = _parse_number(top, depth + 1)
        denominator = _parse_number(bottom, depth + 1)
        if numerator is None or not denominator:
            return None
        return numerator / denominator
    return _parse_decimal(s)


def normalize_number(answer: str) -> Fraction | None:
    r"""Parses an answer string into an exact rational number.

    Accepted forms (after removing LaTeX presentation, see below): integers and decimals
    (``72``, ``72.``, ``5.00``, ``.5``), scientific notation (``1.5e3``, ``1.5\times10^{3}``),
    thousands separators in groups of exactly three (``1,234,567.5``; ``1,2`` is *not* a
    number), fractions ``a/b``, ``\frac{a}{b}``, ``\dfrac``, ``\tfrac``, ``\frac12`` (also
    nested), a sign (``-``, ``+``, the unicode minus ``−``) and enclosing parentheses.

    Removed before parsing: ``$`` and ``\$``, ``%`` and ``\%`` (the number is kept, not divided
    by 100), ``^\circ``/``°``, ``\left``/``\right``, LaTeX spacing (``\,`` ``\!`` ``\;``
    ``\quad`` ``~``), ``{,}``, a trailing ``\text{unit}`` after a number (``5\text{ cm}``),
    ``\text{...}`` wrappers, Markdown bold ``**``, a leading single-letter ``x =``, a trailing
    period, and whitespace (except between two digits: ``1 2`` is not ``12``). Plain unit words
    are *not* removed (``18 dollars`` is not a number): that would also turn ``3 million`` into
    ``3``.
    Mixed numbers (``2\frac{1}{2}``), irrational forms (``\sqrt2``, ``\pi``), division by zero,
    exponents beyond ±400 and answers longer than 512 characters give ``None``.

    Args:
        answer: an extracted answer (see :func:`extract_answer`), not a whole solution.

    Returns:
        The value as a ``fractions.Fraction``, or ``None`` if the answer is not a number.

    Raises:
        TypeError: if ``answer`` is not a string.

    Examples:
        >>> from artifex.generative_models.training.rl import normalize_number
        >>> normalize_number("1,000"), normalize_number("0.75"), normalize_number("3/4")
        (Fraction(1000, 1), Fraction(3, 4), Fraction(3, 4))
        >>> normalize_number("x + 1") is None
        True
    """
    if not isinstance(answer, str):
        msg = f"answer must be a str, got {type(answer).__name__}"
        raise TypeError(msg)
    if len(answer) > _MAX_ANSWER_CHARS:
        return None
    return _parse_number(_clean(answer))


def normalize_answer_text(answer: str) -> str:
    """An extracted answer as text to compare: cleaned of markup, all whitespace removed."""
    return re.sub(r"\s+", "", _clean(answer))


def answers_equal(a: str, b: str) -> bool:
    r"""Whether two extracted answers are the same.

    If both parse as numbers (:func:`normalize_number`) they are compared exactly as
    rationals, with no float tolerance (``0.75 == 3/4 == \frac{3}{4}``, ``0.333 != 1/3``). If
    exactly one parses, they differ. Otherwise the answers are compared as text after the same
    LaTeX clean-up with all whitespace removed (``\text{Monday}`` equals ``Monday``,
    ``\left( 1, 2 \right)`` equals ``(1,2)``); empty answers never match. The relation is
    symmetric.

    Args:
        a: an extracted answer.
        b: another extracted answer.

    Returns:
        ``True`` if the answers are equivalent.

    Raises:
        TypeError: if ``a`` or ``b`` is not a string.

    Examples:
        >>> from artifex.generative_models.training.rl import answers_equal
        >>> answers_equal("0.5", "1/2"), answers_equal("1,000", "1000"), answers_equal("2", "3")
        (True, True, False)
    """
    x, y = normalize_number(a), normalize_number(b)
    if x is not None and y is not None:
        return x == y
    if x is not None or y is not None:
        return False
    ta, tb = normalize_answer_text(a), normalize_answer_text(b)
    return bool(ta) and ta == tb


def _reference_answer(reference: Any) -> str | None:
    """The answer of a dataset reference: a solution, a bare answer or a number."""
    if reference is None:
        return None
    if isinstance(reference, np.generic):
        reference = reference.item()
    if isinstance(reference, bool):
        msg = f"reference answer must be a str or a number, got bool {reference!r}"
        raise TypeError(msg)
    if isinstance(reference, (int, Fraction)):
        return str(reference)
    if isinstance(reference, float):
        return repr(reference) if math.isfinite(reference) else None
    if not isinstance(reference, str):
        msg = f"reference answer must be a str or a number, got {type(reference).__name__}"
        raise TypeError(msg)
    answer = extract_answer(reference)
    if answer is None:
        answer = reference.strip()
    return answer or None


MathBackend = Literal["auto", "math_verify", "builtin"]
AnswerExtraction = Literal["markers", "last_number"]

_MATH_VERIFY_HINT = (
    'install it with `pip install "artifex-grpo[math]"` (or `pip install math-verify`)'
)


def _math_verify() -> Any | None:
    """The ``math_verify`` module, or ``None`` when it is not installed."""
    if importlib.util.find_spec("math_verify") is None:
        return None
    return importlib.import_module("math_verify")


def _resolve_backend(backend: str) -> Any | None:
    """The ``math_verify`` module for the math-verify backend, ``None`` for the built-in one."""
    check_choice("backend", backend, ("auto", "math_verify", "builtin"))
    if backend == "builtin":
        return None
    module = _math_verify()
    if module is None and backend == "math_verify":
        msg = (
            "math_answer_reward(backend='math_verify') needs the math-verify package, which is "
            f"not installed: {_MATH_VERIFY_HINT}"
        )
        raise ImportError(msg)
    return module


def _math_verify_equal(module: Any, predicted: str, expected: str) -> bool:
    r"""Whether math-verify finds two extracted answers equivalent.

    Each answer is wrapped in ``$...$`` so that math-verify reads it as LaTeX; its signal-based
    timeouts only work in the main thread, so other threads run without them.
    """
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = module.parse(f"${expected}$", parsing_timeout=timeout)
    target = module.parse(f"${predicted}$", parsing_timeout=timeout)
    if not gold or not target:
        return False
    return bool(module.verify(gold, target, timeout_seconds=timeout))


def _last_number(text: str) -> str | None:
    """The last number in ``text`` (see :func:`extract_answer`'s fallback), or ``None``."""
    found = _NUMBER_IN_TEXT_RE.findall(text)
    return found[-1] if found else None


def math_answer_reward(
    answer_column: str = "answer",
    *,
    correct_reward: float = 1.0,
    incorrect_reward: float = 0.0,
    last_number_fallback: bool = False,
    extraction: AnswerExtraction = "markers",
    backend: MathBackend = "auto",
    name: str = "math_answer_reward",
) -> RewardFunction:
    r"""Final-answer correctness reward for math problems (GSM8K, MATH).

    ``R = correct_reward`` if ``equal(extract(completion), extract(reference))``, else
    ``incorrect_reward`` (also when the completion has no answer); ``None`` ("no reward") only
    when the reference is missing (``None``, NaN or empty). The reference comes from
    ``columns[answer_column]``: a GSM8K solution (``... #### 72``), a bare or boxed answer, or
    a number; :func:`extract_answer` finds its answer (a reference without a marker is its own).

    The completion's answer is found by ``extraction="markers"``: :func:`extract_answer`, the
    last ``\boxed{...}``, ``#### ...`` or ``<answer>...</answer>``; or by
    ``extraction="last_number"``: the last number in the completion, markers or not (lm-eval's
    "flexible extract"; a LaTeX ``\frac{1}{2}`` reads as ``2``).

    The answers are compared by ``backend="builtin"``: :func:`answers_equal` (exact rationals,
    ``0.75 == 3/4 == \frac{3}{4}``, else cleaned LaTeX text); by ``backend="math_verify"``:
    equal when :func:`answers_equal` says so, different when both are plain numbers, else the
    ``math-verify`` package compares them symbolically as LaTeX (``2^{10} == 1024``); an
    answer it cannot parse is wrong (install it with the ``math`` extra); or by
    ``backend="auto"``: ``"math_verify"`` when that package is installed, else ``"builtin"``.

    Args:
        answer_column: name of the dataset column with the reference answers.
        correct_reward: reward for a correct answer.
        incorrect_reward: reward for a wrong or missing answer.
        last_number_fallback: with ``extraction="markers"``, use the completion's last number
            when it has no answer marker (``extraction="last_number"`` always does).
        extraction: how the completion's answer is found: ``"markers"`` or ``"last_number"``.
        backend: how answers are compared: ``"auto"``, ``"math_verify"`` or ``"builtin"``.
        name: the returned function's ``__name__`` (used in logs and errors).

    Returns:
        A reward function ``f(prompts, completions, **columns) -> list[float | None]`` with an
        ``extract_answer`` attribute (for maj@n).

    Raises:
        ValueError: (here) if ``answer_column`` or ``name`` is empty, a reward value is not
            finite, or ``extraction``/``backend`` is unknown; (when called) if the column is
            missing or has the wrong length.
        TypeError: (here) if an argument has the wrong type; (when called) if a completion is
            not a string or a reference is neither a string nor a number.
        ImportError: (here) with ``backend="math_verify"`` when math-verify is not installed.

    Examples:
        >>> from artifex.generative_models.training.rl import math_answer_reward
        >>> reward = math_answer_reward(extraction="last_number", backend="builtin")
        >>> reward(["q", "q"], ["5 + 7 = 12 apples", "I think 13."], answer=["... #### 12"] * 2)
        [1.0, 0.0]

    References:
        Cobbe et al., "Training Verifiers to Solve Math Word Problems" (GSM8K),
        arXiv:2110.14168, 2021; Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical
        Reasoning in Open Language Models", arXiv:2402.03300, 2024 (rule-based accuracy
        rewards for GRPO); Kydlíček et al., "Math-Verify" (Hugging Face), 2025.
    """
    check_str("answer_column", answer_column)
    correct = _check_reward_value(correct_reward, "correct_reward")
    incorrect = _check_reward_value(incorrect_reward, "incorrect_reward")
    func_name = _check_name(name)
    fallback = check_bool("last_number_fallback", last_number_fallback)
    check_choice("extraction", extraction, ("markers", "last_number"))
    verifier = _resolve_backend(backend)

    def extract(completion: str) -> str | None:
        if extraction == "last_number":
            return _last_number(completion)
        return extract_answer(completion, last_number_fallback=fallback)

    def equal(predicted: str, expected: str) -> bool:
        if answers_equal(predicted, expected):
            return True
        if verifier is None:
            return False
        if normalize_number(predicted) is not None and normalize_number(expected) is not None:
            return False  # two different plain numbers: exact comparison is final
        return _math_verify_equal(verifier, predicted, expected)

    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        references = _column(columns, answer_column, len(completions), func_name)
        rewards: list[float | None] = []
        for i, (completion, reference) in enumerate(zip(completions, references, strict=True)):
            if not isinstance(completion, str):
                msg = f"{func_name}: completion {i} must be a str, got {type(completion).__name__}"
                raise TypeError(msg)
            expected = _reference_answer(reference)
            if expected is None:
                rewards.append(None)
                continue
            predicted = extract(completion)
            ok = predicted is not None and equal(predicted, expected)
            rewards.append(correct if ok else incorrect)
        return rewards

    reward.__name__ = reward.__qualname__ = func_name
    reward.extract_answer = extract  # the answer a majority vote compares (evaluation_metrics)
    return reward
