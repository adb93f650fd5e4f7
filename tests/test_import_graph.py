"""The library's modules import each other one way only: no cycles, lazy imports included.

The graph has one node per module of ``artifex`` (a package's ``__init__`` is the package's
node). Every ``import`` counts, at module level or inside a function; for the cycle check,
imports under ``if TYPE_CHECKING:`` (annotations, never executed) are left out, and the layer
rules of ``training.rl`` count them too (a type-only import upward is still a layer knowing of
the one above it). ``from pkg import name`` is an edge to the submodule ``pkg.name`` when there
is one, else to ``pkg`` (its ``__init__``).

The layers of ``training.rl``, bottom to top (each sub-package's ``__init__`` says the same):
``core`` (the batch types ``core.batch`` and ``core.packing`` included) -> ``rewards`` ->
``update`` and ``rollouts`` (side by side: neither imports the other) -> ``run``; the
package's own ``__init__`` re-exports them all, and nothing inside the package imports it.

The demos (``artifex.demos``) sit on top of the library: nothing in it imports them except the
command line (``artifex.cli*``), which runs them, and the deprecated aliases at the demos' old
paths (``artifex.demo``, ``artifex.demo_tools``, ``artifex.flow_demo``).

Flow-GRPO is one feature package, ``generative_models.flow``, above models, inference and
training: nothing below it imports it. Its importers in the library are the demos, the command
line, the top-level flow modules (``artifex.flow_demo``, ``artifex.flow_shapes``) and the
deprecated modules at its old paths, which are the only modules left at those paths.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "artifex"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for inner in node.body:
                    skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the library modules it imports (``type_only``: ``TYPE_CHECKING`` ones too)."""
    paths = {module_name(p): p for p in LIBRARY.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set() if type_only else _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name if is_package else name.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rsplit(".", 1)[0]
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    if f"{base}.{alias.name}" in paths:
                        deps.add(f"{base}.{alias.name}")
                    elif base in paths:
                        deps.add(base)
        deps.discard(name)
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


def imports_of(graph: dict[str, set[str]], module: str) -> set[str]:
    return graph["artifex.generative_models." + module]


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # cli.py imports the loop inside functions: those edges are in the graph.
    assert "artifex.generative_models.training.rl.run.loop" in graph["artifex.cli"]


def test_the_type_only_graph_sees_type_checking_imports():
    # core/logprobs.py imports GRPOBatch for its annotations only.
    module = "artifex.generative_models.training.rl.core.logprobs"
    batch = "artifex.generative_models.training.rl.core.batch"
    assert batch not in import_graph()[module]
    assert batch in import_graph(type_only=True)[module]


def test_no_import_cycles_in_the_library():
    graph = import_graph()
    assert len(graph) > 40
    assert find_cycle(graph) is None


def test_layers_import_downward_only():
    graph = import_graph()
    training = "artifex.generative_models.training"
    # Models and the samplers know nothing of training (the Flow-GRPO pieces that do live in
    # the flow package, above training).
    for module, deps in graph.items():
        if module.startswith(("artifex.generative_models.models", "artifex.generative_models.inf")):
            assert not {d for d in deps if d.startswith(training)}, module
    # The generic training modules know no RL types.
    for generic in ("sharding", "checkpointing", "logging"):
        deps = imports_of(graph, f"training.{generic}")
        assert not {d for d in deps if d.startswith(f"{training}.rl")}, generic


RL = "artifex.generative_models.training.rl"
# Layer of each part of training.rl; a module may import its own layer and those below it.
RL_LAYERS = {
    "core": 0,
    "rewards": 1,
    "update": 2,
    "rollouts": 2,
    "run": 3,
}
SIDE_BY_SIDE = {("update", "rollouts"), ("rollouts", "update")}


def rl_part(module: str) -> str | None:
    """The layer part (``core``, ``update``, ...) of a module inside training.rl, else None.

    The deprecated aliases of the flow modules' old paths in training.rl are in no layer.
    """
    if not module.startswith(f"{RL}.") or module in FLOW_ALIASES:
        return None
    return module[len(RL) + 1 :].split(".")[0]


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for module, deps in graph.items():
        part = rl_part(module)
        if part is None:
            continue
        for dep in deps:
            if dep == RL:  # the facade re-exports everything: nothing inside imports it
                bad.append((module, dep))
                continue
            other = rl_part(dep)
            if other is None or other == part:
                continue
            if RL_LAYERS[other] > RL_LAYERS[part] or (part, other) in SIDE_BY_SIDE:
                bad.append((module, dep))
    return sorted(bad)


def test_every_part_of_rl_has_a_layer():
    parts = {rl_part(m) for m in import_graph()} - {None}
    assert parts <= set(RL_LAYERS), sorted(parts - set(RL_LAYERS))


def test_the_layer_rule_finds_an_upward_import():
    graph = {f"{RL}.core.losses": {f"{RL}.run.loop"}, f"{RL}.update.state": {f"{RL}.rollouts.x"}}
    assert layer_violations(graph) == [
        (f"{RL}.core.losses", f"{RL}.run.loop"),
        (f"{RL}.update.state", f"{RL}.rollouts.x"),
    ]
    assert layer_violations({f"{RL}.run.loop": {f"{RL}.core.losses"}}) == []


def test_rl_layers_import_downward_only_type_only_imports_included():
    assert layer_violations(import_graph(type_only=True)) == []


def test_no_import_cycles_type_only_imports_included():
    assert find_cycle(import_graph(type_only=True)) is None


def test_each_layer_package_says_what_it_may_import():
    import importlib

    for part in ("core", "update", "rollouts", "run"):
        doc = importlib.import_module(f"{RL}.{part}").__doc__ or ""
        assert "may import" in doc, part


DEMOS = "artifex.demos"
# The deprecated modules at the demos' old paths: each re-exports its demo and warns.
DEMO_ALIASES = {"artifex.demo", "artifex.demo_tools", "artifex.flow_demo"}


def may_import_demos(module: str) -> bool:
    """Whether a library module may import ``artifex.demos``: the demos, the CLI, the aliases."""
    return (
        module == DEMOS
        or module.startswith(f"{DEMOS}.")
        or module == "artifex.cli"
        or module.startswith("artifex.cli_")
        or module in DEMO_ALIASES
    )


def demo_importers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(module, demo module)`` for each import of the demos from where none may be."""
    bad = []
    for module, deps in graph.items():
        if may_import_demos(module):
            continue
        bad += [(module, d) for d in deps if d == DEMOS or d.startswith(f"{DEMOS}.")]
    return sorted(bad)


def test_the_demo_rule_finds_a_library_import_of_a_demo():
    graph = {
        f"{RL}.run.loop": {f"{DEMOS}.addition"},
        "artifex.cli": {f"{DEMOS}.flow"},
        f"{DEMOS}.tools": {f"{DEMOS}.addition"},
        "artifex.flow_shapes": {DEMOS},
    }
    assert demo_importers(graph) == [
        ("artifex.flow_shapes", DEMOS),
        (f"{RL}.run.loop", f"{DEMOS}.addition"),
    ]


def test_only_the_cli_imports_the_demos_type_only_imports_included():
    graph = import_graph(type_only=True)
    assert f"{DEMOS}.addition" in graph["artifex.cli"]  # the check sees the CLI's imports
    assert demo_importers(graph) == []


def test_the_demos_package_says_what_it_may_import():
    import importlib

    assert "may import" in (importlib.import_module(DEMOS).__doc__ or "")


FLOW = "artifex.generative_models.flow"
_GM = "artifex.generative_models"
# The deprecated modules at Flow-GRPO's old paths: each re-exports its new module and warns.
FLOW_ALIASES = {
    f"{_GM}.models.flow",
    *(f"{_GM}.models.flow.{m}" for m in ("compositional", "dit", "io", "model", "rewards")),
    *(f"{_GM}.models.flow.{m}" for m in ("shapes", "text_dit", "training")),
    f"{_GM}.inference.flow_sampling",
    f"{RL}.flow_batch",
    f"{RL}.flow_objective",
}
# The old paths: every module under them is an alias.
FLOW_OLD_PATHS = (f"{_GM}.models.flow", f"{_GM}.inference.flow_sampling", f"{RL}.flow_")


def may_import_flow(module: str) -> bool:
    """Whether a library module may import the flow package: itself, the demos, the CLI, the
    top-level flow modules and the aliases at the old paths."""
    return (
        module == FLOW
        or module.startswith(f"{FLOW}.")
        or may_import_demos(module)
        or module in {"artifex.flow_shapes", "artifex.flow_demo"}
        or module in FLOW_ALIASES
    )


def flow_importers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(module, flow module)`` for each import of the flow package from where none may be."""
    bad = []
    for module, deps in graph.items():
        if may_import_flow(module):
            continue
        bad += [(module, d) for d in deps if d == FLOW or d.startswith(f"{FLOW}.")]
    return sorted(bad)


def test_the_flow_rule_finds_an_import_of_the_flow_package_from_below():
    graph = {
        f"{RL}.rewards.combine": {f"{FLOW}.rewards"},
        f"{_GM}.inference": {FLOW},
        "artifex.cli_flow": {FLOW},
        f"{FLOW}.batch": {f"{RL}.batch", f"{FLOW}.sde"},
        f"{RL}.flow_batch": {f"{FLOW}.batch"},
    }
    assert flow_importers(graph) == [
        (f"{_GM}.inference", FLOW),
        (f"{RL}.rewards.combine", f"{FLOW}.rewards"),
    ]


def test_nothing_below_the_flow_package_imports_it_type_only_imports_included():
    graph = import_graph(type_only=True)
    assert f"{FLOW}.sampling" in graph[f"{_GM}.inference.flow_sampling"]  # the check sees them
    assert flow_importers(graph) == []


def test_the_flow_package_imports_only_downward():
    # Its modules may import models, inference, training and utils, and each other.
    graph = import_graph(type_only=True)
    above = ("artifex.demos", "artifex.cli", "artifex.flow_", *FLOW_ALIASES)
    for module, deps in graph.items():
        if module == FLOW or module.startswith(f"{FLOW}."):
            assert not {d for d in deps if d.startswith(above)}, module


def test_only_the_aliases_are_left_at_the_flow_old_paths():
    old = {m for m in import_graph() if m.startswith(FLOW_OLD_PATHS)}
    assert old == FLOW_ALIASES
    for module in FLOW_ALIASES:
        path = LIBRARY.parent / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
            a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
        }
        # an alias imports only the new modules (and warnings), defines nothing, warns
        assert imported - {"warnings"}, module
        assert all(m == FLOW or m.startswith(f"{FLOW}.") for m in imported - {"warnings"}), module
        assert not any(
            isinstance(n, ast.FunctionDef | ast.ClassDef | ast.Assign) for n in tree.body
        ), module
        assert "DeprecationWarning" in path.read_text(encoding="utf-8"), module


