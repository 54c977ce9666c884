"""The direction of imports ARCHITECTURE.md promises, checked on the code itself.

- no import climbs the layers ARCHITECTURE.md declares (lazy, ``TYPE_CHECKING`` and by-name
  ones included), and the names of one layer never import each other;
- no import cycle between modules, no private name used across modules;
- no function longer than 100 lines (a Typer command counted without its option declarations);
- training and evaluation never import each other; both sample through ``mta.generation``
  and score through ``mta.scoring``;
- ``mta.losses`` is pure tensor code: it imports nothing else from mta but ``mta.errors``;
- nothing under ``src/mta`` imports rich or typer: presentation lives in ``cli/``.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mta"


def _modules(package: str) -> list[str]:
    root = SRC / package
    return sorted(
        "mta." + ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for path in root.rglob("*.py")
    )


def _imported(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute imports, at any depth in the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _loaded_after_importing(modules: list[str]) -> set[str]:
    """``sys.modules`` of a fresh interpreter after importing ``modules`` (nothing else runs)."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(result.stdout.split())


@pytest.mark.parametrize(("package", "forbidden"), [("training", "evaluation"), ("evaluation", "training")])
def test_training_and_evaluation_never_import_each_other(package, forbidden):
    loaded = _loaded_after_importing(_modules(package))
    leaked = sorted(name for name in loaded if name.startswith(f"mta.{forbidden}"))
    assert not leaked, f"importing mta.{package} loads {leaked}"
    assert "mta.generation" in loaded and "mta.scoring" in loaded


@pytest.mark.parametrize("package", ["training", "evaluation"])
def test_both_stages_use_the_one_generation_engine_and_scoring_module(package):
    imported = set().union(*(_imported(path) for path in (SRC / package).rglob("*.py")))
    assert any(name.startswith("mta.generation") for name in imported)
    assert any(name.startswith("mta.scoring") for name in imported)


def test_losses_import_nothing_else_from_mta():
    for path in (SRC / "losses").rglob("*.py"):
        foreign = {
            name
            for name in _imported(path)
            if name.startswith("mta.") and not name.startswith(("mta.losses", "mta.errors"))
        }
        assert not foreign, f"{path.name} imports {sorted(foreign)}"


def test_no_library_module_imports_presentation_libraries():
    for path in SRC.rglob("*.py"):
        presentation = {name for name in _imported(path) if name.split(".")[0] in ("rich", "typer")}
        assert not presentation, f"{path.relative_to(SRC)} imports {sorted(presentation)}"


# --- the module graph: no cycles, no private names across modules ----------------------------

ROOTS = {"mta": SRC, "mta_cli": SRC.parents[1] / "cli" / "mta_cli"}
TESTS = Path(__file__).resolve().parent


def _module_files() -> dict[str, Path]:
    """Every module of ``mta`` and ``mta_cli`` by dotted name (a package by its ``__init__``)."""
    modules = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = (package, *path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _module_files()


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """The syntax tree of ``path``, parsed once per session (several checks walk every module)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _outside_type_checking(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` that run: everything but the bodies of ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped.update(id(sub) for child in node.body for sub in ast.walk(child))
    return [node for node in ast.walk(tree) if id(node) not in skipped]


def _owner(name: str) -> str | None:
    """The module of ours that a dotted name lives in (``mta.x.f`` -> ``mta.x``), if any."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str | None, path: Path, *, type_checking: bool = False) -> tuple[set[str], list[str]]:
    """The modules of ours that ``path`` imports (at any depth, lazy imports included; with
    ``type_checking``, those of ``if TYPE_CHECKING:`` blocks too) and the private names it takes
    from other modules (``from m import _x``, ``m._x``)."""
    is_package = path.name == "__init__.py"
    imported, private, aliases = set(), [], {}
    tree = _parsed(path)
    for node in list(ast.walk(tree)) if type_checking else _outside_type_checking(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _owner(alias.name)) is not None:
                    imported.add(target)
                    aliases[alias.asname or alias.name] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = (module or "").split(".")[: None if is_package else -1]
                source = ".".join(base[: len(base) - node.level + 1] + ([source] if source else []))
            if source.split(".")[0] not in ROOTS:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append(f"from {source} import {alias.name}")
                if (target := _owner(full)) is not None:
                    imported.add(target)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and aliases.get(node.value.id) in MODULES
        ):
            private.append(f"{aliases[node.value.id]}.{node.attr}")
    imported.discard(module)
    return imported, private


