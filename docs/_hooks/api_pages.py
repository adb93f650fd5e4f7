"""MkDocs hook: generates the API reference, one page per public module.

A module is public when it defines ``__all__``. The package is read statically (``ast``, nothing
is imported), so a new module with an ``__all__`` gets its page without editing the docs. Each
page renders the names the module defines with a mkdocstrings ``:::`` directive, and lists the
names it re-exports with links to the page of the module that defines them.

``tests/test_docs.py`` imports this file to check that every public name is rendered.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

PACKAGE = "artifex"
API_DIR = "api"
ROOT = Path(__file__).resolve().parents[2]

_ROLE_RE = re.compile(r":(?:py:)?[a-z]+:`~?([^`]+)`")

_GM = "artifex.generative_models"
_RL = f"{_GM}.training.rl"
_LM = f"{_GM}.models.causal_lm"


@dataclasses.dataclass(frozen=True)
class Group:
    """A concept of the API reference: a navigation section and a table on the overview page.

    Attributes:
        title: Section title.
        about: One sentence on what the group is for.
        modules: Dotted names of its modules, in reading order.
    """

    title: str
    about: str
    modules: tuple[str, ...]


GROUPS: tuple[Group, ...] = (
    Group(
        "The GRPO core",
        "The loss as pure functions of arrays: advantages, surrogate and KL pieces, the "
        "objective, per-token log-probs, the batch and the config.",
        (
            _RL,
            f"{_RL}.core.configs",
            f"{_RL}.core.policy",
            f"{_RL}.core.batch",
            f"{_RL}.core.advantages",
            f"{_RL}.core.group_statistics",
            f"{_RL}.core.losses",
            f"{_RL}.core.variant_losses",
            f"{_RL}.core.objective",
            f"{_RL}.core.microbatching",
            f"{_RL}.core.logprobs",
            f"{_RL}.core.routing_replay",
            f"{_RL}.core.distillation",
            f"{_RL}.core.compat",
        ),
    ),
    Group(
        "The trainer",
        "One GRPO update: the pure train step on an explicit state, and the trainer that holds "
        "a model and its optimizer.",
        (
            f"{_GM}.training",
            f"{_RL}.update.trainer",
            f"{_RL}.update.trainer_state",
            f"{_RL}.update.trainer_batches",
            f"{_RL}.update.trainer_setup",
            f"{_RL}.update.microbatches",
            f"{_RL}.update.engines",
            f"{_RL}.update.compile_ahead",
            f"{_RL}.core.packing",
            f"{_RL}.update.state",
            f"{_RL}.update.train_state",
            f"{_RL}.update.gradients",
            f"{_RL}.update.ref_sync",
            f"{_RL}.core.teacher",
            f"{_RL}.update.layerwise",
            f"{_RL}.update.optimizer_split",
            f"{_RL}.update.layer_split",
            f"{_RL}.update.signals",
        ),
    ),
    Group(
        "Rollout and loop",
        "From dataset rows to batches (single- and multi-turn, with tools) and the training "
        "loop with its logging and evaluation.",
        (
            f"{_RL}.rollouts.dataset_rows",
            f"{_RL}.rollouts.rollout",
            f"{_RL}.rollouts.sampling",
            f"{_RL}.rollouts.truncation",
            f"{_RL}.run.loop",
            f"{_RL}.run.settings",
            f"{_RL}.run.data",
            f"{_RL}.run.steps",
            f"{_RL}.run.checks",
            f"{_RL}.run.evaluation",
            f"{_RL}.run.evaluation_metrics",
            f"{_RL}.run.preflight",
            f"{_RL}.rollouts.reward_scale",
            f"{_GM}.training.run_lock",
            f"{_RL}.rollouts.multiturn",
            f"{_RL}.rollouts.multiturn.rollout",
            f"{_RL}.rollouts.multiturn.episodes",
            f"{_RL}.rollouts.multiturn.environments",
            f"{_RL}.rollouts.multiturn.tools",
            f"{_GM}.training.logging",
            f"{_GM}.training.completions",
            f"{_GM}.training.trackers",
        ),
    ),
    Group(
        "Rewards",
        "The reward-function protocol, combining rewards, and the built-in verifiable rewards.",
        (
            f"{_RL}.rewards",
            f"{_RL}.rewards.base",
            f"{_RL}.rewards.combine",
            f"{_RL}.rewards.math",
            f"{_RL}.rewards.format",
            f"{_RL}.rewards.length",
            f"{_RL}.rewards.reward_model",
            f"{_RL}.rollouts.step_rewards",
        ),
    ),
    Group(
        "Models",
        "The causal language model, its building blocks, LoRA, the tokenizer and checkpoint "
        "formats (Hugging Face, GGUF).",
        (
            _LM,
            f"{_LM}.model",
            f"{_LM}.prompt_passes",
            f"{_LM}.layer_storage",
            f"{_LM}.pretrained_io",
            f"{_LM}.positions",
            f"{_LM}.config",
            f"{_LM}.config_types",
            f"{_LM}.modules",
            f"{_LM}.attention_ops",
            f"{_LM}.moe",
            f"{_LM}.moe_dispatch",
            f"{_LM}.cache",
            f"{_LM}.rope",
            f"{_LM}.lora",
            f"{_LM}.lora_experts",
            f"{_LM}.quantize",
            f"{_LM}.quantize_weights",
            f"{_LM}.peft_io",
            f"{_LM}.peft_experts",
            f"{_LM}.tokenizer",
            f"{_LM}.chat_template",
            f"{_LM}.hf_io",
            f"{_LM}.hf_format",
            f"{_LM}.gguf",
            f"{_LM}.gguf_tensors",
            f"{_LM}.gguf_config",
            f"{_LM}.gguf_vocab",
            f"{_LM}.sequence_classification",
        ),
    ),
    Group(
        "Sampler",
        "Compiled KV-cache generation: K completions per prompt, and turn-by-turn decoding; "
        "rollout engines (the sampler, vLLM) behind one interface.",
        (
            f"{_GM}.inference",
            f"{_GM}.inference.sampling",
            f"{_GM}.inference.token_sampling",
            f"{_GM}.inference.batch_layout",
            f"{_GM}.inference.continuous",
            f"{_GM}.inference.multiturn",
            f"{_GM}.inference.stop_strings",
            f"{_GM}.inference.engines",
            f"{_GM}.inference.engines.base",
            f"{_GM}.inference.engines.vllm",
        ),
    ),
    Group(
        "Sharding",
        "Meshes, partition rules and batch placement over devices and processes.",
        (
            f"{_GM}.training.sharding",
            f"{_GM}.training.sharding.mesh",
            f"{_GM}.training.sharding.rules",
            f"{_GM}.training.sharding.states",
            f"{_GM}.training.sharding.batches",
            f"{_GM}.training.sharding.processes",
            f"{_GM}.training.placement",
            f"{_GM}.training.rendezvous",
        ),
    ),
    Group(
        "Checkpoints",
        "Saving and resuming training state, verified; atomic file writes.",
        (f"{_GM}.training.checkpointing", f"{_GM}.utils.atomic", f"{_GM}.utils.fingerprint"),
    ),
    Group(
        "Flow-GRPO (images)",
        "GRPO on a flow-matching image model, one package: the model, its pretraining, SDE "
        "sampling with log-probs, image rewards, the flow objective and the training loop.",
        (
            f"{_GM}.flow",
            f"{_GM}.flow.model",
            f"{_GM}.flow.dit",
            f"{_GM}.flow.pretraining",
            f"{_GM}.flow.io",
            f"{_GM}.flow.text_dit",
            f"{_GM}.flow.text_encoder",
            f"{_GM}.flow.shapes",
            f"{_GM}.flow.detection",
            f"{_GM}.flow.rewards",
            f"{_GM}.flow.sde",
            f"{_GM}.flow.sampling",
            f"{_GM}.flow.batch",
            f"{_GM}.flow.objective",
            f"{_GM}.flow.images",
            f"{_GM}.flow.rollout",
            f"{_GM}.flow.train",
        ),
    ),
    Group(
        "Command line, demos and utilities",
        "The ``artifex-grpo`` command, the built-in demos, and helpers shared by the library.",
        (
            "artifex",
            "artifex.cli",
            "artifex.cli_train",
            "artifex.cli_rows",
            "artifex.cli_rewards",
            "artifex.cli_devices",
            "artifex.cli_checks",
            "artifex.demos",
            "artifex.demos.addition",
            "artifex.demos.tools",
            "artifex.demos.flow",
            "artifex.flow_shapes",
            "artifex.cli_flow",
            f"{_GM}.utils",
            f"{_GM}.utils.validation",
            f"{_GM}.utils.strict_parse",
            f"{_GM}.utils.tool_schema",
            f"{_GM}.utils.compile_options",
            f"{_GM}.utils.host_memory",
        ),
    ),
)
OTHER = "Other modules"


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    """What the API reference needs to know about one public module.

    Attributes:
        name: Dotted module name.
        docstring: The module docstring ("" when there is none).
        public: The names in ``__all__``, in order.
        local: The public names the module defines itself (rendered on its page).
        reexported: Public name -> dotted path of the object it imports (rendered elsewhere).
        summaries: Public name -> first line of the name's docstring, for defined names.
    """

    name: str
    docstring: str
    public: tuple[str, ...]
    local: tuple[str, ...]
    reexported: dict[str, str]
    summaries: dict[str, str]

    @property
    def page(self) -> str:
        """Path of the module's page, relative to the docs directory."""
        return f"{API_DIR}/{self.name}.md"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _dunder_all(tree: ast.Module, module: str) -> tuple[str, ...] | None:
    """The module's ``__all__``: read statically, or by importing it when it is computed."""
    values = []
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                values.append(node.value if isinstance(node, ast.Assign) else None)
    if not values:
        return None
    if len(values) == 1 and values[0] is not None:
        try:
            return tuple(ast.literal_eval(values[0]))
        except ValueError:
            pass
    return tuple(importlib.import_module(module).__all__)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _summary(docstring: str | None) -> str:
    if not docstring:
        return ""
    line = docstring.strip().splitlines()[0].strip()
    return _ROLE_RE.sub(lambda m: f"``{m.group(1).split('.')[-1]}``", line)


