"""Tests of tool schemas, tool-call parsing, guarded execution and chat-template rendering."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from artifex.generative_models.models.causal_lm import Tokenizer
from artifex.generative_models.training.rl.rollouts.multiturn.chat_segments import appended_text
from artifex.generative_models.training.rl.tools import (
    ToolCall,
    ToolRunner,
    parse_tool_calls,
    tool_schema,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures")
TOOL_CHAT = os.path.join(FIXTURES, "tool_chat")
sys.path.insert(0, TOOL_CHAT)

from tools_fixture import CONVERSATIONS, TOOLS  # noqa: E402


@pytest.fixture(scope="module")
def expected() -> dict:
    with open(os.path.join(TOOL_CHAT, "expected.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(os.path.join(FIXTURES, "tokenizer_tiny"))


@pytest.fixture(scope="module")
def template() -> str:
    with open(os.path.join(TOOL_CHAT, "qwen2_5_template.jinja"), encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------------------ schemas
def test_schemas_equal_transformers(expected: dict) -> None:
    got = [tool_schema(t) for t in TOOLS]
    assert got == expected["schemas"]
    # key order matters too: templates serialize with tojson (no key sorting)
    assert json.dumps(got) == json.dumps(expected["schemas"])


def test_schema_errors() -> None:
    def no_doc(a: int) -> int:
        return a

    def no_hint(a) -> int:
        """Doc.

        Args:
            a: A.
        """
        return a

    def undocumented(a: int, b: int) -> int:
        """Doc.

        Args:
            a: A.
        """
        return a

    for fn, match in ((no_doc, "docstring"), (no_hint, "type hint"), (undocumented, "'b'")):
        with pytest.raises(TypeError, match=match):
            tool_schema(fn)


@pytest.mark.parametrize("key", ["prompt", "tool_turns", "raw_tool_call"])
@pytest.mark.parametrize("gen", [False, True])
def test_tool_chat_renders_like_transformers(
    key: str, gen: bool, expected: dict, tokenizer: Tokenizer, template: str
) -> None:
    want = expected["renders"][f"{key}/gen={gen}"]
    schemas = [tool_schema(t) for t in TOOLS]
    text = tokenizer.apply_chat_template(
        CONVERSATIONS[key], gen, tokenize=False, chat_template=template, tools=schemas
    )
    assert text == want["text"]
    ids = tokenizer.apply_chat_template(
        CONVERSATIONS[key], gen, chat_template=template, tools=schemas
    )
    assert ids == want["ids"]


def test_callables_as_tools(expected: dict, tokenizer: Tokenizer, template: str) -> None:
    ids = tokenizer.apply_chat_template(
        CONVERSATIONS["prompt"], True, chat_template=template, tools=TOOLS
    )
    assert ids == expected["renders"]["prompt/callables"]["ids"]


@pytest.mark.parametrize("ending", ["", "<|im_end|>"])
def test_appended_text_continues_the_transformers_rendering(
    ending: str, expected: dict, tokenizer: Tokenizer, template: str
) -> None:
    """Prompt + model turn (stopped at </tool_call> or at EOS) + appended text = full render."""
    tok = Tokenizer.from_pretrained(os.path.join(FIXTURES, "tokenizer_tiny"))
    tok.chat_template = template
    conv = CONVERSATIONS["raw_tool_call"]
    schemas = [tool_schema(t) for t in TOOLS]
    prompt = tok.apply_chat_template(conv[:1], True, tokenize=False, tools=schemas)
    generated = conv[1]["content"] + ending
    appended = appended_text(tok, conv[:2], conv[2:], schemas, generated)
    assert prompt + generated + appended == expected["renders"]["raw_tool_call/gen=True"]["text"]


# ------------------------------------------------------------------------------ parsing
def test_parse_qwen_calls() -> None:
    text = (
        'I will call.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "h", "argu'
    )
    calls = parse_tool_calls(text, "qwen")
    assert calls[0] == ToolCall("f", {"x": 1})
    assert calls[1] == ToolCall("g", {"y": 2})
    assert [c.error is not None for c in calls] == [False, False, True, True, True, True]
    assert parse_tool_calls("the answer is 4", "qwen") == []


def test_parse_llama3_calls() -> None:
    assert parse_tool_calls('{"name": "f", "parameters": {"x": 1}}', "llama3") == [
        ToolCall("f", {"x": 1})
    ]
    assert parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {}}', "llama3") == [
        ToolCall("f", {})
    ]
    assert parse_tool_calls("It is 4.", "llama3") == []
    (bad,) = parse_tool_calls('{"name": "f", "parameters": {', "llama3")
    assert bad.error is not None
    with pytest.raises(ValueError, match="tool_format"):
        parse_tool_calls("x", "mistral")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tool_format"):
        parse_tool_calls("x", None)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ execution
def ok(x: int) -> int:
    """Doubles.

    Args:
        x: A number.
    """
    return 2 * x


def boom(x: int) -> str:
    """Raises.

    Args:
        x: A number.
    """
    raise RuntimeError(f"bad {x}")


def hang(x: int) -> str:
    """Sleeps for a long time.

    Args:
        x: A number.
    """
    time.sleep(60)
    return "late"


def obj(x: int) -> dict:
    """Returns a dict.

    Args:
        x: A number.
    """
    return {"x": x}


def test_runner_turns_failures_into_messages() -> None:
    runner = ToolRunner([ok, boom, hang, obj], timeout=0.3)
    assert runner.run(ToolCall("ok", {"x": 4})).content == "8"
    cases = {
        "exception": ToolCall("boom", {"x": 1}),
        "timeout": ToolCall("hang", {"x": 1}),
        "not_text": ToolCall("obj", {"x": 1}),
        "unknown": ToolCall("nope", {}),
        "arguments": ToolCall("ok", {"y": 1}),
        "malformed": ToolCall(None, {}, "not JSON"),
    }
    for kind, call in cases.items():
        t0 = time.monotonic()
        res = runner.run(call)
        assert res.error == kind, (kind, res)
        assert res.content.startswith("Error:")
        assert time.monotonic() - t0 < 5  # a hanging tool never blocks the run
    assert "bad 1" in runner.run(cases["exception"]).content


def test_runner_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ToolRunner([])
    with pytest.raises(ValueError, match="timeout"):
        ToolRunner([ok], timeout=0)
    with pytest.raises(TypeError, match=r"ToolRunner.timeout must be a real number, got '5'"):
        ToolRunner([ok], timeout="5")
    with pytest.raises(ValueError, match="two tools"):
        ToolRunner([ok, ok])
