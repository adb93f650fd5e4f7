"""The built site loads nothing from the internet, and Returns tables have one row per value.

Builds the site once (``mkdocs build --strict``) unless ``ARTIFEX_SITE_DIR`` names a site that
is already built (CI may pass the one its docs step built).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_TAG_RE = re.compile(r"<(script|link)\b[^>]*?\b(?:src|href)=[\"']?([^\"' >]+)", re.I)
_HEADING_RE = re.compile(r'<h\d id="(artifex[\w.]*)" class="doc doc-heading"')
_RETURNS_RE = re.compile(r"Returns:</span>.*?<tbody>(.*?)</tbody>", re.S)


def external_urls(html: str) -> list[str]:
    """URLs of ``<script>``/``<link>`` tags that point off the site."""
    return [u for _, u in _TAG_RE.findall(html) if re.match(r"(?:https?:)?//", u)]


def returns_rows(html: str) -> dict[str, int]:
    """Dotted path -> number of rows of the object's Returns table."""
    out = {}
    heads = list(_HEADING_RE.finditer(html))
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(html)
        match = _RETURNS_RE.search(html, head.end(), end)
        if match is not None:
            out[head.group(1)] = match.group(1).count("<tr")
    return out


def returned_values(path: str) -> int:
    """How many values the object returns: the length of a fixed ``tuple[...]``, else 1."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        break
    ann = getattr(obj, "__annotations__", {}).get("return", "")
    ann = ann if isinstance(ann, str) else getattr(ann, "__name__", "")
    if not ann.startswith("tuple[") or "..." in ann:
        return 1
    depth, count = 0, 1
    for ch in ann[len("tuple[") : -1]:
        depth += ch in "[("
        depth -= ch in "])"
        count += ch == "," and depth == 0
    return count


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    prebuilt = os.environ.get("ARTIFEX_SITE_DIR")
    if prebuilt and (Path(prebuilt) / "index.html").is_file():
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)]
    subprocess.run(
        cmd,
        cwd=ROOT,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ARTIFEX_EXECUTE_NOTEBOOKS": "false"},
    )
    return out


@pytest.mark.slow
def test_site_loads_nothing_from_the_internet(site):
    bad = {
        str(p.relative_to(site)): urls
        for p in site.rglob("*.html")
        if (urls := external_urls(p.read_text(encoding="utf-8")))
    }
    assert not bad, f"external <script>/<link> URLs: {bad}"
    assert (site / "assets" / "mathjax" / "MathJax.js").is_file()


@pytest.mark.slow
def test_returns_tables_have_no_more_rows_than_values(site):
    bad = []
    for page in (site / "api").rglob("*.html"):
        for path, rows in returns_rows(page.read_text(encoding="utf-8")).items():
            if rows > returned_values(path):
                bad.append(f"{path}: {rows} rows")
    assert not bad, "Returns tables split into rows:\n" + "\n".join(bad)


def test_checks_catch_offenders():
    html = (
        '<script src="https://cdn.example/x.js"></script><link href="//f.example/a.css">'
        '<script src="../assets/a.js"></script>'
    )
    assert external_urls(html) == ["https://cdn.example/x.js", "//f.example/a.css"]
    page = (
        '<h2 id="artifex.a" class="doc doc-heading">a</h2><span>Returns:</span><table><tbody>'
        "<tr><td>x</td></tr><tr><td>y</td></tr></tbody></table>"
        '<h2 id="artifex.b" class="doc doc-heading">b</h2>'
    )
    assert returns_rows(page) == {"artifex.a": 2}
