"""The modules of artifex/generative_models/models/causal_lm import each other one way only.

Every import counts, including those inside functions (a lazy import is still a cycle).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = "artifex.generative_models.models.causal_lm"
ROOT = pathlib.Path(__file__).resolve().parents[4] / PACKAGE.replace(".", "/")


def import_graph() -> dict[str, set[str]]:
    """`{module: modules of the package it imports}`, the package `__init__` left out."""
    modules = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
                deps.add("__init__")  # `from the.package import x` runs the package __init__
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                deps.add(node.module.rsplit(".", 1)[-1])
            elif isinstance(node, ast.Import):
                deps.update(
                    a.name.rsplit(".", 1)[-1] for a in node.names if a.name.startswith(PACKAGE)
                )
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path, node, dep]
            if dep not in state and (cycle := visit(dep, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_cycle_finder():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_and_no_import_through_the_package():
    graph = import_graph()
    assert find_cycle(graph) is None
    assert not [m for m, deps in graph.items() if "__init__" in deps]


def test_checkpoint_formats_sit_below_the_model():
    graph = import_graph()
    assert "model" not in graph["hf_io"]
    assert "model" not in graph["gguf"]
    assert {"hf_io", "gguf"} <= graph["model"]
