r"""Loads every page of the built site in headless Chromium and checks what a reader sees.

Usage::

    python docs/_hooks/browser_check.py SITE_DIR [--jobs N] [--json FILE]

The site is served on ``127.0.0.1`` (a port the system picks); Chromium may reach nothing else:
every host name resolves to nothing and every other address goes through a proxy that this
script runs and that answers nothing but records what was asked. Each page is loaded with
``--dump-dom`` after its scripts have run (MathJax included), and the DOM is read here:

- ``math``: the formulas (arithmatex elements) on the page; ``rendered``: those MathJax typeset;
- ``errors``: MathJax errors ("Math Processing Error", ``merror`` elements, noErrors' raw TeX);
- ``raw``: formulas left as TeX: an arithmatex element that MathJax did not typeset, or a
  ``\(``, ``\[`` or ``$$`` in the page's text outside code;
- ``ex_code``: ``>>>`` prompts shown in code blocks (an ``Examples:`` section);
  ``ex_prose``: example code shown as prose (``>>>`` outside code, or the nested blockquotes
  that Markdown makes of ``>>>`` lines);
- ``missing``: requests of the page that the site answered with an error (a missing file).

It prints one line per page and the totals, and exits with 1 when a page did not load, when
a formula has an error or is left raw, when a file is missing, or when the browser tried to
reach another host; ``--max-prose-examples`` also bounds the examples shown as prose.
``tests/test_docs_build.py`` runs it when Chromium is installed; ``.ci/run`` after the build.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import html.parser
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Elements whose text is not prose (code keeps its ``\(`` and ``>>>``; scripts hold the TeX).
_NOT_PROSE = {"script", "style", "pre", "code", "textarea", "noscript", "template"}
# Classes and tags that MathJax (2 or 3) puts around typeset math.
_RENDERED = {"MathJax", "MathJax_Display", "MathJax_SVG", "MathJax_CHTML", "MathJax_SVG_Display"}
_ERROR_CLASSES = {"merror", "noError", "MathJax_Error"}
_RAW_RE = re.compile(r"\\\(|\\\[|\$\$")
_PROMPT_RE = re.compile(r"^\s*>>>", re.M)
# Chromium services that would phone home on their own (the proxy refuses them anyway).
_QUIET_FEATURES = (
    "OptimizationGuideModelDownloading",
    "OptimizationHintsFetching",
    "OptimizationHints",
    "AutofillServerCommunication",
    "MediaRouter",
    "Translate",
    "NetworkTimeServiceQuerying",
    "CertificateTransparencyComponentUpdater",
)
# Hosts that Chromium itself asks for whatever the page (sign-in, updates, time, autofill);
# a request of the site for anything else fails the check. Pages never reach any host: names
# do not resolve and the proxy answers 403.
BROWSER_HOSTS = frozenset({
    "accounts.google.com",
    "clients2.google.com",
    "content-autofill.googleapis.com",
    "optimizationguide-pa.googleapis.com",
    "safebrowsing.googleapis.com",
    "update.googleapis.com",
    "redirector.gvt1.com",
})  # fmt: skip
_VOID = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
    "track", "wbr",
}  # fmt: skip


@dataclasses.dataclass
class PageReport:
    """What one page showed.

    Attributes:
        page: The page's path in the site (``algorithm/index.html``).
        loaded: Whether Chromium returned the page's DOM.
        math: Formulas (arithmatex elements) on the page.
        rendered: Formulas that MathJax typeset.
        errors: MathJax errors.
        raw: Formulas or math delimiters left as text.
        ex_code: ``>>>`` prompts in code blocks.
        ex_prose: Example code shown as prose.
        missing: Requests of the page that the site answered with an error.
        seconds: Wall time of the page's Chromium run.
        detail: Some of the offending text, for the report.
    """

    page: str
    loaded: bool = False
    math: int = 0
    rendered: int = 0
    errors: int = 0
    raw: int = 0
    ex_code: int = 0
    ex_prose: int = 0
    missing: int = 0
    seconds: float = 0.0
    detail: list[str] = dataclasses.field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Whether the page did not load or shows a math error, raw math or a missing file."""
        return not self.loaded or bool(self.errors or self.raw or self.missing)


