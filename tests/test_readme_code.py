"""Every Python code block of the README runs as written.

A block that is only a fragment says so in its fence title (```` ```python title="Fragment" ````)
and is skipped. The blocks of one file run in order, in one namespace.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK_RE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def python_blocks(markdown: str) -> list[str]:
    """The Python blocks of ``markdown`` not marked as fragments."""
    return [code for info, code in _BLOCK_RE.findall(markdown) if "fragment" not in info.lower()]


def test_block_parser_skips_fragments():
    text = '```python\na = 1\n```\n\n```python title="Fragment"\nb\n```\n```bash\nls\n```\n'
    assert python_blocks(text) == ["a = 1\n"]


def test_readme_python_blocks_run():
    blocks = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert blocks
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md[block {i}]", "exec"), namespace)