MODULE_REFERENCE = re.compile(r"^(?:mta|mta_cli)(?:\.\w+)+(?::\w+)?$")


def _named_modules(path: Path) -> set[str]:
    """The modules of ours ``path`` names for a deferred import: a ``"module:attribute"`` string
    (a registry's entry), or a module's dotted name as a dict value (a lazy export's) or given to
    ``import_module`` / ``__import__``. Docstrings and messages do not count."""
    tree = _parsed(path)
    candidates: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            candidates += node.values
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module",
            "__import__",
        ):
            candidates += node.args[:1]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            candidates.append(node)
    named = set()
    for node in candidates:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_REFERENCE.match(node.value):
            if (target := node.value.partition(":")[0]) in MODULES:
                named.add(target)
    return named


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    """Lazy imports inside functions count (they only postpone the cycle); ``TYPE_CHECKING``
    blocks do not (they never run)."""
    graph = {module: _imports(module, path)[0] for module, path in MODULES.items()}
    assert not _cycles(graph), _cycles(graph)


def test_no_private_name_is_used_from_another_module():
    """A function another module needs is public and lives where both reach it. Tests are held
    to the same rule: they exercise the public surface (or the function is made public)."""
    used = {str(path.relative_to(SRC.parents[1])): _imports(module, path)[1] for module, path in MODULES.items()}
    used |= {str(path.relative_to(SRC.parents[1])): _imports(None, path)[1] for path in TESTS.rglob("*.py")}
    assert not {where: names for where, names in used.items() if names}


def test_the_private_name_finder_sees_both_forms(tmp_path):
    path = tmp_path / "user.py"
    path.write_text("from mta.files import _x\nimport mta.hashing as h\nh._y()\nfrom mta import files\nfiles._z\n")
    assert sorted(_imports(None, path)[1]) == ["from mta.files import _x", "mta.files._z", "mta.hashing._y"]


# --- the layers ARCHITECTURE.md declares: no import climbs them ---------------------------------

LAYER_LINE = re.compile(r"^(?P<layer>\d+) +(?P<names>[\w.]+(?:, [\w.]+)*)(?: {2,}.*)?$")


def _layers(text: str) -> dict[str, int]:
    """The ```layers block of ARCHITECTURE.md's "Direction of imports": ``{name: layer}``, 1 on top."""
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    layers: dict[str, int] = {}
    for line in filter(str.strip, block.splitlines()):
        entry = LAYER_LINE.match(line)
        assert entry, f"ARCHITECTURE.md's layers: cannot read {line!r} (LAYER, NAME, NAME  what they hold)"
        for name in entry["names"].split(", "):
            assert name not in layers, f"ARCHITECTURE.md's layers: {name} is listed twice"
            layers[name] = int(entry["layer"])
    return layers


def _unit(module: str, layers: dict[str, int]) -> str | None:
    """The longest name of ``layers`` that ``module`` falls under (``mta`` stands for the package's
    ``__init__`` only, so a new top-level package must be placed)."""
    found = [name for name in layers if module == name or (name != "mta" and module.startswith(name + "."))]
    return max(found, key=len) if found else None


