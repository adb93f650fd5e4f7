"""The docs build cannot drop its warnings, its toolchain is pinned, and griffe sees the fields.

- ``.ci/run`` builds the docs with ``mkdocs build --strict`` and never ``-q``/``--quiet``
  (MkDocs' quiet mode raises its log level to ERROR, so warnings are not counted and the strict
  build passes whatever they say), does not swallow the build's exit status, and opens the
  built site in a browser afterwards (``docs/_hooks/browser_check.py``).
- The ``dev`` extra bounds the documentation toolchain on both sides, the installed versions
  lie within the bounds, and ``docs/installation.md`` lists the same bounds.
- griffe, loaded with the project's extension as mkdocstrings loads it, gives every dataclass
  an ``__init__`` with its fields (their types and defaults are what the reference shows).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import re
import shlex
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci" / "run"

# The documentation toolchain: each needs a lower and an upper bound in the dev extra.
DOCS_TOOLCHAIN = (
    "mkdocs",
    "mkdocs-material",
    "mkdocstrings",
    "mkdocstrings-python",
    "griffelib",
    "mkdocs-autorefs",
    "pymdown-extensions",
    "mkdocs-jupyter",
    "nbconvert",
    "jupyter-server-mathjax",
)


# --------------------------------------------------------------------------- CI's docs build
def shell_commands(script: str) -> list[str]:
    """The script's commands, one per entry: comments dropped, continued lines joined."""
    text = re.sub(r"\\\n", " ", script)
    commands = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def _words(command: str) -> list[str]:
    """Shell words of a command, with ``||``, ``;``, ``>`` and the like as words of their own."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: good enough for finding `mkdocs build`
        return command.split()


def mkdocs_build_problems(script: str) -> list[str]:
    """Why the docs builds of a CI script could pass with warnings (empty: they cannot).

    Args:
        script: The text of a shell script.

    Returns:
        One message per problem: no ``mkdocs build`` at all, one without ``--strict``, one
        with ``-q``/``--quiet``, one whose failure is ignored (``|| true``), or whose exit
        status is kept in a variable that the script never exits with.
    """
    builds = []
    for command in shell_commands(script):
        words = _words(command)
        head = words[: words.index("||")] if "||" in words else words
        tail = " ".join(words[len(head) + 1 :])
        starts = [i for i, w in enumerate(head[:-1]) if w == "mkdocs" and head[i + 1] == "build"]
        if starts:  # a command that runs `mkdocs build` (not an echo that names it)
            builds.append((command, head[starts[0] :], tail))
    if not builds:
        return ["no `mkdocs build` command"]
    problems = []
    for command, words, tail in builds:
        if "--strict" not in words:
            problems.append(f"not --strict: {command}")
        if {"-q", "--quiet"} & set(words) or any(re.fullmatch(r"-[a-z]*q[a-z]*", w) for w in words):
            problems.append(f"-q/--quiet drops the warnings: {command}")
        if tail in ("true", ":") or tail.startswith(("true ", ": ", "true;", "echo")):
            problems.append(f"failure ignored: {command}")
        saved = re.fullmatch(r"(\w+)=\$\?", tail)
        if saved and not re.search(rf'exit\s+"?\${saved.group(1)}"?', script):
            problems.append(f"exit status kept in {saved.group(1)} but never exited with")
    return problems


def test_ci_builds_the_docs_strictly_without_dropping_warnings():
    script = CI.read_text(encoding="utf-8")
    assert mkdocs_build_problems(script) == []
    # The site configuration is strict too, so a plain `mkdocs build` fails on warnings.
    config = yaml.load(
        (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader
    )  # BaseLoader: the file has !ENV and !!python/name tags
    assert config["strict"] == "true"


def test_ci_checks_the_built_site_in_a_browser_after_building_it():
    commands = shell_commands(CI.read_text(encoding="utf-8"))
    build = next(i for i, c in enumerate(commands) if "mkdocs build" in c)
    check = [i for i, c in enumerate(commands) if "docs/_hooks/browser_check.py" in c]
    assert check and check[0] > build, "browser_check.py does not run after the docs build"
    assert any("apt-get install" in c and "chromium" in c for c in commands)


def test_the_site_tests_build_without_quiet():
    from tests import test_site

    assert "--strict" in test_site.BUILD_CMD
    assert not {"-q", "--quiet"} & set(test_site.BUILD_CMD)


@pytest.mark.parametrize(
    ("script", "problem"),
    [
        ("mkdocs build --strict -d site\n", None),
        ('rc=0\nmkdocs build --strict -d "$D" >log 2>&1 || rc=$?\nexit "$rc"\n', None),
        ("echo hi\n", "no `mkdocs build`"),
        ("mkdocs build -d site\n", "not --strict"),
        ("mkdocs build --strict -q -d site\n", "-q/--quiet"),
        ("mkdocs build -sq\n", "-q/--quiet"),
        ("mkdocs build \\\n  --strict --quiet\n", "-q/--quiet"),
        ("python -m mkdocs build --strict || true\n", "failure ignored"),
        ("mkdocs build --strict || rc=$?\necho done\n", "never exited with"),
        ("# mkdocs build -q\nmkdocs build --strict\n", None),
    ],
)
def test_build_command_check_catches_offenders(script, problem):
    problems = mkdocs_build_problems(script)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


# --------------------------------------------------------------------------- toolchain bounds
def dev_requirements() -> dict[str, str]:
    """Name -> specifier of each requirement of the dev extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out = {}
    for requirement in project["optional-dependencies"]["dev"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)", requirement)
        out[match.group(1).lower()] = match.group(3).replace(" ", "")
    return out


