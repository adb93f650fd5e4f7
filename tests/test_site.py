"""The built site: what a reader sees, checked on the HTML and in a browser.

- It loads nothing from the internet; Returns tables have one row per value; config and batch
  classes show their fields with types and defaults.
- In headless Chromium (``docs/_hooks/browser_check.py``), every page typesets its formulas
  without errors, leaves no TeX raw, misses no file, asks nothing of another host, and shows
  its examples as code.

Builds the site once (``mkdocs build --strict``, never ``-q``, which would drop the warnings)
unless ``ARTIFEX_SITE_DIR`` names a site that is already built (CI passes the one its docs step
built, and ``ARTIFEX_BROWSER_REPORT`` the browser check it ran on it).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The fallback build: strict, and not quiet (MkDocs' -q would hide the warnings from --strict).
BUILD_CMD = ("mkdocs", "build", "--strict")


def _load_checker() -> ModuleType:
    path = ROOT / "docs" / "_hooks" / "browser_check.py"
    spec = importlib.util.spec_from_file_location("_browser_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


browser_check = _load_checker()

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
    cmd = [sys.executable, "-m", *BUILD_CMD, "-d", str(out)]
    run = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ARTIFEX_EXECUTE_NOTEBOOKS": "false"},
    )
    if run.returncode != 0:
        log = run.stdout + run.stderr
        problems = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
        pytest.fail("mkdocs build --strict failed:\n" + "\n".join(problems or [log[-3000:]]))
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


# --------------------------------------------------------------------------- fields of dataclasses
def _section(html: str, ident: str) -> str:
    """The HTML of one object's entry: from its heading to the next heading of its level."""
    start = html.index(f'id="{ident}"')
    level = html.rfind("<h", 0, start)
    tag = html[level : level + 3]
    end = html.find(f"{tag} id=", start)
    return html[start : end if end > 0 else len(html)]


def _table_rows(section: str, title: str) -> dict[str, list[str]]:
    """Rows of the section's first ``title`` table: first cell -> the cells' text."""
    match = re.search(
        rf"{title}</span>.*?<thead>(.*?)</thead>.*?<tbody>(.*?)</tbody>", section, re.S
    )
    if match is None:
        return {}
    rows = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", match.group(2), re.S):
        cells = [
            re.sub(r"<[^>]+>|\s+", " ", c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)
        ]
        if cells:
            rows[cells[0]] = cells
    return rows


def public_dataclasses() -> dict[str, type]:
    """Dotted path (where the API reference renders it) -> each public dataclass with fields."""
    import pkgutil

    import artifex

    names = ["artifex"] + [m.name for m in pkgutil.walk_packages(artifex.__path__, "artifex.")]
    found = {}
    for name in names:
        module = importlib.import_module(name)
        for obj in (getattr(module, n) for n in getattr(module, "__all__", ())):
            is_dataclass = isinstance(obj, type) and dataclasses.is_dataclass(obj)
            if is_dataclass and any(f.init for f in dataclasses.fields(obj)):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


@pytest.mark.slow
def test_grpo_config_shows_fields_with_types_and_defaults(site):
    page = site / "api" / "artifex.generative_models.training.rl.core.configs" / "index.html"
    section = _section(page.read_text(encoding="utf-8"), _GRPO_CONFIG)
    rows = _table_rows(section, "Attributes:")
    assert rows["clip_param"][1:2] == ["float"] and rows["clip_param"][-1] == "0.2", rows
    assert rows["beta"][1:2] == ["float"] and rows["beta"][-1] == "0.01", rows.get("beta")
    signature = re.sub(r"<[^>]+>", "", section.split("doc-contents", 1)[0])
    assert "clip_param: float = 0.2" in signature and "beta: float = 0.01" in signature


_GRPO_CONFIG = "artifex.generative_models.training.rl.core.configs.GRPOConfig"


@pytest.mark.slow
def test_every_dataclass_shows_its_fields_in_its_signature(site):
    """``GRPOConfig()`` with no fields was what griffe showed when the fields were deleted."""
    pages: dict[str, str] = {}
    bad = []
    for path, cls in public_dataclasses().items():
        module = cls.__module__
        if module not in pages:
            page = site / "api" / module / "index.html"
            pages[module] = page.read_text(encoding="utf-8") if page.is_file() else ""
        if f'id="{path}"' not in pages[module]:
            continue  # rendered elsewhere; tests/test_docs.py checks that it is rendered
        head = _section(pages[module], path).split("doc-contents", 1)[0]
        signature = re.sub(r"<[^>]+>", "", head)
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in signature]
        if missing:
            bad.append(f"{path}: {missing}")
    assert not bad, "fields missing from the signature:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- in a browser
