"""The direction of imports ARCHITECTURE.md promises, checked on the code itself.

- training and evaluation never import each other; both sample through ``mta.generation``
  and score through ``mta.scoring``;
- ``mta.losses`` is pure tensor code: it imports nothing else from mta but ``mta.errors``;
- nothing under ``src/mta`` imports rich or typer: presentation lives in ``cli/``.
"""

from __future__ import annotations

import ast
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
            name for name in _imported(path)
            if name.startswith("mta.") and not name.startswith(("mta.losses", "mta.errors"))
        }
        assert not foreign, f"{path.name} imports {sorted(foreign)}"


def test_no_library_module_imports_presentation_libraries():
    for path in SRC.rglob("*.py"):
        presentation = {name for name in _imported(path) if name.split(".")[0] in ("rich", "typer")}
        assert not presentation, f"{path.relative_to(SRC)} imports {sorted(presentation)}"