class DomReader(html.parser.HTMLParser):
    """Counts formulas, math errors, raw TeX and examples in a DOM dumped by Chromium."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, set[str]]] = []
        self.not_prose = 0  # depth inside script/style/pre/code...
        self.blockquotes = 0
        self.math_open: list[int] = []  # stack depths of open arithmatex elements
        self.math_rendered: list[bool] = []
        self.math = self.rendered = self.errors = self.raw = 0
        self.ex_code = self.ex_prose = 0
        self.detail: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Tracks where the parser is: code, blockquotes, math elements, error elements."""
        classes = set((dict(attrs).get("class") or "").split())
        if classes & _ERROR_CLASSES or tag == "mjx-merror":
            self.errors += 1
        if self.math_open and (classes & _RENDERED or tag == "mjx-container"):
            self.math_rendered[-1] = True
        if tag in _VOID:
            return
        self.stack.append((tag, classes))
        if tag in _NOT_PROSE:
            self.not_prose += 1
        if tag == "blockquote":
            self.blockquotes += 1
            if self.blockquotes == 3 and not self.not_prose:  # ">>> x" in Markdown
                self.ex_prose += 1
        if "arithmatex" in classes:
            self.math += 1
            self.math_open.append(len(self.stack))
            self.math_rendered.append(False)

    def handle_endtag(self, tag: str) -> None:
        """Closes the innermost open element of that name."""
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                break
        else:
            return
        while len(self.stack) > i:
            name, _ = self.stack.pop()
            if name in _NOT_PROSE:
                self.not_prose -= 1
            if name == "blockquote":
                self.blockquotes -= 1
            if self.math_open and self.math_open[-1] == len(self.stack) + 1:
                self.math_open.pop()
                if self.math_rendered.pop():
                    self.rendered += 1
                else:
                    self._note("formula not typeset")

    def handle_data(self, data: str) -> None:
        """Counts errors, raw delimiters and examples in text."""
        if not any(
            classes & _ERROR_CLASSES or name == "mjx-merror" for name, classes in self.stack
        ):
            self.errors += data.count("Math Processing Error")  # unless its element counted
        if self.not_prose:
            if any(name in ("pre", "code") for name, _ in self.stack):
                self.ex_code += len(_PROMPT_RE.findall(data))
            return
        raw = len(_RAW_RE.findall(data))
        if raw:
            self.raw += raw
            self._note(f"raw math: {data.strip()[:80]!r}")
        prompts = data.count(">>>")
        if prompts:
            self.ex_prose += prompts
            self._note(f"example as prose: {data.strip()[:80]!r}")

    def _note(self, text: str) -> None:
        if len(self.detail) < 5:
            self.detail.append(text)


def read_dom(dom: str, report: PageReport) -> PageReport:
    """Fills ``report`` from a page's DOM.

    Args:
        dom: The page's DOM, as ``chromium --dump-dom`` prints it.
        report: The report to fill.

    Returns:
        The report.
    """
    reader = DomReader()
    reader.feed(dom)
    reader.close()
    # An arithmatex element still open at the end (malformed DOM) counts as not typeset.
    report.math = reader.math
    report.rendered = reader.rendered
    report.errors = reader.errors
    report.raw = reader.raw + (reader.math - reader.rendered)
    report.ex_code = reader.ex_code
    report.ex_prose = reader.ex_prose
    report.detail = reader.detail
    report.loaded = True
    return report


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, site: Path) -> None:
        handler = functools.partial(_Handler, directory=str(site))
        super().__init__(("127.0.0.1", 0), handler)
        self.lock = threading.Lock()
        self.failures: list[tuple[str, str, int]] = []  # (referer path, path, status)