def _climbing(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """The imports of ``graph`` (module -> the modules it imports) that go up ``layers`` or across
    one layer, in words."""
    found = []
    for module, targets in sorted(graph.items()):
        unit = _unit(module, layers)
        for target in sorted(targets):
            other = _unit(target, layers)
            if unit is None or other is None or other == unit:
                continue
            if layers[other] < layers[unit]:
                found.append(f"{module} -> {target}: {other} (layer {layers[other]}) is above {unit} ({layers[unit]})")
            elif layers[other] == layers[unit]:
                found.append(f"{module} -> {target}: {unit} and {other} share layer {layers[unit]}")
    return found


LAYERS = _layers((SRC.parents[1] / "ARCHITECTURE.md").read_text(encoding="utf-8"))


def test_every_module_has_a_layer_and_every_layered_name_exists():
    unplaced = sorted(module for module in MODULES if _unit(module, LAYERS) is None)
    assert not unplaced, f"not in ARCHITECTURE.md's layers (add the package to a layer): {unplaced}"
    absent = sorted(name for name in LAYERS if name not in MODULES)
    assert not absent, f"ARCHITECTURE.md's layers name what does not exist: {absent}"


def _layer_graph(module: str, path: Path) -> set[str]:
    """What ``module`` imports, for the layers: at the top, lazily inside a function, under
    ``TYPE_CHECKING``, and by name for a deferred import (``"mta.x.y:name"``, ``import_module``)."""
    return (_imports(module, path, type_checking=True)[0] | _named_modules(path)) - {module}


def test_no_import_climbs_the_layers():
    graph = {module: _layer_graph(module, path) for module, path in MODULES.items()}
    climbing = _climbing(graph, LAYERS)
    assert not climbing, "imports against ARCHITECTURE.md's layers (move the code down):\n" + "\n".join(climbing)


def test_the_layer_check_refuses_a_planted_upward_import_lazy_or_for_types_only(tmp_path):
    text = "## Direction of imports\n```layers\n1   top, side  what\n2   low.er\n3   base\n```\n"
    assert _layers(text) == {"top": 1, "side": 1, "low.er": 2, "base": 3}
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\nfrom mta.errors import MtaError\n"
        "if TYPE_CHECKING:\n    from mta.evaluation.results import Results\n"
        "def f():\n    from mta.data.artefact_schema import SCHEMA\n    from mta.store import layout\n"
        'REGISTRY = {"x": "mta.training.trainer:Trainer", "y": "mta.store.layout"}\n'
        'def g():\n    """See mta.demo.pipeline."""\n    raise MtaError("mta.demo.pipeline")\n',
        encoding="utf-8",
    )
    graph = {"mta.store.planted": _layer_graph("mta.store.planted", planted)}
    assert _climbing(graph, LAYERS) == [
        "mta.store.planted -> mta.data.artefact_schema: mta.data (layer 11) is above mta.store (12)",
        "mta.store.planted -> mta.evaluation.results: mta.evaluation (layer 10) is above mta.store (12)",
        "mta.store.planted -> mta.training.trainer: mta.training (layer 10) is above mta.store (12)",
    ]
    sideways = {"mta.training.x": {"mta.evaluation.results", "mta.losses.kd", "mta.training.y"}}
    assert _climbing(sideways, LAYERS) == [
        "mta.training.x -> mta.evaluation.results: mta.training and mta.evaluation share layer 10"
    ]
    assert _unit("mta.newpackage.x", LAYERS) is None and _unit("mta", LAYERS) == "mta"


# --- no function longer than a screenful or two --------------------------------------------------

MAX_FUNCTION_LINES = 100


