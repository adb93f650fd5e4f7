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
- It executes what mkdocs-jupyter would have: its ``include``/``ignore`` patterns, minus
  excluded files and ``execute_ignore`` matches. Those must be ``.ipynb`` files; a Python or
  Markdown notebook to execute stops the build with its name.
- The kernels see ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless it is set: on a GPU, two JAX
  processes that each take most of its memory up front would not both fit.
- Executed copies are kept in ``.cache/artifex-notebooks/<content hash>/``, so a rebuild
  re-executes only edited notebooks, and copies no notebook uses any more are removed. That
  cache does not see library changes: delete the directory to run every notebook again. CI
  builds from a clean clone, so it runs them all.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path, PurePath
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import set_exclusions

JOBS_ENV = "ARTIFEX_NOTEBOOK_JOBS"
CACHE_DIR = Path(".cache") / "artifex-notebooks"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of IPython's tracebacks
_plugin: Any = None  # mkdocs-jupyter, when mkdocs.yml asks it to execute the notebooks
_sources: dict[str, str] = {}  # page src_uri -> the clean notebook, restored after rendering


def _jobs() -> int:
    raw = os.environ.get(JOBS_ENV, "").strip() or "2"
    try:
        jobs = int(raw)
    except ValueError:
        jobs = 0
    if jobs < 1:
        msg = f"{JOBS_ENV}: expected a number of notebooks to run at once (>= 1), got {raw!r}"
        raise PluginError(msg)
    return jobs


def on_config(config: Any) -> Any:
    """Takes the notebooks' execution over from mkdocs-jupyter (see the module docstring)."""
    global _plugin
    _plugin = None
    plugin = config.plugins.get("mkdocs-jupyter")
    if plugin is None or not plugin.config["execute"]:
        return config
    if plugin.config["allow_errors"]:
        msg = "mkdocs.yml: the notebooks hook fails the build on errors; set allow_errors: false"
        raise PluginError(msg)
    plugin.config["execute"] = False
    _plugin = plugin
    return config


def _run(source: str, target: Path, kernel_name: str = "") -> Path:
    """Executes the notebook ``source`` (in its own directory) and writes it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute"]
    if kernel_name:  # else the notebook's own kernelspec, as mkdocs-jupyter does
        cmd += [f"--ExecutePreprocessor.kernel_name={kernel_name}"]
    cmd += ["--ExecutePreprocessor.store_widget_state=True"]
    env = {**os.environ}
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # Written next to the target and renamed: the cache never holds a half-written notebook.
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=target.parent) as tmp:
        cmd += ["--output-dir", tmp, "--output", "executed", source]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            tail = _ANSI.sub("", done.stdout + done.stderr)[-4000:]
            msg = f"notebook {source} failed (exit code {done.returncode}):\n{tail}"
            raise PluginError(msg)
        os.replace(Path(tmp) / "executed.ipynb", target)
    return target


def _executed_here(f: Any) -> bool:
    """Whether mkdocs-jupyter renders ``f`` and would have executed it."""
    if not f.abs_src_path or not f.inclusion.is_included() or not _plugin.should_include(f):
        return False
    if any(PurePath(f.abs_src_path).match(p) for p in _plugin.config["execute_ignore"]):
        return False
    if not f.src_uri.endswith(".ipynb"):
        msg = f"{f.src_uri}: the notebooks hook executes .ipynb notebooks only"
        raise PluginError(msg)
    return True


def on_files(files: Any, config: Any) -> Any:
    """Executes the notebooks, ``ARTIFEX_NOTEBOOK_JOBS`` at a time, and renders the copies."""
    _sources.clear()
    if _plugin is None:
        return files
    # mkdocs sets which files are excluded (exclude_docs) again after on_files; the files
    # mkdocs-jupyter wrapped do not have it yet, and the function leaves set values alone.
    set_exclusions(files, config)
    notebooks = [f for f in files if _executed_here(f)]
    if not notebooks:
        return files
    cache = Path(config.config_file_path).parent / CACHE_DIR
    kernel_name = _plugin.config["kernel_name"]
    jobs: list[tuple[Any, concurrent.futures.Future]] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=_jobs()) as pool:
        for f in notebooks:
            digest = hashlib.sha256(Path(f.abs_src_path).read_bytes()).hexdigest()[:32]
            # The copy keeps the notebook's file name (mkdocs-jupyter links the page to it).
            target = cache / digest / Path(f.abs_src_path).name
            if target.is_file():
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(target)
                jobs.append((f, done))
            else:
                jobs.append((f, pool.submit(_run, f.abs_src_path, target, kernel_name)))
    errors = [str(job.exception()) for _, job in jobs if job.exception() is not None]
    if errors:
        raise PluginError("\n\n".join(errors))
    used = set()
    for f, job in jobs:
        _sources[f.src_uri] = f.abs_src_path
        f.abs_src_path = str(job.result())
        used.add(job.result().parent)
    for entry in cache.iterdir():  # copies of notebooks that changed since, or went away
        if entry.is_dir() and entry not in used:
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_file():
            entry.unlink(missing_ok=True)
    return files


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Points the page back at the clean notebook, which mkdocs-jupyter copies for download."""
    source = _sources.get(page.file.src_uri)
    if source is not None:
        page.file.abs_src_path = source
    return html
