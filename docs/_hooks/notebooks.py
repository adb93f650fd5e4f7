"""MkDocs hook: executes the notebooks concurrently before their pages are rendered.

mkdocs-jupyter executes a notebook when it renders the page, one notebook after the other. Each
notebook runs in a kernel of its own, a separate process, and most of a notebook's time is one
core compiling or running Python. So this hook executes them all at once in separate
processes, ``ARTIFEX_NOTEBOOK_JOBS`` at a time (default 2), before any page is rendered. It
turns mkdocs-jupyter's own execution off and points each notebook page at its executed copy.
The copy of the notebook that the site offers for download stays the clean source.

- ``ARTIFEX_EXECUTE_NOTEBOOKS=false`` (read by ``mkdocs.yml``) renders the notebooks without
  running them, as before.
- A cell that raises fails the build, as mkdocs-jupyter's ``allow_errors: false`` did. The error
  names the notebook and ends with the tail of its output.
- Executed copies are kept in ``.cache/artifex-notebooks/``, one per notebook content, so a
  rebuild re-executes only edited notebooks. That cache does not see library changes: delete the
  directory to run every notebook again. CI builds from a clean clone, so it runs them all.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

JOBS_ENV = "ARTIFEX_NOTEBOOK_JOBS"
CACHE_DIR = Path(".cache") / "artifex-notebooks"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of IPython's tracebacks
_execute = False  # mkdocs.yml asked for executed notebooks (mkdocs-jupyter's `execute`)
_sources: dict[str, str] = {}  # page src_uri -> the clean notebook, restored after rendering


def _jobs() -> int:
    raw = os.environ.get(JOBS_ENV, "2").strip()
    if not raw.isdigit() or int(raw) < 1:
        msg = f"{JOBS_ENV}: expected a number of notebooks to run at once (>= 1), got {raw!r}"
        raise ValueError(msg)
    return int(raw)


def on_config(config: Any) -> Any:
    """Takes the notebooks' execution over from mkdocs-jupyter (see the module docstring)."""
    global _execute
    plugin = config.plugins.get("mkdocs-jupyter")
    if plugin is None:
        return config
    _execute = bool(plugin.config["execute"])
    if _execute and plugin.config["allow_errors"]:
        msg = "mkdocs.yml: the notebooks hook fails the build on errors; set allow_errors: false"
        raise ValueError(msg)
    plugin.config["execute"] = False
    return config


def _run(source: str, target: Path) -> Path:
    """Executes the notebook ``source`` (in its own directory) and writes it to ``target``."""
    with tempfile.TemporaryDirectory(prefix="artifex-notebook-") as tmp:
        cmd = [sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute"]
        cmd += ["--ExecutePreprocessor.kernel_name=python3"]
        cmd += ["--ExecutePreprocessor.store_widget_state=True"]
        cmd += ["--output-dir", tmp, "--output", "executed", source]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = _ANSI.sub("", done.stdout + done.stderr)[-4000:]
            msg = f"notebook {source} failed (exit code {done.returncode}):\n{tail}"
            raise RuntimeError(msg)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        os.replace(Path(tmp) / "executed.ipynb", partial)
        os.replace(partial, target)  # whole or absent: a build stopped midway leaves no copy
    return target


def on_files(files: Any, config: Any) -> Any:
    """Executes the notebooks, ``ARTIFEX_NOTEBOOK_JOBS`` at a time, and renders the copies."""
    if not _execute:
        return files
    notebooks = [f for f in files if f.src_uri.endswith(".ipynb") and f.abs_src_path]
    if not notebooks:
        return files
    cache = Path(config.config_file_path).parent / CACHE_DIR
    jobs: list[tuple[Any, concurrent.futures.Future]] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=_jobs()) as pool:
        for f in notebooks:
            digest = hashlib.sha256(Path(f.abs_src_path).read_bytes()).hexdigest()[:32]
            target = cache / f"{Path(f.src_uri).stem}-{digest}.ipynb"
            if target.is_file():
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(target)
                jobs.append((f, done))
            else:
                jobs.append((f, pool.submit(_run, f.abs_src_path, target)))
    errors = [str(job.exception()) for _, job in jobs if job.exception() is not None]
    if errors:
        raise RuntimeError("\n\n".join(errors))
    for f, job in jobs:
        _sources[f.src_uri] = f.abs_src_path
        f.abs_src_path = str(job.result())
    return files


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Points the page back at the clean notebook, which mkdocs-jupyter copies for download."""
    source = _sources.get(page.file.src_uri)
    if source is not None:
        page.file.abs_src_path = source
    return html
