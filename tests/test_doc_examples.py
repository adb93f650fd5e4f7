"""The examples in the library's docstrings run (doctest), module by module.

Every module of the package is collected (``pkgutil.walk_packages``), and every public function
and class (the names in each module's ``__all__``) must have an example.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import signal
from pathlib import Path

import pytest

import artifex


def _modules() -> list[str]:
    names = ["artifex"] + [m.name for m in pkgutil.walk_packages(artifex.__path__, "artifex.")]
    return sorted(n for n in names if n != "artifex.__main__")


def _examples(module_name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module) if t.examples]


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples_run(module_name, monkeypatch):
    # Examples that read tests/fixtures use paths relative to the repository root, as a reader
    # running them from a clone would (another test may have changed this worker's directory).
    monkeypatch.chdir(ROOT)
    # Ctrl-C as a reader's interpreter handles it (a process started in the background by a
    # shell without job control inherits SIGINT ignored; the interrupt examples need it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    try:
        for test in _examples(module_name):
            runner.run(test)
    finally:
        signal.signal(signal.SIGINT, previous)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"


def _public_objects() -> dict[str, object]:
    """Dotted path (where defined) -> object, for every function and class in an ``__all__``."""
    found: dict[str, object] = {}
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = inspect.unwrap(getattr(module, name))
            is_code = inspect.isclass(obj) or inspect.isfunction(obj)
            if is_code and getattr(obj, "__module__", "").startswith("artifex"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _has_example(obj: object) -> bool:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if inspect.isclass(obj) and "__init__" in obj.__dict__:
        doc = (doc or "") + (obj.__init__.__doc__ or "")
    return bool(doctest.DocTestParser().get_examples(doc or ""))


def test_every_module_is_collected():
    assert "artifex.generative_models.training.rl.core.objective" in _modules()
    assert len(_modules()) > 40


def test_every_public_function_and_class_has_an_example():
    missing = sorted(path for path, obj in _public_objects().items() if not _has_example(obj))
    assert not missing, f"{len(missing)} public objects without a >>> example:\n" + "\n".join(
        missing
    )
