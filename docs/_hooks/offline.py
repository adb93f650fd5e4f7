"""MkDocs hook: a site that loads nothing from the internet.

- MathJax is served by the site itself: the files of the ``jupyter-server-mathjax`` package (a
  PyPI package that ships a trimmed MathJax 2.7) are added to the build under
  ``assets/mathjax/``, and ``docs/javascripts/mathjax.js`` configures it: the combined
  configuration ``TeX-AMS-MML_HTMLorMML-full`` (TeX input, HTML-CSS output) with the STIX-Web
  web fonts, which are served from ``assets/mathjax/fonts/`` too. The package has no SVG or
  CommonHTML output and no TeX fonts; the build fails if a file that configuration needs is
  missing (:data:`REQUIRED`), and ``docs/_hooks/browser_check.py`` typesets every page.
- Search previews show prose, not raw source: the "Source code" blocks of the API reference and
  the LaTeX of formulas get ``data-search-exclude``, which the Material search plugin skips.

Web fonts are off in ``mkdocs.yml`` (``theme.font: false``). ``tests/test_site.py`` builds the
site and fails on any external URL in a ``<script>`` or ``<link>`` tag.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MATHJAX_DIR = "assets/mathjax"

# The files docs/javascripts/mathjax.js makes MathJax load (relative to the package's static/).
REQUIRED = (
    "MathJax.js",
    "config/TeX-AMS-MML_HTMLorMML-full.js",
    "jax/output/HTML-CSS/fonts/STIX-Web/fontdata.js",
    "jax/output/HTML-CSS/fonts/STIX-Web/Main/Regular/Main.js",
    "fonts/HTML-CSS/STIX-Web/woff/STIXMathJax_Main-Regular.woff",
    "fonts/HTML-CSS/STIX-Web/woff/STIXMathJax_Main-Italic.woff",
    "fonts/HTML-CSS/STIX-Web/woff/STIXMathJax_Size1-Regular.woff",
)

# Opening tags of the blocks the search index skips: mkdocstrings' source code (a <details>
# whose class names "source" or "quote") and arithmatex's math (class "arithmatex").
_EXCLUDE_RE = re.compile(
    r'<(details|div|span)(\s[^>]*?)?\sclass="(?P<cls>[^"]*\b(?:quote|mkdocstrings-source|arithmatex)\b[^"]*)"'
)


def mathjax_root() -> Path:
    """Directory of the MathJax files shipped by ``jupyter-server-mathjax``.

    Returns:
        The package's ``static`` directory (it holds ``MathJax.js``).
    """
    import jupyter_server_mathjax

    return Path(jupyter_server_mathjax.__file__).parent / "static"


def on_files(files: Any, config: Any) -> Any:
    """Adds the MathJax files to the build under ``assets/mathjax/``.

    Args:
        files: The documentation files.
        config: The MkDocs config.

    Returns:
        The files, with MathJax's.
    """
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    root = mathjax_root()
    missing = [rel for rel in REQUIRED if not (root / rel).is_file()]
    if missing:
        raise PluginError(
            f"jupyter-server-mathjax at {root} lacks the MathJax files the site needs: {missing}"
        )
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix != ".py":
            rel = path.relative_to(root).as_posix()
            files.append(File.generated(config, f"{MATHJAX_DIR}/{rel}", abs_src_path=str(path)))
    return files


def exclude_from_search(html: str) -> str:
    """Marks source-code and math blocks with ``data-search-exclude``.

    Args:
        html: A page's rendered content.

    Returns:
        The content, with the attribute on every such opening tag.
    """
    return _EXCLUDE_RE.sub(lambda m: m.group(0) + " data-search-exclude", html)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Keeps raw source and LaTeX out of the search index.

    Args:
        html: The page's rendered content.
        page: The page.
        config: The MkDocs config.
        files: The documentation files.

    Returns:
        The content with the excluded blocks marked.
    """
    return exclude_from_search(html)
