"""Tests for artifex.generative_models.training.rl.rewards.math."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import re
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifex.generative_models.training.rl.rewards import (
    answers_equal,
    extract_answer,
    math_answer_reward,
    normalize_number,
)
from artifex.generative_models.training.rl.rewards import math as math_rewards

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


HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
needs_math_verify = pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify not installed")
BACKENDS = ["builtin", pytest.param("math_verify", marks=needs_math_verify)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("completion", "reference", "expected"), MATH_REWARD_CASES)
def test_math_answer_reward_table(completion, reference, expected, backend):
    """Both backends agree on the built-in cases (numbers, GSM8K, text answers)."""
    reward = math_answer_reward(backend=backend)
    assert reward(["q"], [completion], answer=[reference]) == [expected]


# Equivalent answers that only a symbolic comparison recognizes, and answers it keeps apart.
SYMBOLIC_CASES = [
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ("\\boxed{x + 1}", "1 + x", 1.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
    ("\\boxed{(0, 1)}", "(0,1]", 0.0),
    ("\\boxed{0.333}", "1/3", 0.0),  # two plain numbers: exact comparison decides
]


@needs_math_verify
@pytest.mark.parametrize(("completion", "reference", "expected"), SYMBOLIC_CASES)
def test_math_verify_backend_compares_symbolically(completion, reference, expected):
    symbolic = math_answer_reward(backend="math_verify")
    builtin = math_answer_reward(backend="builtin")
    assert symbolic(["q"], [completion], answer=[reference]) == [expected]
    assert builtin(["q"], [completion], answer=[reference]) == [0.0]


@needs_math_verify
def test_auto_backend_uses_math_verify_when_installed():
    auto = math_answer_reward()
    assert auto(["q"], ["\\boxed{2^{10}}"], answer=["1024"]) == [1.0]


def test_auto_backend_falls_back_to_the_builtin_parser(monkeypatch):
    monkeypatch.setattr(math_rewards, "_math_verify", lambda: None)
    auto = math_answer_reward()
    assert auto(["q"], ["\\boxed{2^{10}}"], answer=["1024"]) == [0.0]
    assert auto(["q"], ["\\boxed{0.5}"], answer=["\\frac12"]) == [1.0]
    with pytest.raises(ImportError, match="math-verify"):
        math_answer_reward(backend="math_verify")


@needs_math_verify
def test_math_verify_backend_outside_the_main_thread():
    """math-verify's timeouts use signals (main thread only); other threads run without them."""
    reward = math_answer_reward(backend="math_verify")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        completions = ["\\boxed{2^{10}}", "\\boxed{3}"]
        got = pool.submit(reward, ["q", "q"], completions, answer=["1024"] * 2)
        assert got.result() == [1.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_number_extraction(backend):
    reward = math_answer_reward(extraction="last_number", backend=backend)
    completions = [
        "Natalia sold 24 in May, so 48 + 24 = 72 clips.",
        "72 is wrong; the answer is 71",
        "It is -3.",
        "That costs $1,000.",
        "\\boxed{72} and then I added 1",  # markers do not matter: the last number is 1
        "no number at all",
    ]
    references = [GSM8K_SOLUTION, GSM8K_SOLUTION, "#### -3", "1000", "72", "72"]
    assert reward(["q"] * 6, completions, answer=references) == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    # The references are still read with the markers (a GSM8K solution's answer is after ####).
    assert reward(["q"], ["12"], answer=["3 + 4 = 7, 7 + 5 = 12\n#### 12"]) == [1.0]


def test_extraction_and_backend_are_validated():
    with pytest.raises(ValueError, match=r"extraction must be one of \('markers', 'last_number'\)"):
        math_answer_reward(extraction="first_number")
    with pytest.raises(TypeError, match="extraction must be one of"):
        math_answer_reward(extraction=None)
    with pytest.raises(ValueError, match="backend must be one of"):
        math_answer_reward(backend="sympy")
    with pytest.raises(TypeError, match="backend must be one of"):
        math_answer_reward(backend=True)


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
    with pytest.raises(TypeError, match=r"answer_column must be a str, got 3 \(int\)"):
        math_answer_reward(3)
    with pytest.raises(TypeError, match="correct_reward must be a real number"):
        math_answer_reward(correct_reward="1")
    with pytest.raises(TypeError, match="last_number_fallback must be a bool"):
        math_answer_reward(last_number_fallback=1)
