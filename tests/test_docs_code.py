"""Every Python code block of the documentation pages (``docs/*.md``) runs as written.

Every other code block of the README and the pages is a fragment (shell commands), parsed and
checked (YAML configs of ``artifex-grpo train``, JSON), or not code (``text``: diagrams, output).

The convention is the README's (see ``tests/test_readme_code.py``): a block that is only a
fragment (it uses names a page does not define, needs several devices, or is a long training run)
says so in its fence title (```` ```python title="Fragment" ````) and is skipped. The blocks of one
page run in order, in one namespace, in a temporary working directory (blocks may write files).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_readme_code import python_blocks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))


def test_pages_found():
    assert "getting-started.md" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_docs_python_blocks_run(page, tmp_path, monkeypatch):
    blocks = python_blocks((DOCS / page).read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip(f"{page} has no Python block to run")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.removesuffix('.md').replace('-', '_')}"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/{page}[block {i}]", "exec"), namespace)


# ------------------------------------------------------------------ every other code block
_FENCE_RE = re.compile(r"^```([A-Za-z]*)([^\n]*)\n(.*?)^```", re.S | re.M)
RUN_OR_PARSED = {"python", "yaml", "json"}  # run or checked by the tests of this module
NOT_CODE = {"text", ""}  # diagrams and printed output


def _fenced_blocks() -> list[tuple[str, str, str, str]]:
    """(file, language, fence info, code) of every fenced block of the README and docs."""
    out = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for lang, info, code in _FENCE_RE.findall(path.read_text(encoding="utf-8")):
            out.append((path.name, lang.lower(), info, code))
    return out


def _checked(language: str) -> list[str]:
    return [
        code
        for _, lang, info, code in _fenced_blocks()
        if lang == language and "fragment" not in info.lower()
    ]


def test_every_code_block_runs_or_is_a_fragment():
    blocks = _fenced_blocks()
    assert any(lang == "bash" for _, lang, _, _ in blocks)
    unchecked = [
        (name, lang, code.splitlines()[0] if code else "")
        for name, lang, info, code in blocks
        if lang not in RUN_OR_PARSED | NOT_CODE and "fragment" not in info.lower()
    ]
    assert not unchecked, f"mark these as fragments or check them in a test: {unchecked}"


def test_yaml_blocks_are_train_configs_the_command_accepts():
    import argparse

    import yaml

    from artifex.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = sub.choices["train"]._option_string_actions
    blocks = _checked("yaml")
    assert blocks
    for code in blocks:
        config = yaml.safe_load(code)
        assert isinstance(config, dict) and config
        unknown = [k for k in config if "--" + k.replace("_", "-") not in options]
        assert not unknown, f"not options of artifex-grpo train: {unknown}"


def test_json_blocks_parse():
    blocks = _checked("json")
    assert blocks
    for code in blocks:
        assert json.loads(code)
