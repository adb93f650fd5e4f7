"""The docs build's notebook hook (``docs/_hooks/notebooks.py``): it executes the notebooks
concurrently, fails on a cell error, reuses executed copies per notebook content, and hands
mkdocs-jupyter the clean source again for the download copy."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_hook() -> ModuleType:
    path = ROOT / "docs" / "_hooks" / "notebooks.py"
    spec = importlib.util.spec_from_file_location("_notebooks_hook", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def hook():
    return _load_hook()  # fresh module state (which notebooks it replaced) for each test


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


def test_an_executed_copy_holds_the_outputs_and_ran_in_the_notebooks_directory(hook, tmp_path):
    source = _notebook(tmp_path / "good.ipynb", "print(6 * 7)", "import os\nprint(os.getcwd())")
    target = hook._run(str(source), tmp_path / "out" / "good.ipynb")
    nb = nbformat.read(target, as_version=4)
    assert nb.cells[0].outputs[0]["text"] == "42\n"
    assert Path(nb.cells[1].outputs[0]["text"].strip()).resolve() == tmp_path.resolve()
    assert nbformat.read(source, as_version=4).cells[0].outputs == []  # the source stays clean


def test_a_cell_error_fails_naming_the_notebook_and_the_error(hook, tmp_path):
    source = _notebook(tmp_path / "bad.ipynb", "x = 1", "raise ValueError('boom in cell 2')")
    target = tmp_path / "out" / "bad.ipynb"
    with pytest.raises(RuntimeError, match=r"bad\.ipynb failed") as info:
        hook._run(str(source), target)
    assert "ValueError: boom in cell 2" in str(info.value)
    assert "\x1b[" not in str(info.value)
    assert not target.exists() and not target.with_suffix(".partial").exists()


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_the_number_of_jobs_is_checked(hook, monkeypatch, value):
    monkeypatch.setenv(hook.JOBS_ENV, value)
    with pytest.raises(ValueError, match=f"ARTIFEX_NOTEBOOK_JOBS: .* got '{value}'"):
        hook._jobs()


def test_the_number_of_jobs_defaults_to_two(hook, monkeypatch):
    monkeypatch.delenv(hook.JOBS_ENV, raising=False)
    assert hook._jobs() == 2
    monkeypatch.setenv(hook.JOBS_ENV, "3")
    assert hook._jobs() == 3


def _config(execute: bool, allow_errors: bool = False) -> SimpleNamespace:
    plugin = SimpleNamespace(config={"execute": execute, "allow_errors": allow_errors})
    return SimpleNamespace(plugins={"mkdocs-jupyter": plugin})


def test_the_hook_takes_execution_over_from_mkdocs_jupyter(hook):
    config = hook.on_config(_config(execute=True))
    assert config.plugins["mkdocs-jupyter"].config["execute"] is False
    assert hook._execute is True
    config = hook.on_config(_config(execute=False))
    assert hook._execute is False
    with pytest.raises(ValueError, match="allow_errors: false"):
        hook.on_config(_config(execute=True, allow_errors=True))


def test_executed_copies_are_reused_per_content_and_the_source_comes_back(
    hook, tmp_path, monkeypatch
):
    (tmp_path / "mkdocs.yml").write_text("site_name: x\n")
    a = _notebook(tmp_path / "a.ipynb", "print(1)")
    b = _notebook(tmp_path / "b.ipynb", "print(2)")
    runs = []

    def fake_run(source: str, target: Path) -> Path:
        runs.append(os.path.basename(source))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(Path(source).read_text())
        return target

    monkeypatch.setattr(hook, "_run", fake_run)
    hook.on_config(_config(execute=True))
    config = SimpleNamespace(config_file_path=str(tmp_path / "mkdocs.yml"))

    def files():
        page = SimpleNamespace(src_uri="guide.md", abs_src_path=str(tmp_path / "guide.md"))
        return [
            SimpleNamespace(src_uri="notebooks/a.ipynb", abs_src_path=str(a)),
            SimpleNamespace(src_uri="notebooks/b.ipynb", abs_src_path=str(b)),
            page,
        ]

    first = hook.on_files(files(), config)
    assert sorted(runs) == ["a.ipynb", "b.ipynb"]
    cache = tmp_path / ".cache" / "artifex-notebooks"
    assert Path(first[0].abs_src_path).parent == cache
    assert first[2].abs_src_path == str(tmp_path / "guide.md")  # not a notebook: untouched

    _notebook(b, "print(3)")  # b edited, a not
    second = hook.on_files(files(), config)
    assert sorted(runs) == ["a.ipynb", "b.ipynb", "b.ipynb"]
    assert second[0].abs_src_path == first[0].abs_src_path
    assert second[1].abs_src_path != first[1].abs_src_path

    page = SimpleNamespace(file=second[1])
    assert hook.on_page_content("<p>x</p>", page, config, second) == "<p>x</p>"
    assert page.file.abs_src_path == str(b)


def test_nothing_runs_when_the_notebooks_are_not_executed(hook, tmp_path, monkeypatch):
    monkeypatch.setattr(hook, "_run", lambda *a: pytest.fail("executed"))
    hook.on_config(_config(execute=False))
    files = [SimpleNamespace(src_uri="n.ipynb", abs_src_path=str(tmp_path / "n.ipynb"))]
    assert hook.on_files(files, SimpleNamespace(config_file_path="mkdocs.yml")) is files
    assert files[0].abs_src_path == str(tmp_path / "n.ipynb")
