"""The demos' old module paths still import: the same objects, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys

import pytest

import artifex.demos

OLD_TO_NEW = {
    "artifex.demo": "artifex.demos.addition",
    "artifex.demo_tools": "artifex.demos.tools",
    "artifex.flow_demo": "artifex.demos.flow",
}


@pytest.mark.parametrize(("old", "new"), OLD_TO_NEW.items())
def test_old_path_warns_and_gives_the_same_objects(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh: the warning again
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        alias = importlib.import_module(old)
    module = importlib.import_module(new)
    for name in module.__all__:
        assert getattr(alias, name) is getattr(module, name), name
    assert not hasattr(alias, "__all__")  # documented once, at the new path


def test_the_package_reexports_every_demo_name():
    names = {n for new in OLD_TO_NEW.values() for n in importlib.import_module(new).__all__}
    assert set(artifex.demos.__all__) == names


def test_a_tool_given_by_its_old_path_is_the_same_function(monkeypatch):
    from artifex.cli import import_object

    monkeypatch.delitem(sys.modules, "artifex.demo_tools", raising=False)
    with pytest.warns(DeprecationWarning):
        old = import_object("artifex.demo_tools:multiply")
    assert old is import_object("artifex.demos.tools:multiply")