def test_the_flow_package_says_what_it_may_import():
    import importlib

    assert "may import" in (importlib.import_module(FLOW).__doc__ or "")


# ------------------------------------------------------------------ private names stay home
def _package(module: str, is_package: bool) -> str:
    return module if is_package else module.rsplit(".", 1)[0]


def private_imports(sources: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(importer, imported)`` for each underscore name (or underscore module) of the library
    that a module imports from outside the package that holds it.

    The parts a module was split into share their private helpers inside their package (and
    its sub-packages); another package uses a public name. Aliases at deprecated paths, which
    re-export whatever the old module had, are left out. ``sources``: module name -> source
    (a package's module name ends in ``.__init__``); the library's files by default.
    """
    if sources is None:
        sources = {
            ".".join(p.relative_to(ROOT).with_suffix("").parts): p.read_text(encoding="utf-8")
            for p in LIBRARY.rglob("*.py")
        }
    packages = {m.removesuffix(".__init__") for m in sources if m.endswith(".__init__")}
    modules = {m.removesuffix(".__init__") for m in sources}
    found = []
    for key, source in sources.items():
        importer = key.removesuffix(".__init__")
        if importer in FLOW_ALIASES or importer in DEMO_ALIASES:
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in modules:
                continue
            home = node.module if node.module in packages else node.module.rsplit(".", 1)[0]
            if importer == home or importer.startswith(home + "."):
                continue
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if private_module or (alias.name.startswith("_") and target not in modules):
                    found.append((importer, target))
    return sorted(found)


def test_the_private_name_rule_finds_an_import_from_another_package():
    sources = {
        "a.__init__": "",
        "a.x": "def _helper(): ...\ndef public(): ...",
        "a.y": "from a.x import _helper",  # the same package: allowed
        "a.sub.z": "from a.x import _helper",  # a sub-package: allowed
        "b.w": "from a.x import _helper, public\nfrom a._private import thing",
        "a._private": "thing = 1",
    }
    assert private_imports(sources) == [("b.w", "a._private.thing"), ("b.w", "a.x._helper")]


def test_no_module_imports_a_private_name_of_another_package():
    assert private_imports() == []