def _declared_with_typer(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    defaults = [*function.args.defaults, *(d for d in function.args.kw_defaults if d is not None)]
    return any(
        isinstance(d, ast.Call)
        and isinstance(d.func, ast.Attribute)
        and d.func.attr in ("Option", "Argument")
        and getattr(d.func.value, "id", None) == "typer"
        for d in defaults
    )


def _function_lengths(tree: ast.AST) -> dict[str, int]:
    """``{qualified name: lines}`` of every function in ``tree``, methods and nested functions
    included: from ``def`` to its last line; a Typer command (parameters declared with
    ``typer.Option`` / ``typer.Argument``) from its body's first line, without the declarations."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                start = child.body[0].lineno if _declared_with_typer(child) else child.lineno
                lengths[prefix + child.name] = child.end_lineno - start + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return lengths


def test_no_function_is_longer_than_100_lines():
    too_long = {
        f"{path.relative_to(REPO)}:{name}": lines
        for path in MODULES.values()
        for name, lines in _function_lengths(_parsed(path)).items()
        if lines > MAX_FUNCTION_LINES
    }
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them into helpers): {too_long}"


def test_the_length_rule_sees_a_long_function_and_counts_a_command_without_its_options():
    body = "".join(f"    x{i} = {i}\n" for i in range(100))
    options = "".join(f"    o{i}: int = typer.Option({i}, help='option {i}'),\n" for i in range(60))
    source = (
        f"import typer\ndef long():\n{body}class C:\n    def method(self):\n        def inner():\n"
        f"            return 1\n        return inner\ndef command(\n{options}) -> None:\n"
        '    """Help."""\n    return None\n'
    )
    lengths = _function_lengths(ast.parse(source))
    assert lengths == {"long": 101, "C.method": 4, "C.method.inner": 2, "command": 2}
    assert {name for name, lines in lengths.items() if lines > MAX_FUNCTION_LINES} == {"long"}


# --- ARCHITECTURE.md's module map is the tree --------------------------------------------------

REPO = SRC.parents[1]
ENTRY = re.compile(r"^(?P<indent>(?:  )*)(?P<name>[\w.]+(?:/[\w.]+)*/|\w+\.py)(?:  |$)")


def _module_map(text: str) -> set[str]:
    """The files ARCHITECTURE.md's module map lists, as paths from the repository root: each
    entry is ``name.py`` or ``folder/`` at two spaces per level inside the map's code block."""
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    listed, folders = set(), []
    for line in block.splitlines():
        if not (entry := ENTRY.match(line)):
            continue
        depth, name = len(entry["indent"]) // 2, entry["name"]
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            listed.add("/".join(folders) + "/__init__.py")
        else:
            listed.add("/".join([*folders, name]))
    return listed


def test_the_module_map_parser_reads_nested_folders():
    text = "## Module map\n```\nsrc/mta/\n  a.py  one\n  sub/  two\n    b.py  three\n  c.py  four\n```\n"
    assert _module_map(text) == {
        "src/mta/__init__.py",
        "src/mta/a.py",
        "src/mta/sub/__init__.py",
        "src/mta/sub/b.py",
        "src/mta/c.py",
    }


def test_every_module_is_in_the_architecture_module_map_and_every_listed_module_exists():
    listed = _module_map((REPO / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    present = {str(path.relative_to(REPO)) for path in MODULES.values()}
    assert not sorted(present - listed), f"missing from ARCHITECTURE.md's module map: {sorted(present - listed)}"
    assert not sorted(listed - present), f"listed in ARCHITECTURE.md but absent: {sorted(listed - present)}"


# --- tests: no test module imports another --------------------------------------------------


def _test_modules_imported(source: str) -> set[str]:
    """The test modules (``test_*``, bare or as ``tests.test_*``) ``source`` imports, at any
    depth: import statements, ``from . import``/``from tests import test_x``, and
    ``importlib.import_module("...")`` or ``__import__("...")`` of a literal name."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                names.add(node.module)
            if node.level or node.module in (None, "tests"):
                names.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (getattr(node.func, "id", None) == "__import__" or getattr(node.func, "attr", None) == "import_module")
        ):
            names.add(node.args[0].value)
    return {name for name in names if name.removeprefix("tests.").split(".")[0].startswith("test_")}


def test_the_test_import_finder_sees_every_form():
    source = (
        "import test_a\nimport tests.test_b as b\nfrom test_c import x\nfrom tests.test_d import y\n"
        "from tests import test_e\nfrom . import test_f\nimport importlib\nimportlib.import_module('test_g')\n"
        "def f():\n    from test_h import z\n"
        "import conftest\nfrom fixtures.distill import LENGTHS\nfrom mta.testing import test_like\n"
    )
    found = _test_modules_imported(source)
    assert found == {"test_a", "tests.test_b", "test_c", "tests.test_d", "test_e", "test_f", "test_g", "test_h"}


def test_no_test_module_imports_another_test_module():
    """Shared fixtures live in tests/conftest.py and shared helpers in tests/fixtures/: importing
    a test module re-registers its fixtures (a second, module-scoped copy) and redefines names."""
    offenders = {
        str(path.relative_to(TESTS)): sorted(found)
        for path in sorted(TESTS.rglob("*.py"))
        if "data" not in path.relative_to(TESTS).parts[:-1]
        and (found := _test_modules_imported(path.read_text(encoding="utf-8")))
    }
    assert not offenders, f"test modules importing test modules (move what they share): {offenders}"