def _scan(path: Path, root: Path) -> tuple[str, ast.Module]:
    return _module_name(path, root), ast.parse(path.read_text(encoding="utf-8"))


def public_modules(root: Path = ROOT) -> list[ModuleInfo]:
    """Every module of the package that defines ``__all__``, sorted by name.

    Args:
        root: Directory that holds the package directory.

    Returns:
        One :class:`ModuleInfo` per public module.
    """
    trees = {}
    packages = set()
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name, tree = _scan(path, root)
        trees[name] = tree
        if path.name == "__init__.py":
            packages.add(name)

    defined: dict[str, dict[str, str]] = {}  # module -> defined name -> docstring summary
    imported: dict[str, dict[str, str]] = {}  # module -> bound name -> source "mod.name"
    for name, tree in trees.items():
        defs: dict[str, str] = {}
        imps: dict[str, str] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defs[node.name] = _summary(ast.get_docstring(node))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        defs[target.id] = ""
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defs[node.target.id] = ""
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(name, name in packages, node)
                for alias in node.names:
                    imps[alias.asname or alias.name] = f"{source}.{alias.name}"
        defined[name], imported[name] = defs, imps

    def canonical(path: str, depth: int = 0) -> str:
        module, _, attr = path.rpartition(".")
        if depth < 10 and module in trees and attr not in defined[module]:
            source = imported[module].get(attr)
            if source is not None:
                return canonical(source, depth + 1)
        return path

    modules = []
    for name, tree in sorted(trees.items()):
        public = _dunder_all(tree, name)
        if public is None:
            continue
        local = tuple(n for n in public if n in defined[name])
        reexported = {
            n: canonical(imported[name][n])
            for n in public
            if n not in local and n in imported[name]
        }
        summaries = {n: defined[name][n] for n in local}
        for n, target in reexported.items():
            module, _, attr = target.rpartition(".")
            summaries[n] = defined.get(module, {}).get(attr, "")
        modules.append(
            ModuleInfo(
                name=name,
                docstring=ast.get_docstring(tree) or "",
                public=public,
                local=local,
                reexported=reexported,
                summaries=summaries,
            )
        )
    return modules


