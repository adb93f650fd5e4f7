"""Importing the library imports neither torch nor vLLM (the vllm extra is optional).

Each check runs in a fresh interpreter whose import system refuses ``torch`` and ``vllm``, so a
module that imports either at import time fails, whether or not they are installed here.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPTIONAL = ("torch", "vllm")

BLOCKER = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked in this test")
        return None
sys.meta_path.insert(0, Refuse())
"""


def run(code: str) -> subprocess.CompletedProcess:
    script = BLOCKER.format(blocked=OPTIONAL) + code
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip


def test_the_blocker_blocks():
    done = run("import torch")
    assert done.returncode != 0 and "torch is blocked in this test" in done.stderr


def test_every_library_module_imports_without_torch_or_vllm():
    done = run(
        "import pkgutil, importlib, artifex\n"
        "names = [m.name for m in pkgutil.walk_packages(artifex.__path__, 'artifex.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "assert 'artifex.generative_models.inference.engines.vllm' in names\n"
        f"assert not [m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r}]\n"
        "print(len(names))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 40


def test_building_a_vllm_engine_without_vllm_says_how_to_install_it():
    done = run(
        "from flax import nnx\n"
        "from artifex.generative_models.models.causal_lm import CausalLM, CausalLMConfig\n"
        "from artifex.generative_models.inference.engines import VLLMEngine\n"
        "cfg = CausalLMConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=1,"
        " num_heads=2)\n"
        "try:\n"
        "    VLLMEngine(CausalLM(cfg, rngs=nnx.Rngs(0)))\n"
        "except ImportError as err:\n"
        "    print('refused:', err)\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: VLLMEngine needs vLLM" in done.stdout
    assert 'pip install "artifex-grpo[vllm]"' in done.stdout


def test_torch_and_vllm_are_imported_inside_functions_only():
    seen = []
    for path in (ROOT / "artifex").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_functions = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(n.split(".")[0] in OPTIONAL for n in names):
                rel = path.relative_to(ROOT).as_posix()
                assert id(node) in in_functions, f"{rel}: {names} at module level"
                seen.append(rel)
    assert "artifex/generative_models/inference/engines/vllm.py" in seen  # the check sees them
