"""The checkpoint formats of causal_lm sit below the model (the whole library's import graph,
lazy imports included, is checked for cycles by tests/test_import_graph.py)."""

from __future__ import annotations

from tests.test_import_graph import find_cycle, import_graph

PACKAGE = "artifex.generative_models.models.causal_lm"


def test_no_import_cycles_inside_the_package():
    graph = {m: {d for d in deps if d.startswith(PACKAGE)} for m, deps in import_graph().items()}
    inside = {m: d for m, d in graph.items() if m.startswith(PACKAGE + ".")}
    assert len(inside) >= 8
    assert find_cycle(inside) is None
    # Modules of the package never import through the package __init__ (it imports them).
    assert not [m for m, deps in inside.items() if PACKAGE in deps]


def test_checkpoint_formats_sit_below_the_model():
    graph = import_graph()
    assert f"{PACKAGE}.model" not in graph[f"{PACKAGE}.hf_io"]
    assert f"{PACKAGE}.model" not in graph[f"{PACKAGE}.gguf"]
    assert {f"{PACKAGE}.hf_io", f"{PACKAGE}.gguf"} <= graph[f"{PACKAGE}.model"]