def _cell(text: str) -> str:
    return text.replace("|", r"\|")


def module_page(info: ModuleInfo) -> str:
    """The Markdown of one module's API page.

    Args:
        info: The module.

    Returns:
        Markdown with a ``:::`` directive for the names the module defines and a table of the
        names it re-exports.
    """
    lines = [f"::: {info.name}", "    options:", "      heading_level: 1"]
    if len(info.local) != len(info.public):
        members = "[" + ", ".join(info.local) + "]" if info.local else "false"
        lines.append(f"      members: {members}")
    if info.reexported:
        lines += [
            "",
            "## Re-exported names",
            "",
            f"`{info.name}` re-exports these names; each is documented with the module that "
            "defines it.",
            "",
            "| Name | Defined in | Summary |",
            "|---|---|---|",
        ]
        for n, target in info.reexported.items():
            module = target.rpartition(".")[0]
            lines.append(
                f"| [`{n}`][{target}] | [`{module}`][{module}] | {_cell(info.summaries[n])} |"
            )
    return "\n".join(lines) + "\n"


def grouped(modules: list[ModuleInfo]) -> list[tuple[Group, list[ModuleInfo]]]:
    """The public modules by concept, in the order of :data:`GROUPS`.

    A public module that no group names lands in a last group, "Other modules", so that it
    still gets a page (``tests/test_docs.py`` asks for it to be placed in a group).

    Args:
        modules: The public modules.

    Returns:
        ``(group, modules)`` pairs; groups without a public module are left out.
    """
    by_name = {info.name: info for info in modules}
    out = [(g, [by_name[m] for m in g.modules if m in by_name]) for g in GROUPS]
    placed = {m for g in GROUPS for m in g.modules}
    other = [info for info in modules if info.name not in placed]
    if other:
        out.append((Group(OTHER, "Public modules not yet placed in a group.", ()), other))
    return [(g, infos) for g, infos in out if infos]


