"""The docs build's notebook hook (``docs/_hooks/notebooks.py``): it executes the notebooks
concurrently for mkdocs-jupyter, fails on a cell error, reuses executed copies per notebook
content, and leaves the clean source as the site's download copy.

The last tests build small real sites (mkdocs and mkdocs-jupyter as installed, the hook loaded
by ``mkdocs.yml``), so they fail if either changes how it reads the notebook files."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import nbformat
import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort, PluginError

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "_hooks" / "notebooks.py"


@pytest.fixture
def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_notebooks_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # fresh module state for each test
    return module


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def test_an_executed_copy_holds_the_outputs_and_ran_in_the_notebooks_directory(hook, tmp_path):
    source = _notebook(tmp_path / "good.ipynb", "print(6 * 7)", "import os\nprint(os.getcwd())")
    target = hook._run(str(source), tmp_path / "out" / "good.ipynb")
    nb = nbformat.read(target, as_version=4)
    assert nb.cells[0].outputs[0]["text"] == "42\n"
    assert Path(nb.cells[1].outputs[0]["text"].strip()).resolve() == tmp_path.resolve()
    assert nbformat.read(source, as_version=4).cells[0].outputs == []  # the source stays clean
    assert sorted(p.name for p in target.parent.iterdir()) == ["good.ipynb"]  # no leftovers


def test_a_cell_error_fails_naming_the_notebook_and_the_error(hook, tmp_path):
    source = _notebook(tmp_path / "bad.ipynb", "x = 1", "raise ValueError('boom in cell 2')")
    target = tmp_path / "out" / "bad.ipynb"
    with pytest.raises(PluginError, match=r"bad\.ipynb failed") as info:
        hook._run(str(source), target)
    assert "ValueError: boom in cell 2" in str(info.value)
    assert "\x1b[" not in str(info.value)
    assert list(target.parent.iterdir()) == []  # nothing half-written left in the cache


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "\u00b2"])
def test_the_number_of_jobs_is_checked(hook, monkeypatch, value):
    monkeypatch.setenv(hook.JOBS_ENV, value)
    with pytest.raises(PluginError, match=r"ARTIFEX_NOTEBOOK_JOBS: .* got "):
        hook._jobs()


@pytest.mark.parametrize(("value", "jobs"), [(None, 2), ("", 2), (" 3 ", 3), ("1", 1)])
def test_the_number_of_jobs_defaults_to_two(hook, monkeypatch, value, jobs):
    if value is None:
        monkeypatch.delenv(hook.JOBS_ENV, raising=False)
    else:
        monkeypatch.setenv(hook.JOBS_ENV, value)
    assert hook._jobs() == jobs


def _fake_config(execute: bool, allow_errors: bool = False) -> SimpleNamespace:
    plugin = SimpleNamespace(config={"execute": execute, "allow_errors": allow_errors})
    return SimpleNamespace(plugins={"mkdocs-jupyter": plugin})


def test_the_hook_takes_execution_over_from_mkdocs_jupyter(hook):
    config = hook.on_config(_fake_config(execute=True))
    assert config.plugins["mkdocs-jupyter"].config["execute"] is False
    assert hook._plugin is config.plugins["mkdocs-jupyter"]
    hook.on_config(_fake_config(execute=False))
    assert hook._plugin is None
    hook.on_config(_fake_config(execute=True))
    hook.on_config(SimpleNamespace(plugins={}))  # no mkdocs-jupyter: nothing to execute
    assert hook._plugin is None
    with pytest.raises(PluginError, match="allow_errors: false"):
        hook.on_config(_fake_config(execute=True, allow_errors=True))


# ----------------------------------------------------------------- real builds of small sites
SIX_TIMES_SEVEN = "print('res' + 'ult-' + str(6 * 7))"  # "result-42" only in the output


def _site(
    tmp_path: Path, notebooks: dict[str, tuple[str, ...]], execute: bool = True, **jupyter: Any
) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "index.md").write_text("# Home\n")
    (docs / "_build").mkdir(exist_ok=True)
    (docs / "_build" / "tool.py").write_text("x = 1\n")  # excluded, as docs/_hooks/ is
    for name, cells in notebooks.items():
        _notebook(docs / f"{name}.ipynb", *cells)
    config = {
        "site_name": "t",
        "docs_dir": "docs",
        "site_dir": "site",
        "theme": {"name": "mkdocs"},
        "plugins": [
            {
                "mkdocs-jupyter": {
                    "execute": execute,
                    "allow_errors": False,
                    "include_source": True,
                    "cache": False,  # mkdocs-jupyter's own cache sits in the working directory
                    **jupyter,
                }
            }
        ],
        "hooks": [str(HOOK)],
        "exclude_docs": "/_build/\n",
    }
    (tmp_path / "mkdocs.yml").write_text(json.dumps(config))  # YAML reads JSON
    return tmp_path


def _build(site: Path) -> None:
    build(load_config(str(site / "mkdocs.yml")))


def _copies(site: Path) -> list[Path]:
    return sorted((site / ".cache" / "artifex-notebooks").glob("*/*.ipynb"))


def test_a_site_shows_the_outputs_offers_the_clean_notebook_and_reuses_the_copy(tmp_path):
    site = _site(tmp_path, {"nb": (SIX_TIMES_SEVEN,)})
    _build(site)
    page = (site / "site" / "nb" / "index.html").read_text()
    assert "result-42" in page and "print" in page
    offered = nbformat.read(site / "site" / "nb" / "nb.ipynb", as_version=4)
    assert offered.cells[0].outputs == []  # the download copy is the clean source
    (copy,) = _copies(site)
    assert copy.name == "nb.ipynb"  # the page's link to its notebook keeps the file name
    assert nbformat.read(copy, as_version=4).cells[0].outputs[0]["text"] == "result-42\n"

    stamp = copy.stat().st_mtime_ns
    _build(site)  # unchanged: the executed copy is reused, not run again
    assert _copies(site) == [copy] and copy.stat().st_mtime_ns == stamp

    stray = copy.parent.parent / "nb-0123.ipynb"  # a file in the cache that no build uses
    stray.write_text("{}")
    # edited: run again, the old copy removed
    _notebook(site / "docs" / "nb.ipynb", SIX_TIMES_SEVEN.replace("7", "9"))
    _build(site)
    (new,) = _copies(site)
    assert new != copy and not copy.exists() and not stray.exists()
    assert "result-54" in (site / "site" / "nb" / "index.html").read_text()


def test_failing_notebooks_fail_the_build_each_named_and_the_others_are_kept(tmp_path, caplog):
    site = _site(
        tmp_path,
        {
            "bad_a": ("raise RuntimeError('first failure')",),
            "good": ("print('fine')",),
            "bad_b": ("1 / 0",),
        },
    )
    with caplog.at_level(logging.ERROR), pytest.raises(Abort, match="BuildError"):
        _build(site)
    errors = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert "bad_a.ipynb failed" in errors and "first failure" in errors
    assert "bad_b.ipynb failed" in errors and "ZeroDivisionError" in errors
    assert [p.name for p in _copies(site)] == ["good.ipynb"]


def test_a_site_without_execution_runs_nothing(tmp_path):
    site = _site(tmp_path, {"nb": (SIX_TIMES_SEVEN,)}, execute=False)
    _build(site)
    assert _copies(site) == []
    page = (site / "site" / "nb" / "index.html").read_text()
    assert "print" in page and "result-42" not in page


def test_execute_ignore_is_respected(tmp_path):
    site = _site(tmp_path, {"nb": (SIX_TIMES_SEVEN,)}, execute_ignore=["*/nb.ipynb"])
    _build(site)
    assert _copies(site) == []
    assert "result-42" not in (site / "site" / "nb" / "index.html").read_text()


def test_a_python_notebook_to_execute_stops_the_build_by_name(tmp_path, caplog):
    site = _site(tmp_path, {})
    (site / "docs" / "script.py").write_text("print(1)\n")  # mkdocs-jupyter includes *.py
    with caplog.at_level(logging.ERROR), pytest.raises(Abort, match="BuildError"):
        _build(site)
    errors = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    assert "script.py: the notebooks hook executes .ipynb notebooks only" in errors