class _Handler(http.server.SimpleHTTPRequestHandler):
    server: _Server

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        status = int(code) if str(code).isdigit() else 0
        if status >= 400:
            referer = urllib.parse.urlsplit(self.headers.get("Referer") or "").path
            with self.server.lock:
                self.server.failures.append((referer, self.path, status))

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Proxy(threading.Thread):
    """A proxy that refuses every request and records its target (the other hosts asked for)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.asked: list[str] = []  # request lines ("CONNECT host:443 HTTP/1.1")

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    line = conn.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    continue
                if line:
                    self.asked.append(line)

    def close(self) -> None:
        self.sock.close()

    def hosts(self) -> tuple[list[str], list[str]]:
        """The other hosts asked for: the site's, and Chromium's own (:data:`BROWSER_HOSTS`)."""
        hosts = set()
        for line in self.asked:
            target = line.split(" ")[1] if " " in line else line
            if "://" not in target:
                target = "//" + target
            hosts.add(urllib.parse.urlsplit(target).hostname or target)
        return sorted(hosts - BROWSER_HOSTS), sorted(hosts & BROWSER_HOSTS)


def find_chromium() -> str | None:
    """Path of a Chromium (or Chrome) executable, from ``$CHROMIUM`` or the ``PATH``."""
    names = [os.environ["CHROMIUM"]] if os.environ.get("CHROMIUM") else list(CHROMIUM_NAMES)
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def pages(site: Path) -> list[str]:
    """The HTML pages of a built site (MathJax's own files excluded), sorted."""
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("*.html")
        if not p.relative_to(site).as_posix().startswith("assets/")
    )


def _url_path(page: str) -> str:
    return "/" + (page[: -len("index.html")] if page.endswith("index.html") else page)


def load_page(
    chromium: str, base: str, page: str, proxy_port: int, budget_ms: int, timeout_s: float
) -> tuple[PageReport, str]:
    """Loads one page in a fresh headless Chromium and reads its DOM.

    Args:
        chromium: The Chromium executable.
        base: The site's URL (``http://127.0.0.1:PORT``).
        page: The page's path in the site.
        proxy_port: Port of the refusing proxy.
        budget_ms: Chromium's virtual time budget (scripts run until it is spent or idle).
        timeout_s: Wall-clock limit of one Chromium run.

    Returns:
        The page's report and Chromium's stderr (for a page that did not load).
    """
    report = PageReport(page)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="artifex-chromium-") as profile:
        cmd = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-default-apps",
            "--disable-extensions",
            "--disable-sync",
            "--no-first-run",
            "--no-default-browser-check",
            "--mute-audio",
            "--no-pings",
            "--disable-breakpad",
            "--disable-domain-reliability",
            "--disable-client-side-phishing-detection",
            "--disable-features=" + ",".join(_QUIET_FEATURES),
            f"--user-data-dir={profile}",
            # Other hosts are unreachable: no name resolves, any other address meets the proxy.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            f"--proxy-server=http://127.0.0.1:{proxy_port}",
            "--proxy-bypass-list=127.0.0.1",
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
            base + _url_path(page),
        ]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            dom, err = run.stdout, run.stderr
        except subprocess.TimeoutExpired as exc:
            dom, err = "", f"timed out after {timeout_s:.0f} s: {exc}"
    report.seconds = time.perf_counter() - start
    if "</html>" not in dom:
        report.detail.append("Chromium returned no page")
        return report, err
    return read_dom(dom, report), err