def index_page(modules: list[ModuleInfo]) -> str:
    """The Markdown of the API reference's overview page.

    Args:
        modules: The public modules.

    Returns:
        Markdown listing the groups and, in each, every module with the first line of its
        docstring.
    """
    groups = grouped(modules)
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings: one page for every module that declares `__all__`, "
        "grouped by concept. Packages re-export the names of their modules; the entry point is "
        "`from artifex.generative_models.training import GRPOConfig, GRPOTrainer`.",
        "",
    ]
    lines += [f"- [{g.title}](#{_anchor(g.title)}): {g.about}" for g, _ in groups]
    for group, infos in groups:
        lines += ["", f"## {group.title}", "", group.about, "", "| Module | Summary |", "|---|---|"]
        for info in infos:
            summary = _cell(_summary(info.docstring))
            lines.append(f"| [`{info.name}`]({info.name}.md) | {summary} |")
    return "\n".join(lines) + "\n"


def _anchor(title: str) -> str:
    """The anchor the ``toc`` extension gives a heading (its default slugify)."""
    slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
    return re.sub(r"[-\s]+", "-", slug)


def api_pages(root: Path = ROOT) -> dict[str, str]:
    """All generated pages.

    Args:
        root: Directory that holds the package directory.

    Returns:
        Page path (relative to the docs directory) -> Markdown.
    """
    modules = public_modules(root)
    pages = {f"{API_DIR}/index.md": index_page(modules)}
    pages.update({info.page: module_page(info) for info in modules})
    return pages


def _nav_title(name: str) -> str:
    return name.removeprefix("artifex.generative_models.") if name.count(".") > 1 else name


# ---------------------------------------------------------------------------- MkDocs events
def on_config(config: Any) -> Any:
    """Appends the generated pages to the navigation under "API reference", by concept.

    Args:
        config: The MkDocs config.

    Returns:
        The config.
    """
    entries: list[Any] = [{"Overview": f"{API_DIR}/index.md"}]
    entries += [
        {group.title: [{_nav_title(m.name): m.page} for m in infos]}
        for group, infos in grouped(public_modules())
    ]
    nav = config["nav"]
    if nav is not None:
        nav[:] = [item for item in nav if "API reference" not in item]
        nav.append({"API reference": entries})
    return config


def on_files(files: Any, config: Any) -> Any:
    """Adds the generated pages to the build.

    Args:
        files: The documentation files.
        config: The MkDocs config.

    Returns:
        The files, with one page per public module and an overview.
    """
    from mkdocs.structure.files import File

    for path, text in api_pages().items():
        files.append(File.generated(config, path, content=text))
    return files
