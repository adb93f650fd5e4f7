"""Tests for artifex.generative_models.training.rl.rewards."""

from __future__ import annotations

import functools
import itertools
import math
import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifex.generative_models.training.rl.rewards import (
    CombinedRewards,
    RewardCombiner,
    RewardFunction,
    RewardFunctionError,
    answers_equal,
    combine_reward_columns,
    combine_rewards,
    extract_answer,
    format_reward,
    math_answer_reward,
    normalize_number,
    overlong_penalty,
    reward_names,
    soft_overlong_penalty,
)

# ------------------------------------------------------------------------------------------
# Answer extraction
# ------------------------------------------------------------------------------------------

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)

EXTRACTION_CASES = [
    # GSM8K references and completions
    (GSM8K_SOLUTION, "72"),
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10", "10"),
    ("#### 1,234", "1,234"),
    ("#### -3", "-3"),
    ("#### $18", "$18"),
    ("#### 72.", "72."),
    ("####72", "72"),
    ("So the total is 5.\n#### 5\n\nI hope that helps.", "5"),
    ("#### 5</answer>", "5"),
    ("#### **72**", "**72**"),
    ("#### 1\nmore work\n#### 2", "2"),
    # LaTeX boxed
    ("The answer is $\\boxed{42}$.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("first \\boxed{3} then, correcting myself, \\boxed{4}", "4"),
    ("\\boxed 5", "5"),
    ("$\\boxed -7$", "-7"),
    ("\\fbox{8}", "8"),
    ("\\boxed { 9 }", "9"),
    ("\\boxed{-0.50}", "-0.50"),
    ("\\boxed{\\left( 1, 2 \\right)}", "\\left( 1, 2 \\right)"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{3} and a truncated \\boxed{4", "3"),
    ("\\boxed{}", None),
    # which marker wins: the one that starts last
    ("\\boxed{1}\n#### 2", "2"),
    ("#### 1\nActually \\boxed{2}", "2"),
    ("<think>maybe \\boxed{1}</think><answer>2</answer>", "2"),
    ("<think>x</think><answer>so \\boxed{3}</answer>", "3"),
    ("<answer> 17 </answer>", "17"),
    ("<answer></answer>", None),
    # Markdown headings are not GSM8K markers
    ("#### Step 1: add\n3 + 4 = 7", None),
    # nothing to extract
    ("I am not sure.", None),
    ("The answer is 72.", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACTION_CASES)
def test_extract_answer_table(text, expected):
    assert extract_answer(text) == expected


LAST_NUMBER_CASES = [
    ("The answer is 72.", "72"),
    ("So she has 1,234 apples left.", "1,234"),
    ("3 cups, then 3/4 of them", "3/4"),
    ("it went from 5 to -12", "-12"),
    ("about 0.25", "0.25"),
    ("see COVID-19", "19"),
    ("pairs 1,2", "2"),
    ("no digits here", None),
    ("\\boxed{5} then 6", "5"),  # a marker beats the fallback
]


@pytest.mark.parametrize(("text", "expected"), LAST_NUMBER_CASES)
def test_extract_answer_last_number_fallback(text, expected):
    assert extract_answer(text, last_number_fallback=True) == expected


def test_extract_answer_fallback_is_off_by_default():
    assert extract_answer("The answer is 72.") is None


def test_extract_answer_rejects_non_strings():
    with pytest.raises(TypeError, match="text must be a str"):
        extract_answer(72)


def test_extract_answer_many_unclosed_boxes_is_fast():
    text = "\\boxed{1}" + "\\boxed{" * 2000 + "x" * 2000
    assert extract_answer(text) == "1"


# ------------------------------------------------------------------------------------------
# Number normalization
# ------------------------------------------------------------------------------------------

NUMBER_CASES = [
    ("72", Fraction(72)),
    ("72.", Fraction(72)),
    ("5.00", Fraction(5)),
    (".5", Fraction(1, 2)),
    ("-0", Fraction(0)),
    ("+5", Fraction(5)),
    ("-5", Fraction(-5)),
    ("\u22125", Fraction(-5)),  # unicode minus
    ("- 5", Fraction(-5)),
    ("1,000", Fraction(1000)),
    ("1,234,567.25", Fraction(123456725, 100)),
    ("1{,}000", Fraction(1000)),
    ("1\\,000", Fraction(1000)),
    ("$1,000.00", Fraction(1000)),
    ("\\$18", Fraction(18)),
    ("18$", Fraction(18)),
    ("25%", Fraction(25)),
    ("12.5\\%", Fraction(25, 2)),
    ("3/4", Fraction(3, 4)),
    ("-3/4", Fraction(-3, 4)),
    ("3/-4", Fraction(-3, 4)),
    ("0.5/2", Fraction(1, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)),
    ("\\dfrac{3}{4}", Fraction(3, 4)),
    ("\\tfrac{3}{4}", Fraction(3, 4)),
    ("\\frac12", Fraction(1, 2)),
    ("\\frac 12", Fraction(1, 2)),
    ("\\frac1{20}", Fraction(1, 20)),
    ("-\\frac{1}{2}", Fraction(-1, 2)),
    ("\\frac{-1}{2}", Fraction(-1, 2)),
    ("\\frac{\\frac{1}{2}}{3}", Fraction(1, 6)),
    ("\\left(\\frac{3}{4}\\right)", Fraction(3, 4)),
    ("(5)", Fraction(5)),
    ("{1}/{2}", Fraction(1, 2)),
    ("(1)/(4)", Fraction(1, 4)),
    ("1e3", Fraction(1000)),
    ("2.5E-2", Fraction(1, 40)),
    ("1.5\\times 10^{3}", Fraction(1500)),
    ("3 \\cdot 10^{-2}", Fraction(3, 100)),
    ("7\\times10^2", Fraction(700)),
    ("90^\\circ", Fraction(90)),
    ("90^{\\circ}", Fraction(90)),
    ("90°", Fraction(90)),
    ("5\\text{ cm}", Fraction(5)),
    ("\\frac{1}{2}\\text{ cup}", Fraction(1, 2)),
    ("\\text{5}", Fraction(5)),
    ("x = 5", Fraction(5)),
    ("\\boxed{6}", Fraction(6)),
    ("  42  ", Fraction(42)),
    ("**72**", Fraction(72)),
    # not numbers
    ("1,2", None),
    ("1,00", None),
    ("12,34,567", None),
    ("1 2", None),
    ("1.2.3", None),
    ("--5", None),
    ("1/0", None),
    ("\\frac{1}{0}", None),
    ("1/2/3", None),
    ("\\sqrt{2}", None),
    ("2\\pi", None),
    ("2\\frac{1}{2}", None),  # mixed numbers are not parsed
    ("18 dollars", None),  # plain unit words are not stripped
    ("3 million", None),
    ("1e100000", None),  # exponent guard
    ("1" * 600, None),  # length guard
    ("(1, 2)", None),
    ("\\text{Monday}", None),
    ("", None),
    ("   ", None),
    ("$", None),
    ("1_000", None),
    ("\u0661\u0662", None),  # only ASCII digits
]


@pytest.mark.parametrize(("text", "expected"), NUMBER_CASES)
def test_normalize_number_table(text, expected):
    assert normalize_number(text) == expected


def test_normalize_number_rejects_non_strings():
    with pytest.raises(TypeError, match="answer must be a str"):
        normalize_number(5)


# ------------------------------------------------------------------------------------------
# Answer comparison
# ------------------------------------------------------------------------------------------

EQUAL_CASES = [
    ("\\frac{1}{2}", "0.5", True),
    ("-0.50", "-1/2", True),
    ("\\boxed{-0.50}", "-\\frac{1}{2}", True),
    ("$1,000.00", "1000", True),
    ("72.", "72", True),
    ("\u22125", "-5", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("-\\frac{3}{4}", "\\frac{-3}{4}", True),
    ("25%", "25", True),
    ("1,234", "1234", True),
    ("1e3", "1,000", True),
    ("18\\text{ dollars}", "18", True),
    ("\\text{Monday}", "Monday", True),
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("\\sqrt{2}", "\\sqrt{2}", True),
    ("\\sqrt{2}", "\\sqrt {2}", True),
    ("1,2", "1,2", True),
    # different
    ("1,2", "12", False),
    ("1 2", "12", False),
    ("0.333", "1/3", False),
    ("0.3333333333333333", "1/3", False),
    ("-5", "5", False),
    ("18 dollars", "18", False),
    ("3 million", "3", False),
    ("\\sqrt{2}", "1.4142135623730951", False),
    ("\\text{Monday}", "Tuesday", False),
    ("2\\frac{1}{2}", "2.5", False),
    ("", "", False),
    ("$", "$", False),
]


@pytest.mark.parametrize(("a", "b", "expected"), EQUAL_CASES)
def test_answers_equal_table(a, b, expected):
    assert answers_equal(a, b) is expected
    assert answers_equal(b, a) is expected


# A small grammar of answer-like strings, so that hypothesis explores the interesting cases.
ANSWER_PIECES = st.sampled_from(
    [
        "1", "2", "0", "5", "72", ".", ",", "000", "-", "+", "\u2212", "/", "$", "\\$", "%",
        "\\%", " ", "{", "}", "(", ")", "\\frac", "\\dfrac", "\\boxed", "\\text{", "\\left(",
        "\\right)", "e", "3", "x", "=", "\\times10^", "\\circ", "^", "a", "\\,", "{,}",
    ]
)  # fmt: skip
ANSWER_STRINGS = st.lists(ANSWER_PIECES, max_size=8).map("".join)


@settings(max_examples=400, deadline=None)
@given(ANSWER_STRINGS, ANSWER_STRINGS)
def test_answers_equal_is_symmetric(a, b):
    assert answers_equal(a, b) == answers_equal(b, a)


@settings(max_examples=300, deadline=None)
@given(ANSWER_STRINGS)
def test_answers_equal_is_reflexive_for_answers_with_content(a):
    # digits survive the clean-up, so such an answer is never empty and equals itself
    if normalize_number(a) is not None or re.search(r"[0-9]", a):
        assert answers_equal(a, a)


@settings(max_examples=300, deadline=None)
@given(ANSWER_STRINGS, ANSWER_STRINGS, ANSWER_STRINGS)
def test_answers_equal_is_transitive_on_numbers(a, b, c):
    if answers_equal(a, b) and answers_equal(b, c) and normalize_number(a) is not None:
        assert answers_equal(a, c)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60))
def test_parsers_never_raise_on_arbitrary_text(text):
    extract_answer(text, last_number_fallback=True)
    value = normalize_number(text)
    assert value is None or isinstance(value, Fraction)
    assert answers_equal(text, text) in (True, False)


def _decimal_string(value: Fraction) -> str | None:
    """Exact decimal expansion of a Fraction whose denominator is 2^a 5^b, else None."""
    den = value.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return None
    digits = max(twos, fives)
    scaled = abs(value) * 10**digits
    int_part, frac_part = divmod(int(scaled), 10**digits)
    sign = "-" if value < 0 else ""
    if digits == 0:
        return f"{sign}{int_part}"
    return f"{sign}{int_part}.{frac_part:0{digits}d}"


def _with_thousands(n: int) -> str:
    return f"{n:,}"


@settings(max_examples=300, deadline=None)
@given(
    st.integers(min_value=-(10**6), max_value=10**6),
    st.sampled_from([1, 2, 3, 4, 5, 8, 10, 16, 20, 25, 40, 3 * 7, 9, 1000, 6]),
)
def test_equivalent_spellings_of_a_fraction_compare_equal(num, den):
    value = Fraction(num, den)
    sign = "-" if value < 0 else ""
    p, q = abs(value.numerator), value.denominator
    spellings = [
        f"{value.numerator}/{q}",
        f"{sign}\\frac{{{p}}}{{{q}}}",
        f"{sign}\\dfrac{{{p}}}{{{q}}}",
        f"\\tfrac{{{value.numerator}}}{{{q}}}",
        f"\\left({sign}\\frac{{{p}}}{{{q}}}\\right)",
        f"{num}/{den}",
        f"\\frac{{{num * 3}}}{{{den * 3}}}",
        f"$ {value.numerator} / {q} $",
        ("\u2212" if value < 0 else "") + f"{p}/{q}",
    ]
    decimal = _decimal_string(value)
    if decimal is not None:
        spellings += [decimal, decimal + "0" if "." in decimal else decimal + ".00", decimal + "."]
    if q == 1:
        spellings += [_with_thousands(value.numerator), f"${_with_thousands(value.numerator)}"]
        spellings += [f"{value.numerator}e0", f"{value.numerator * 10}e-1"]
    for s in spellings:
        assert normalize_number(s) == value, s
    for s, t in itertools.pairwise(spellings):
        assert answers_equal(s, t), (s, t)
    # a nearby value never compares equal: comparison is exact
    assert not answers_equal(spellings[0], f"{value.numerator * 1000 + 1}/{q * 1000}")


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1000, max_value=10**9), st.integers(min_value=1, max_value=2))
def test_misplaced_thousands_separators_are_not_numbers(n, cut):
    s = str(n)
    bad = s[:-cut] + "," + s[-cut:]  # a group of 1 or 2 digits after the comma
    assert normalize_number(bad) is None
    assert not answers_equal(bad, s)


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(alphabet=st.characters(blacklist_characters="\\#<"), max_size=40),
    answer=st.from_regex(r"-?[0-9]{1,6}(\.[0-9]{1,3})?", fullmatch=True),
    wrapper=st.sampled_from(["\\boxed{{{}}}", "#### {}", "<answer>{}</answer>", "$\\boxed{{{}}}$"]),
)
def test_extract_answer_round_trip(prefix, answer, wrapper):
    text = prefix + "\n" + wrapper.format(answer)
    assert extract_answer(text) == answer