def _bounds(specifier: str) -> tuple[str | None, str | None]:
    lower = re.search(r">=([\w.]+)", specifier)
    upper = re.search(r"<([\w.]+)", specifier)
    return (lower and lower.group(1)), (upper and upper.group(1))


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


@pytest.mark.parametrize("package", DOCS_TOOLCHAIN)
def test_docs_toolchain_is_bounded_and_installed_within_the_bounds(package):
    specifier = dev_requirements().get(package)
    assert specifier is not None, f"{package} is not in the dev extra"
    lower, upper = _bounds(specifier)
    assert lower and upper, f"{package}{specifier}: needs a lower and an upper bound"
    installed = version(package)
    assert _key(lower) <= _key(installed) < _key(upper), f"{package} {installed} vs {specifier}"


def test_installation_page_lists_the_docs_toolchain_bounds():
    page = (ROOT / "docs" / "installation.md").read_text(encoding="utf-8")
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith(">="):
            rows[cells[0].split()[0]] = cells[1].replace(" ", "")
    for package, specifier in dev_requirements().items():
        if package in DOCS_TOOLCHAIN:
            assert rows.get(package) == specifier, f"docs/installation.md: {package}"


# --------------------------------------------------------------------------- griffe
@pytest.fixture(scope="module")
def griffe_package():
    griffe = pytest.importorskip("griffe")
    extensions = griffe.load_extensions(f"{ROOT}/docs/_hooks/griffe_rst.py:RestToMarkdown")
    return griffe.load("artifex", search_paths=[str(ROOT)], extensions=extensions)


def _runtime_dataclasses() -> dict[str, type]:
    import artifex

    names = ["artifex"] + [m.name for m in pkgutil.walk_packages(artifex.__path__, "artifex.")]
    found = {}
    for name in names:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and obj.__module__ == name
                and dataclasses.is_dataclass(obj)
                and "<" not in obj.__qualname__
            ):
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def test_griffe_gives_every_dataclass_its_fields(griffe_package):
    """Deleting the fields first left ``GRPOConfig.__init__`` with ``self`` only."""
    classes = _runtime_dataclasses()
    assert "artifex.generative_models.training.rl.core.configs.GRPOConfig" in classes
    assert "artifex.generative_models.models.causal_lm.cache.KVCache" in classes  # flax struct
    bad = []
    for path, cls in classes.items():
        expected = list(inspect.signature(cls).parameters)
        init = griffe_package[path.removeprefix("artifex.")].all_members.get("__init__")
        got = [p.name for p in init.parameters][1:] if init is not None else []
        if got != expected:
            bad.append(f"{path}: griffe {got}, Python {expected}")
    assert not bad, "\n".join(bad)


def test_griffe_hides_undocumented_fields_without_deleting_them(griffe_package):
    config = griffe_package["generative_models.training.rl.core.configs.GRPOConfig"]
    clip = config.members["clip_param"]  # still there: the __init__ and the table need it
    assert clip.annotation is not None and str(clip.value) == "0.2"
    assert not clip.is_public  # the Attributes table documents it, not a member entry
    init = config.members["__init__"]
    assert init.parameters["beta"].default == "0.01"
    assert str(init.parameters["kl_estimator"].default) == "'k3'"


def _griffe_rst():
    spec = importlib.util.spec_from_file_location(
        "_griffe_rst", ROOT / "docs" / "_hooks" / "griffe_rst.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ADMONITION = """Parses a call.

Example:
    >>> calls = parse("x")
    >>> calls[0][:2]
    ('a', 'b')

Returns:
    The calls."""

_FENCED_ADMONITION = """Parses a call.

Example:
    ```pycon
    >>> calls = parse("x")
    >>> calls[0][:2]
    ('a', 'b')
    ```

Returns:
    The calls."""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # An Example: admonition's doctest becomes a code block (not blockquotes with a
        # [0][:2] reference link), without a blank line under the title.
        (_ADMONITION, _FENCED_ADMONITION),
        # In a paragraph: a blank line before the fence; output runs to a blank line or a dedent.
        ("Text.\n>>> f(1)\n2\n\nMore.", "Text.\n\n```pycon\n>>> f(1)\n2\n```\n\nMore."),
        ("- item\n  >>> f(1)\n- next", "- item\n  ```pycon\n  >>> f(1)\n  ```\n\n- next"),
        # Left alone: an Examples section, a fenced block, an indented code block.
        ("Examples:\n    >>> f(1)\n    2", None),
        ("Text:\n\n```python\n>>> f(1)\n```", None),
        ("Text:\n\n    >>> f(1)\n    2\n\nMore.", None),
    ],
)
def test_doctest_blocks(text, expected):
    assert _griffe_rst().doctest_blocks(text) == (text if expected is None else expected)


def test_fenced_admonition_parses_as_an_admonition_with_code(griffe_package):
    import griffe

    function = griffe.Function("parse", parent=griffe_package)
    docstring = griffe.Docstring(_griffe_rst().doctest_blocks(_ADMONITION), parent=function)
    sections = docstring.parse("google")
    kinds = [section.kind.value for section in sections]
    assert kinds == ["text", "admonition", "returns"], kinds
    assert sections[1].value.contents.startswith("```pycon\n>>> calls")


def test_math_blocks_in_a_list_item_sit_where_markdown_reads_them():
    text = "- ``a``: text,\n\n  .. math::\n\n      x = 1\n\n  so on.\n\n.. math::\n\n    y = 2\n"
    expected = "- ``a``: text,\n\n    $$\n    x = 1\n    $$\n\n  so on.\n\n$$\ny = 2\n$$\n"
    assert _griffe_rst().math_blocks(text) == expected
