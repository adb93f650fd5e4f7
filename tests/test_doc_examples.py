"""The examples in the library's docstrings run (doctest), module by module."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import artifex


def _modules() -> list[str]:
    names = ["artifex"] + [m.name for m in pkgutil.walk_packages(artifex.__path__, "artifex.")]
    return sorted(n for n in names if n != "artifex.__main__")


def _examples(module_name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(module) if t.examples]


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples_run(module_name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _examples(module_name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"
