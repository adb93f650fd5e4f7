"""Every Python code block of the documentation pages (``docs/*.md``) runs as written.

The convention is the README's (see ``tests/test_readme_code.py``): a block that is only a
fragment (it uses names a page does not define, needs several devices, or is a long training run)
says so in its fence title (```` ```python title="Fragment" ````) and is skipped. The blocks of one
page run in order, in one namespace, in a temporary working directory (blocks may write files).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_readme_code import python_blocks

DOCS = Path(__file__).resolve().parents[1] / "docs"
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