def _browser_reports(site: Path) -> tuple[list, list[str]]:
    report = os.environ.get("ARTIFEX_BROWSER_REPORT")
    if report and Path(report).is_file() and os.environ.get("ARTIFEX_SITE_DIR") == str(site):
        data = json.loads(Path(report).read_text(encoding="utf-8"))
        pages = [browser_check.PageReport(**page) for page in data["pages"]]
        return pages, data["other_hosts"]
    if browser_check.find_chromium() is None:
        pytest.skip(
            "no Chromium installed (apt-get install chromium; .ci/run installs it): "
            "the pages were not loaded in a browser"
        )
    reports, (other_hosts, _) = browser_check.check_site(site, jobs=min(4, os.cpu_count() or 1))
    return reports, other_hosts


@pytest.mark.slow
def test_every_page_in_a_browser(site):
    reports, other_hosts = _browser_reports(site)
    print(browser_check.summary(reports, (other_hosts, [])))
    by_page = {r.page: r for r in reports}
    assert len(reports) == len(browser_check.pages(site))
    assert not [r.page for r in reports if not r.loaded], "pages that did not load"
    assert not other_hosts, f"the site asked other hosts for files: {other_hosts}"
    bad = {r.page: r.detail for r in reports if r.errors or r.raw or r.missing}
    assert not bad, f"math errors, raw TeX or missing files: {bad}"
    prose = {r.page: r.detail for r in reports if r.ex_prose}
    assert not prose, f"examples shown as prose, not code: {prose}"
    # The pages with formulas typeset them all (a broken MathJax typesets none).
    for page, at_least in (("algorithm/index.html", 50), ("flow-grpo/index.html", 10)):
        assert by_page[page].math >= at_least, by_page[page]
        assert by_page[page].rendered == by_page[page].math, by_page[page]
    assert sum(r.ex_code for r in reports) > 100


def _dom(body: str) -> str:
    return f"<html><head><script>var a = '\\\\(';</script></head><body>{body}</body></html>"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # MathJax 2 output inside arithmatex spans: typeset, no error.
        (
            '<span class="arithmatex"><span class="MathJax_Preview"></span>'
            '<span class="MathJax"><span class="math">x</span></span>'
            '<script type="math/tex">x</script></span>'
            '<div class="arithmatex"><div class="MathJax_Display"><span class="MathJax">y</span>'
            "</div></div>",
            {"math": 2, "rendered": 2, "errors": 0, "raw": 0},
        ),
        # MathJax could not load its output: an error, and the formula counts as not typeset.
        (
            '<span class="arithmatex"><span class="MathJax_Preview"></span>'
            '<span class="MathJax_Error">[Math Processing Error]</span></span>',
            {"math": 1, "rendered": 0, "errors": 1, "raw": 1},
        ),
        # The error as text only (no error element): counted once.
        ("<p>[Math Processing Error]</p>", {"errors": 1}),
        # MathJax never ran: the TeX is left in the text.
        ('<p>with <span class="arithmatex">\\(x_0\\)</span></p>', {"math": 1, "raw": 2}),
        # A TeX error box, and delimiters in prose outside any arithmatex element.
        ('<span class="merror">bad</span><p>\\[ a \\] and $$b$$</p>', {"errors": 1, "raw": 3}),
        # Code keeps its delimiters and prompts: nothing raw, examples counted as code.
        (
            '<pre><code><span class="gp">&gt;&gt;&gt; </span>f("\\(")\n'
            "&gt;&gt;&gt; g()</code></pre><p><code>\\[x\\]</code></p>",
            {"raw": 0, "ex_code": 2, "ex_prose": 0},
        ),
        # ">>> x" in Markdown prose: nested blockquotes, or the prompt as text.
        (
            "<blockquote><blockquote><blockquote><p>f(1)</p></blockquote></blockquote>"
            "</blockquote><p>&gt;&gt;&gt; g(2)</p>",
            {"ex_code": 0, "ex_prose": 2},
        ),
    ],
)
def test_dom_reader_counts(body, expected):
    report = browser_check.read_dom(_dom(body), browser_check.PageReport("x.html"))
    got = {key: getattr(report, key) for key in expected}
    assert got == expected, report
    assert report.failed == bool(report.errors or report.raw)