def check_site(
    site: Path,
    *,
    jobs: int = 4,
    budget_ms: int = 15000,
    timeout_s: float = 120.0,
    chromium: str | None = None,
) -> tuple[list[PageReport], tuple[list[str], list[str]]]:
    """Loads every page of ``site`` in Chromium.

    Args:
        site: A built site (``mkdocs build -d SITE``).
        jobs: Chromium processes run at once.
        budget_ms: Virtual time budget of each page.
        timeout_s: Wall-clock limit of one page.
        chromium: The Chromium executable (default: :func:`find_chromium`).

    Returns:
        One report per page, and the other hosts the browser asked for: those asked for by
        the site (which fail the check), and Chromium's own services.

    Raises:
        FileNotFoundError: When no Chromium is installed or ``site`` has no ``index.html``.
    """
    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError(f"no Chromium found (tried {', '.join(CHROMIUM_NAMES)})")
    if not (site / "index.html").is_file():
        raise FileNotFoundError(f"{site} is not a built site (no index.html)")
    server, proxy = _Server(site), _Proxy()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        todo = pages(site)
        load = functools.partial(
            load_page,
            chromium,
            base,
            proxy_port=proxy.port,
            budget_ms=budget_ms,
            timeout_s=timeout_s,
        )
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(load, todo))
        reports = []
        for (report, err), page in zip(results, todo, strict=True):
            if not report.loaded:  # one retry: a busy machine can starve a run
                report, err = load(page)
                if not report.loaded:
                    report.detail.append(err.strip()[-300:])
            reports.append(report)
    finally:
        server.shutdown()
        server.server_close()
        proxy.close()
    by_path = {_url_path(r.page): r for r in reports}
    for referer, path, status in server.failures:
        report = by_path.get(referer)
        if report is None and referer == "":
            report = by_path.get(urllib.parse.urlsplit(path).path)
        if report is not None:
            report.missing += 1
            report.detail.append(f"HTTP {status}: {path}")
    return reports, proxy.hosts()


def summary(reports: list[PageReport], hosts: tuple[list[str], list[str]]) -> str:
    """The per-page lines and the totals.

    Args:
        reports: One report per page.
        hosts: The other hosts asked for, the site's and Chromium's own.

    Returns:
        The text to print.
    """
    cols = ("math", "rendered", "errors", "raw", "ex_code", "ex_prose", "missing", "seconds")
    width = max(len(r.page) for r in reports)
    lines = [f"{'page':<{width}} " + " ".join(f"{c:>8}" for c in cols)]
    for r in reports:
        values = [getattr(r, c) for c in cols]
        cells = [f"{v:8.1f}" if isinstance(v, float) else f"{v:8d}" for v in values]
        flag = "  FAIL" if r.failed else ""
        lines.append(f"{r.page:<{width}} " + " ".join(cells) + flag)
        if r.failed or r.ex_prose:
            lines += [f"    {d}" for d in r.detail]
    totals = [sum(getattr(r, c) for r in reports) for c in cols]
    cells = [f"{v:8.1f}" if isinstance(v, float) else f"{v:8d}" for v in totals]
    lines.append(f"{'TOTAL (' + str(len(reports)) + ' pages)':<{width}} " + " ".join(cells))
    failed = [r.page for r in reports if not r.loaded]
    if failed:
        lines.append(f"pages that did not load: {failed}")
    lines.append(f"other hosts the site asked for: {hosts[0] or 'none'}")
    lines.append(f"(Chromium's own services asked for, refused: {', '.join(hosts[1]) or 'none'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the check from the command line.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        0 when every page passes, else 1.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build -d SITE)")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--budget-ms", type=int, default=15000, help="virtual time per page")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per page")
    parser.add_argument("--max-prose-examples", type=int, default=-1, help="-1: no limit")
    parser.add_argument("--json", type=Path, help="also write the reports as JSON here")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    reports, hosts = check_site(
        args.site, jobs=args.jobs, budget_ms=args.budget_ms, timeout_s=args.timeout
    )
    elapsed = time.perf_counter() - start
    print(summary(reports, hosts))
    print(f"browser check: {len(reports)} pages in {elapsed:.0f} s ({args.jobs} at a time)")
    if args.json:
        data = {
            "pages": [dataclasses.asdict(r) for r in reports],
            "other_hosts": hosts[0],
            "browser_hosts": hosts[1],
            "seconds": elapsed,
        }
        args.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
    prose = sum(r.ex_prose for r in reports)
    bad = [r.page for r in reports if r.failed]
    if bad or hosts[0]:
        print(f"FAILED: {len(bad)} pages with errors; other hosts asked for: {hosts[0]}")
        return 1
    if 0 <= args.max_prose_examples < prose:
        print(f"FAILED: {prose} examples shown as prose (at most {args.max_prose_examples})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
