"""The copy button of a ``>>>`` example copies code that runs (docs/javascripts/copy_examples.js).

Material's copy button copies the text of a code block as shown, or the ``data-copy``
attribute of the nearest element that has one. The script gives each Python console block a
``data-copy`` with its code lines only. These tests load the script in headless Chromium on a
page with the markup that mkdocstrings and pymdownx.highlight produce, copy each block the way
Material does, and check that the text of a console example compiles and equals its code.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "javascripts" / "copy_examples.js"
CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
    None,
)


def _line(n: int, inner: str) -> str:
    anchor = f'<a id="__codelineno-0-{n}" name="__codelineno-0-{n}" href="#__codelineno-0-{n}"></a>'
    return anchor + inner


def _gp(prompt: str) -> str:
    return f'<span class="gp">{html.escape(prompt)}</span>'


# A docstring example as mkdocstrings renders it: prompts .gp, outputs .go, a traceback .gt/.gr.
CONSOLE = "\n".join(
    [
        _line(
            1,
            _gp(">>> ") + '<span class="kn">import</span><span class="w"> </span>'
            '<span class="nn">math</span>',
        ),
        _line(
            2,
            _gp(">>> ") + '<span class="k">for</span> <span class="n">x</span> '
            '<span class="ow">in</span> <span class="p">(</span><span class="mi">1</span>'
            '<span class="p">,</span> <span class="mi">4</span><span class="p">):</span>',
        ),
        _line(
            3,
            _gp("... ") + '    <span class="nb">print</span><span class="p">(</span>'
            '<span class="n">math</span><span class="o">.</span><span class="n">sqrt</span>'
            '<span class="p">(</span><span class="n">x</span><span class="p">))</span>',
        ),
        _line(4, '<span class="go">1.0</span>'),
        _line(5, '<span class="go">2.0</span>'),
        _line(
            6,
            _gp(">>> ") + '<span class="n">math</span><span class="o">.</span>'
            '<span class="n">sqrt</span><span class="p">(</span><span class="o">-</span>'
            '<span class="mi">1</span><span class="p">)</span>',
        ),
        _line(7, '<span class="gt">Traceback (most recent call last):</span>'),
        _line(8, '<span class="w">    </span>...'),
        _line(9, '<span class="gr">ValueError</span>: math domain error'),
        "",
    ]
)
CONSOLE_CODE = "import math\nfor x in (1, 4):\n    print(math.sqrt(x))\nmath.sqrt(-1)"
PLAIN = '<span class="n">x</span> <span class="o">=</span> <span class="mi">1</span>\n'
SHELL = '<span class="gp">$ </span>pip install artifex-grpo\n<span class="go">done</span>\n'

# Material's copy (its bundle's ``hs``): the nearest data-copy, else the code's text; run once
# the page has loaded, as a click would be.
MATERIAL_COPY = """
window.addEventListener("load", () => {
for (const [i, code] of document.querySelectorAll("pre > code").entries()) {
  const t = code.closest("[data-copy]");
  const text = t ? t.getAttribute("data-copy") : code.innerText;
  const out = document.createElement("textarea");
  out.id = "copied-" + i;
  out.textContent = text.trimEnd();
  document.body.appendChild(out);
}
});
"""


def _page(tmp_path: Path) -> Path:
    blocks = "".join(
        f'<div class="highlight"><pre id="__code_{i}"><span></span><code>{body}</code></pre></div>'
        for i, body in enumerate((CONSOLE, PLAIN, SHELL))
    )
    page = tmp_path / "page.html"
    page.write_text(
        f"<!doctype html><html><body>{blocks}"
        f'<script src="{SCRIPT.as_uri()}"></script><script>{MATERIAL_COPY}</script>'
        "</body></html>"
    )
    return page


def _copied(page: Path, tmp_path: Path) -> list[str]:
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--allow-file-access-from-files",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--dump-dom",
        page.as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    found = dict(re.findall(r'<textarea id="copied-(\d+)">(.*?)</textarea>', dom, re.S))
    return [html.unescape(found[str(i)]) for i in range(len(found))]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium")
def test_copy_gives_the_code_of_a_console_example_and_leaves_other_blocks(tmp_path):
    console, plain, shell = _copied(_page(tmp_path), tmp_path)
    assert console == CONSOLE_CODE
    compile(console, "<copied>", "exec")  # no prompt, no output: it runs when pasted
    assert plain == "x = 1"
    assert shell == "$ pip install artifex-grpo\ndone"  # not a Python session: as shown


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium")
def test_without_the_script_the_copy_has_prompts(tmp_path):
    # The check above can fail: Material alone copies the prompts and the output.
    page = _page(tmp_path)
    page.write_text(page.read_text().replace(f'<script src="{SCRIPT.as_uri()}"></script>', ""))
    console = _copied(page, tmp_path)[0]
    assert console.startswith(">>> import math")
    with pytest.raises(SyntaxError):
        compile(console, "<copied>", "exec")


def test_material_reads_data_copy():
    material = pytest.importorskip("material")
    bundle = next(
        (Path(material.__file__).parent / "templates/assets/javascripts").glob("bundle.*.min.js")
    )
    assert 'closest("[data-copy]")' in bundle.read_text(), (
        "Material's copy button no longer reads data-copy: docs/javascripts/copy_examples.js "
        "needs another way in"
    )


def test_the_script_is_on_every_page():
    config = (ROOT / "mkdocs.yml").read_text()
    section = config.split("\nextra_javascript:\n", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"^  - javascripts/copy_examples\.js\b", section, re.M)