# ------------------------------------------------------------------------------------------
# Math answer reward
# ------------------------------------------------------------------------------------------

MATH_REWARD_CASES = [
    ("Let me think. 24 + 48 = 72.\n#### 72", GSM8K_SOLUTION, 1.0),
    ("So the answer is $\\boxed{72}$.", GSM8K_SOLUTION, 1.0),
    ("\\boxed{72.00}", "72", 1.0),
    ("#### 71", GSM8K_SOLUTION, 0.0),
    ("I think it is 72.", GSM8K_SOLUTION, 0.0),  # no marker, fallback off
    ("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", 1.0),
    ("\\boxed{-0.50}", "-1/2", 1.0),
    ("#### $1,000.00", "1000", 1.0),
    ("#### 1,2", "12", 0.0),
    ("\\boxed{\u22123}", "#### -3", 1.0),
    ("<think>hmm</think><answer>0.75</answer>", "\\dfrac{3}{4}", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("\\boxed{1}\\boxed{2}", "2", 1.0),
    ("\\boxed{1}\\boxed{2}", "1", 0.0),
    ("The answer is **18**.\n#### **18**", "18", 1.0),
    ("<answer>**18 dollars**</answer>", "18", 0.0),
]


@pytest.mark.parametrize(("completion", "reference", "expected"), MATH_REWARD_CASES)
def test_math_answer_reward_table(completion, reference, expected):
    reward = math_answer_reward()
    assert reward(["q"], [completion], answer=[reference]) == [expected]


def test_math_answer_reward_reference_types_and_missing_references():
    reward = math_answer_reward("solution", correct_reward=2.0, incorrect_reward=-1.0)
    completions = ["\\boxed{72}"] * 8
    references = [72, 72.0, np.int64(72), Fraction(72), "72", None, "  ", float("nan")]
    got = reward(["q"] * 8, completions, solution=references)
    assert got == [2.0, 2.0, 2.0, 2.0, 2.0, None, None, None]
    assert reward(["q"], ["\\boxed{0.1}"], solution=[0.1]) == [2.0]
    assert reward(["q"], ["\\boxed{3}"], solution=[72]) == [-1.0]
    assert reward.__name__ == "math_answer_reward"


def test_math_answer_reward_last_number_fallback():
    strict = math_answer_reward()
    lenient = math_answer_reward(last_number_fallback=True, name="lenient_math")
    completions = ["I think it is 72.", "It is 71, not 72, so 71.", "\\boxed{5}, not 72"]
    references = ["72", "72", "72"]
    assert strict(["q"] * 3, completions, answer=references) == [0.0, 0.0, 0.0]
    assert lenient(["q"] * 3, completions, answer=references) == [1.0, 0.0, 0.0]
    assert lenient.__name__ == "lenient_math"


def test_math_answer_reward_errors():
    reward = math_answer_reward()
    with pytest.raises(ValueError, match=r"needs the dataset column 'answer'.*'solution'"):
        reward(["q"], ["\\boxed{1}"], solution=["1"])
    with pytest.raises(ValueError, match="has 2 entries, expected 1"):
        reward(["q"], ["\\boxed{1}"], answer=["1", "2"])
    with pytest.raises(TypeError, match="completion 0 must be a str"):
        reward(["q"], [[{"role": "assistant", "content": "1"}]], answer=["1"])
    with pytest.raises(TypeError, match="reference answer"):
        reward(["q"], ["\\boxed{1}"], answer=[{"a": 1}])
    with pytest.raises(ValueError, match="answer_column"):
        math_answer_reward("")
    with pytest.raises(ValueError, match="correct_reward"):
        math_answer_reward(correct_reward=float("inf"))
    with pytest.raises(ValueError, match="name"):
        math_answer_reward(name="")


# ------------------------------------------------------------------------------------------
# Format reward
# ------------------------------------------------------------------------------------------

FORMAT_CASES = [
    ("<think>reasoning</think><answer>42</answer>", 1.0),
    ("<think>\nreasoning\n</think>\n<answer>\n42\n</answer>\n", 1.0),
    ("  <think>a</think>  <answer>b</answer>", 1.0),
    ("<think>a</think><answer>b</answer> trailing text", 0.0),
    ("leading <think>a</think><answer>b</answer>", 0.0),
    ("<answer>b</answer><think>a</think>", 0.0),
    ("<think>a</think>", 0.0),
    ("<think></think><answer>b</answer>", 0.0),
    ("<think>a</think><answer>  </answer>", 0.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
    ("<think>a<think>b</think><answer>c</answer>", 0.0),
    ("<think>a</think>text<answer>b</answer>", 0.0),
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_format_reward_tags_fullmatch(completion, expected):
    reward = format_reward()
    assert reward(["q"], [completion]) == [expected]


def test_format_reward_search_and_values():
    reward = format_reward(match="search", correct_reward=0.5, incorrect_reward=-0.5)
    completions = [
        "leading <think>a</think><answer>b</answer> trailing",
        "<think>a</think> and then <answer>b</answer>",
        "<answer>b</answer>",
    ]
    assert reward(["q"] * 3, completions) == [0.5, -0.5, -0.5]


def test_format_reward_custom_tags_and_patterns():
    answer_only = format_reward(tags=("answer",), name="answer_format")
    two = ["<answer>1</answer>", "<think>x</think><answer>1</answer>"]
    assert answer_only(["q", "q"], two) == [1.0, 0.0]
    assert answer_only.__name__ == "answer_format"

    boxed_full = format_reward(r".*\\boxed\{.+\}\s*")
    boxed_search = format_reward(r"\\boxed\{.+\}", match="search")
    compiled = format_reward(re.compile(r"ANSWER: \d+"), match="search")
    completions = ["work\nmore\n\\boxed{3}", "\\boxed{3} and more", "ANSWER: 12", "nothing"]
    assert boxed_full(["q"] * 4, completions) == [1.0, 0.0, 0.0, 0.0]
    assert boxed_search(["q"] * 4, completions) == [1.0, 1.0, 0.0, 0.0]
    assert compiled(["q"] * 4, completions) == [0.0, 0.0, 1.0, 0.0]
    assert format_reward().__name__ == "format_reward"


def test_format_reward_errors():
    with pytest.raises(ValueError, match="match"):
        format_reward(match="prefix")
    with pytest.raises(ValueError, match="tags"):
        format_reward(tags=())
    with pytest.raises(ValueError, match="tags"):
        format_reward(tags=("a b",))
    with pytest.raises(ValueError, match="pattern"):
        format_reward("(unclosed")
    with pytest.raises(ValueError, match="incorrect_reward"):
        format_reward(incorrect_reward=float("nan"))
    with pytest.raises(TypeError, match="completion 1 must be a str"):
        format_reward()(["q", "q"], ["x", None])


def test_format_reward_is_linear_time_on_long_completions():
    long = "<think>" + "x" * 200_000 + "</think><answer>1</answer>"
    assert format_reward()(["q"], [long]) == [1.0]
    assert format_reward()(["q"], ["<think>" * 20_000]) == [0.0]


# ------------------------------------------------------------------------------------------
# Soft overlong punishment
# ------------------------------------------------------------------------------------------


def _dapo_reference(length: float, l_max: int, l_cache: int) -> float:
    """DAPO Eq. (13), written out case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize(("l_max", "l_cache"), [(20480, 4096), (100, 20), (16, 16), (7, 3)])
def test_overlong_penalty_boundaries(l_max, l_cache):
    start = l_max - l_cache
    lengths = [0, start - 1, start, start + 1, (start + l_max) // 2, l_max - 1, l_max, l_max + 1]
    lengths = [x for x in lengths if x >= 0]
    got = overlong_penalty(lengths, l_max, l_cache)
    want = np.array([_dapo_reference(x, l_max, l_cache) for x in lengths])
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    assert got[lengths.index(start)] == 0.0
    assert got[lengths.index(start + 1)] == pytest.approx(-1.0 / l_cache, abs=1e-15)
    assert got[lengths.index(l_max)] == -1.0
    assert got[lengths.index(l_max + 1)] == -1.0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_overlong_penalty_matches_formula_on_random_lengths(seed):
    rng = np.random.default_rng(seed)
    l_max = int(rng.integers(1, 5000))
    l_cache = int(rng.integers(0, l_max + 1))
    lengths = rng.integers(0, 2 * l_max + 2, size=257)
    got = overlong_penalty(lengths, l_max, l_cache)
    want = np.array([_dapo_reference(float(x), l_max, l_cache) for x in lengths])
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=1e-15)
    assert np.all((got <= 0) & (got >= -1))


def test_overlong_penalty_hard_cutoff_with_zero_cache():
    np.testing.assert_array_equal(overlong_penalty([0, 9, 10, 11], 10, 0), [0, 0, 0, -1])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10_000), st.data())
def test_overlong_penalty_is_monotone_and_continuous_in_the_ramp(l_max, data):
    l_cache = data.draw(st.integers(0, l_max))
    lengths = np.arange(0, l_max + 3)
    penalty = overlong_penalty(lengths, l_max, l_cache)
    assert np.all(np.diff(penalty) <= 0)
    if l_cache > 0:  # steps of 1/L_cache inside the ramp, no jump at its ends
        assert np.all(np.abs(np.diff(penalty[: l_max + 1])) <= 1.0 / l_cache + 1e-12)


def test_soft_overlong_penalty_reads_the_completion_length_column():
    reward = soft_overlong_penalty(10, 4)
    assert reward.__name__ == "soft_overlong_penalty"
    got = reward(["q"] * 6, ["c"] * 6, completion_length=[0, 6, 7, 9, 10, 11])
    assert got == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert all(type(x) is float for x in got)
    other = soft_overlong_penalty(10, 4, length_column="n_tokens")
    assert other(["q"], ["c"], n_tokens=np.array([8])) == [-0.5]


def test_soft_overlong_penalty_length_fn_takes_precedence():
    reward = soft_overlong_penalty(8, 4, length_fn=lambda text: len(text.split()))
    completions = ["a b c d", "a b c d e", "a b c d e f g h i"]
    assert reward(["q"] * 3, completions, completion_length=[0, 0, 0]) == [0.0, -0.25, -1.0]


def test_soft_overlong_penalty_errors():
    reward = soft_overlong_penalty(10, 4)
    with pytest.raises(ValueError, match=r"'completion_length'.*length_fn"):
        reward(["q"], ["c"], answer=["1"])
    with pytest.raises(ValueError, match="lengths must be finite and >= 0"):
        reward(["q"], ["c"], completion_length=[-1])
    with pytest.raises(ValueError, match="expected 1"):
        reward(["q"], ["c"], completion_length=[1, 2])
    with pytest.raises(ValueError, match="max_length"):
        soft_overlong_penalty(0, 0)
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty(10, 11)
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_penalty(10, -1)
    with pytest.raises(TypeError, match="max_length"):
        soft_overlong_penalty(10.0, 4)
    with pytest.raises(TypeError, match="length_fn"):
        soft_overlong_penalty(10, 4, length_fn=3)
    with pytest.raises(ValueError, match="shape"):
        overlong_penalty([[1, 2]], 10, 4)


# ------------------------------------------------------------------------------------------
# Combination
# ------------------------------------------------------------------------------------------


def _reference_combine(values, weights, mode, group_size=None, eps=1e-6):
    """Independent float64 version of the combination, row by row and column by column."""
    values = np.asarray(values, dtype=np.float64)
    batch, num_funcs = values.shape
    group = group_size or batch
    z = values.copy()
    if mode == "normalized":
        for f in range(num_funcs):
            for g0 in range(0, batch, group):
                col = values[g0 : g0 + group, f]
                present = col[~np.isnan(col)]
                if present.size == 0:
                    continue
                if np.all(present == present[0]):
                    z[g0 : g0 + group, f] = np.where(np.isnan(col), np.nan, 0.0)
                else:
                    z[g0 : g0 + group, f] = (col - present.mean()) / (present.std() + eps)
    total = np.full(batch, np.nan)
    for i in range(batch):
        terms = [weights[f] * z[i, f] for f in range(num_funcs) if not np.isnan(z[i, f])]
        if terms:
            total[i] = math.fsum(terms)
    return total


def _random_rewards(rng, batch, num_funcs, missing=0.25):
    values = rng.normal(size=(batch, num_funcs)) * rng.uniform(0.1, 10, size=num_funcs)
    values[:, 0] = rng.integers(0, 2, size=batch)  # a 0/1 correctness reward
    values[rng.uniform(size=values.shape) < missing] = np.nan
    values[rng.integers(batch), :] = np.nan  # one row with no reward at all
    return values


def _column_function(column, name):
    """A reward function returning a fixed column, with None where the column is NaN."""

    def reward(prompts, completions, **columns):
        assert len(prompts) == len(completions) == len(column)
        return [None if np.isnan(x) else float(x) for x in column]

    reward.__name__ = name
    return reward


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["sum", "normalized"])
def test_combine_rewards_matches_float64_reference(seed, mode):
    rng = np.random.default_rng(seed)
    batch, num_funcs = 24, 4
    values = _random_rewards(rng, batch, num_funcs)
    weights = rng.uniform(-2, 2, size=num_funcs)
    funcs = [_column_function(values[:, f], f"r{f}") for f in range(num_funcs)]
    total, per_function = combine_rewards(
        funcs, ["p"] * batch, ["c"] * batch, weights=list(weights), mode=mode
    )
    want = _reference_combine(values, weights, mode)
    assert total.dtype == np.float32 and total.shape == (batch,)
    assert per_function.dtype == np.float32 and per_function.shape == (batch, num_funcs)
    np.testing.assert_array_equal(np.isnan(total), np.isnan(want))
    np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(per_function, values, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_combine_reward_columns_group_normalization_matches_reference(seed):
    rng = np.random.default_rng(seed)
    num_prompts, group, num_funcs = 5, 6, 3
    values = _random_rewards(rng, num_prompts * group, num_funcs, missing=0.3)
    values[0:group, 1] = 3.0  # one constant group
    values[group : 2 * group, 2] = np.nan  # one group where a function never answers
    weights = rng.uniform(0.5, 2, size=num_funcs)
    got = combine_reward_columns(values, weights=weights, mode="normalized", group_size=group)
    want = _reference_combine(values, weights, "normalized", group_size=group)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.dtype == np.float32


def test_combine_rewards_none_handling_in_sum_mode():
    a = lambda prompts, completions, **columns: [1.0, None, None, 0.5]  # noqa: E731
    b = lambda prompts, completions, **columns: [2.0, 3.0, None, float("nan")]  # noqa: E731
    total, per_function = combine_rewards(
        [a, b], ["p"] * 4, ["c"] * 4, weights=[1.0, 10.0], mode="sum"
    )
    np.testing.assert_array_equal(total[:2], [21.0, 30.0])
    assert np.isnan(total[2])  # every function returned None
    assert total[3] == 0.5  # NaN is "no reward", like None
    assert np.isnan(per_function[1, 0]) and per_function[1, 1] == 3.0


def test_combine_rewards_normalized_mode_by_hand():
    correct = lambda prompts, completions, **columns: [1, 0, 1, 0]  # noqa: E731
    length = lambda prompts, completions, **columns: [0.0, -0.5, None, -1.0]  # noqa: E731
    constant = lambda prompts, completions, **columns: [0.2, 0.2, 0.2, None]  # noqa: E731
    total, _ = combine_rewards(
        [correct, length, constant], ["p"] * 4, ["c"] * 4, mode="normalized", eps=1e-3
    )
    z_correct = np.array([0.5, -0.5, 0.5, -0.5]) / (0.5 + 1e-3)  # mean 0.5, std 0.5
    z_length = (np.array([0.0, -0.5, -1.0]) + 0.5) / (np.std([0.0, -0.5, -1.0]) + 1e-3)
    want = z_correct + np.array([z_length[0], z_length[1], 0.0, z_length[2]])
    np.testing.assert_allclose(total, want, rtol=1e-6)


def test_combine_rewards_constant_column_becomes_exact_zeros():
    tenth = lambda prompts, completions, **columns: [0.1] * 7  # noqa: E731
    total, _ = combine_rewards([tenth], ["p"] * 7, ["c"] * 7, mode="normalized")
    np.testing.assert_array_equal(total, np.zeros(7, np.float32))


def test_combine_rewards_default_weights_and_one_function():
    f = lambda prompts, completions, **columns: np.array([1.0, 2.0, 3.0])  # noqa: E731
    result = combine_rewards([f], ["p"] * 3, ["c"] * 3)
    assert isinstance(result, CombinedRewards)
    np.testing.assert_array_equal(result.total, [1.0, 2.0, 3.0])


def test_combine_rewards_passes_aligned_columns_as_lists():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(columns, prompts=prompts, completions=completions)
        columns["answer"].append("mutated")  # must not leak into the next function
        return [float(n) for n in columns["completion_length"]]

    def check(prompts, completions, **columns):
        assert columns["answer"] == ["a0", "a0", "a1", "a1"]
        return [None] * 4

    prompts = ["p0", "p0", "p1", "p1"]
    total, _ = combine_rewards(
        [spy, check],
        prompts,
        ("c0", "c1", "c2", "c3"),
        columns={"answer": ("a0", "a0", "a1", "a1"), "completion_length": np.array([1, 2, 3, 4])},
    )
    assert isinstance(seen["completion_length"], list) and isinstance(seen["completions"], list)
    assert seen["completions"] == ["c0", "c1", "c2", "c3"]
    np.testing.assert_array_equal(total, [1, 2, 3, 4])


def test_combine_rewards_reraises_exceptions_naming_function_and_row():
    def parse_rows(prompts, completions, **columns):
        return [float(c) for c in completions]

    with pytest.raises(RewardFunctionError) as info:
        combine_rewards(
            [lambda p, c, **k: [0.0] * len(c), parse_rows], ["p"] * 4, ["1", "2", "oops", "x"]
        )
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "'parse_rows'" in str(err) and "row 2" in str(err) and "'oops'" in str(err)
    assert "ValueError" in str(err)
    assert err.function_name == "parse_rows" and err.function_index == 1 and err.row == 2
    assert isinstance(err.__cause__, ValueError)


def test_combine_rewards_exception_without_row_tracing():
    calls = []

    def flaky(prompts, completions, **columns):
        calls.append(len(completions))
        raise KeyError("model server down")

    with pytest.raises(RewardFunctionError, match="flaky") as info:
        combine_rewards([flaky], ["p"] * 3, ["c"] * 3, locate_failing_row=False)
    assert info.value.row is None and calls == [3]
    assert isinstance(info.value.__cause__, KeyError)


def test_combine_rewards_batch_level_failure_has_no_row():
    def needs_two(prompts, completions, **columns):
        if len(completions) < 2:  # every row alone is fine
            return [0.0] * len(completions)
        raise ZeroDivisionError("whole batch")

    with pytest.raises(RewardFunctionError, match="not traced to a single row") as info:
        combine_rewards([needs_two], ["p"] * 2, ["c"] * 2)
    assert info.value.row is None
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_combine_rewards_wraps_builtin_reward_errors():
    with pytest.raises(RewardFunctionError, match=r"math_answer_reward.*row 0") as info:
        combine_rewards([math_answer_reward()], ["p"], ["\\boxed{1}"], columns={"sol": ["1"]})
    assert "needs the dataset column 'answer'" in str(info.value)


@pytest.mark.parametrize(
    ("output", "pattern"),
    [
        ([1.0, 2.0], "'bad' returned 2 rewards, expected 3"),
        ([1.0, 2.0, 3.0, 4.0], "'bad' returned 4 rewards, expected 3"),
        ({"a": 1.0}, "'bad' must return a list.*got dict"),
        (1.0, "'bad' must return a list.*got float"),
        ("1.0", "'bad' must return a list.*got str"),
        ((x for x in [1.0, 2.0, 3.0]), "'bad' must return a list.*got generator"),
        (np.ones((3, 1)), r"'bad' must return a 1-D .*shape \(3, 1\)"),
        ([1.0, "2.0", 3.0], r"'bad' returned '2.0' \(str\) at row 1"),
        ([1.0, 2.0, float("inf")], "'bad' returned a non-finite reward inf at row 2"),
        (np.array([1.0, -np.inf, 0.0]), "'bad' returned a non-finite reward -inf at row 1"),
        ([1.0, 10**400, 0.0], "'bad' returned a non-finite reward"),
    ],
)
def test_combine_rewards_validates_outputs(output, pattern):
    def bad(prompts, completions, **columns):
        return output

    with pytest.raises(ValueError, match=pattern):
        combine_rewards([bad], ["p"] * 3, ["c"] * 3)


def test_combine_rewards_accepts_tuples_arrays_and_numpy_scalars():
    f = lambda p, c, **k: (np.float32(0.5), None, True)  # noqa: E731
    g = lambda p, c, **k: np.array([1, 2, 3], dtype=np.int64)  # noqa: E731
    h = lambda p, c, **k: np.array([None, 1.0, None], dtype=object)  # noqa: E731
    total, per_function = combine_rewards([f, g, h], ["p"] * 3, ["c"] * 3)
    np.testing.assert_array_equal(total, [1.5, 3.0, 4.0])
    assert np.isnan(per_function[1, 0]) and np.isnan(per_function[0, 2])


def test_combine_rewards_argument_errors():
    f = lambda p, c, **k: [0.0] * len(c)  # noqa: E731
    with pytest.raises(ValueError, match=r"weights.*2.*got shape \(3,\)"):
        combine_rewards([f, f], ["p"], ["c"], weights=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="weights"):
        combine_rewards([f], ["p"], ["c"], weights=[float("nan")])
    with pytest.raises(ValueError, match="weights"):
        combine_rewards([f], ["p"], ["c"], weights=["heavy"])
    with pytest.raises(ValueError, match="mode"):
        combine_rewards([f], ["p"], ["c"], mode="mean")
    with pytest.raises(ValueError, match="at least one"):
        combine_rewards([], ["p"], ["c"])
    with pytest.raises(TypeError, match=r"funcs\[1\]"):
        combine_rewards([f, "not a function"], ["p"], ["c"])
    with pytest.raises(ValueError, match="1 prompts and 2 completions"):
        combine_rewards([f], ["p"], ["c", "d"])
    with pytest.raises(ValueError, match=r"columns\['answer'\].*\(2\), got 1"):
        combine_rewards([f], ["p", "p"], ["c", "d"], columns={"answer": ["a"]})
    with pytest.raises(ValueError, match=r"columns\['answer'\] must be a list"):
        combine_rewards([f], ["p"], ["c"], columns={"answer": "a"})
    with pytest.raises(ValueError, match="completions must be a list"):
        combine_rewards([f], ["p"], "c")
    with pytest.raises(ValueError, match="must not be named 'prompts'"):
        combine_rewards([f], ["p"], ["c"], columns={"prompts": ["p"]})
    with pytest.raises(ValueError, match="group_size"):
        combine_rewards([f], ["p"] * 4, ["c"] * 4, mode="normalized", group_size=3)
    with pytest.raises(TypeError, match="group_size"):
        combine_rewards([f], ["p"] * 4, ["c"] * 4, mode="normalized", group_size=2.0)
    with pytest.raises(ValueError, match="eps"):
        combine_rewards([f], ["p"], ["c"], eps=0.0)


def test_combine_reward_columns_errors():
    with pytest.raises(ValueError, match="shape"):
        combine_reward_columns(np.zeros(3))
    with pytest.raises(ValueError, match="infinities"):
        combine_reward_columns(np.array([[np.inf]]))
    with pytest.raises(ValueError, match="weights"):
        combine_reward_columns(np.zeros((2, 2)), weights=[1.0])


def test_combine_rewards_empty_batch():
    f = lambda p, c, **k: []  # noqa: E731
    total, per_function = combine_rewards([f, f], [], [], mode="normalized")
    assert total.shape == (0,) and per_function.shape == (0, 2)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 4),
    st.floats(-100, 100),
    st.floats(0.01, 100),
    st.integers(0, 2**32 - 1),
)
def test_normalized_mode_is_invariant_to_shift_and_positive_scale(
    num_prompts, group, shift, scale, seed
):
    rng = np.random.default_rng(seed)
    values = _random_rewards(rng, num_prompts * group, 3)
    kwargs = {"mode": "normalized", "group_size": group, "eps": 1e-12}
    base = combine_reward_columns(values, **kwargs)
    moved = combine_reward_columns(values * scale + shift, **kwargs)
    np.testing.assert_allclose(moved, base, rtol=1e-4, atol=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_sum_mode_equals_nansum_of_weighted_columns(batch, num_funcs, seed):
    rng = np.random.default_rng(seed)
    values = _random_rewards(rng, batch, num_funcs, missing=0.4)
    weights = rng.uniform(-3, 3, size=num_funcs)
    got = combine_reward_columns(values, weights=weights)
    all_missing = np.isnan(values).all(axis=1)
    want = np.where(all_missing, np.nan, np.nansum(values * weights, axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Names, protocol, combiner
# ------------------------------------------------------------------------------------------


class LengthReward:
    def __call__(self, prompts, completions, **columns):
        return [float(len(c)) for c in completions]


def named_reward(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_reward_names():
    funcs = [
        format_reward(),
        format_reward(),
        named_reward,
        functools.partial(named_reward),
        LengthReward(),
        lambda p, c, **k: c,
        format_reward(),
    ]
    assert reward_names(funcs) == [
        "format_reward",
        "format_reward_2",
        "named_reward",
        "named_reward_2",
        "LengthReward",
        "<lambda>",
        "format_reward_3",
    ]
    assert reward_names([]) == []


def test_builtin_rewards_satisfy_the_protocol():
    for func in (
        math_answer_reward(),
        format_reward(),
        soft_overlong_penalty(4, 2),
        LengthReward(),
    ):
        assert isinstance(func, RewardFunction)


def test_reward_combiner_matches_combine_rewards():
    rng = np.random.default_rng(7)
    values = _random_rewards(rng, 12, 3)
    funcs = [_column_function(values[:, f], f"r{f}") for f in range(3)]
    combiner = RewardCombiner(funcs, weights=[1.0, 0.5, -1.0], mode="normalized", group_size=4)
    total, per_function = combiner(["p"] * 12, ["c"] * 12, answer=["a"] * 12)
    want = combine_rewards(
        funcs,
        ["p"] * 12,
        ["c"] * 12,
        weights=[1.0, 0.5, -1.0],
        mode="normalized",
        group_size=4,
        columns={"answer": ["a"] * 12},
    )
    np.testing.assert_array_equal(total, want.total)
    np.testing.assert_array_equal(per_function, want.per_function)
    assert combiner.names == ["r0", "r1", "r2"]
    assert "RewardCombiner(funcs=['r0', 'r1', 'r2']" in repr(combiner)


def test_reward_combiner_validates_at_construction():
    with pytest.raises(ValueError, match="weights"):
        RewardCombiner([named_reward], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="mode"):
        RewardCombiner([named_reward], mode="max")
    with pytest.raises(ValueError, match="group_size"):
        RewardCombiner([named_reward], group_size=0)
    with pytest.raises(ValueError, match="at least one"):
        RewardCombiner([])
    with pytest.raises(TypeError, match="callable"):
        RewardCombiner([None])


def test_end_to_end_gsm8k_style_batch():
    """Two prompts, three generations each, three rewards combined as the rollout would."""
    prompts = ["Natalia ..."] * 3 + ["Weng ..."] * 3
    completions = [
        "<think>48/2 = 24, 48 + 24 = 72</think><answer>\\boxed{72}</answer>",
        "<think>48 + 48 = 96</think><answer>96</answer>",
        "48/2 = 24 and 48 + 24 = 72\n#### 72",
        "<think>12/60 * 50</think><answer>$10.00</answer>",
        "<think>" + "hmm " * 50,
        "<think>0.2 per minute</think><answer>\\boxed{10}</answer>",
    ]
    columns = {
        "answer": [GSM8K_SOLUTION] * 3 + ["Weng earns ...\n#### 10"] * 3,
        "completion_length": [30, 20, 25, 28, 64, 60],
    }
    combiner = RewardCombiner(
        [math_answer_reward(), format_reward(), soft_overlong_penalty(64, 8)],
        weights=[1.0, 0.5, 1.0],
    )
    total, per_function = combiner(prompts, completions, **columns)
    np.testing.assert_array_equal(per_function[:, 0], [1, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(per_function[:, 1], [1, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(per_function[:, 2], [0, 0, 0, 0, -1, -0.5])
    np.testing.assert_array_equal(total, [1.5, 0.5, 1.0, 1.5, -1.0, 1.0])
