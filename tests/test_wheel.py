"""The wheel installs whole: built from the sources, installed into a fresh venv, it lists and
runs its shipped recipes from a directory far from the clone, importing nothing from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# What an installed mta needs that is not a Python module of a hand-kept package list.
EXPECTED_IN_WHEEL = [
    "mta/__init__.py",
    "mta/demo/pipeline.py",
    "mta/generation/generator.py",
    "mta_cli/main.py",
    "mta_cli/commands/recipes.py",
    "mta/recipes/tiny.yaml",
    "mta/recipes/gpt2.yaml",
    "mta/recipes/smollm2-demo.yaml",
    "mta/recipes/configs/gpt2.json",
    "mta/recipes/configs/smollm2-135m-instruct.json",
    "mta/recipes/examples/tiny.jsonl",
]


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A wheel built from a copy of the sources (the clone gets no build/ or egg-info) and
    installed into a fresh venv whose other packages come from this environment."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("src", "cli", "recipes"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(root / "dist"), str(source)]
    )
    (wheel,) = (root / "dist").glob("mta_distill-*.whl")

    venv = root / "venv"
    python, site = _fresh_venv(venv)
    # This environment's pip installs into the fresh venv before it can see anything else.
    _run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)])
    # torch, transformers, ... from this environment, *after* the venv's own site-packages. A path
    # line's .pth files are not run, so the editable install's finder (-> the clone) stays off.
    (site / "zz_dev_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = root / "work"
    work.mkdir()
    return {"wheel": wheel, "venv": venv, "site": site, "work": work, "source": source, "pip": pip}


def _fresh_venv(venv: Path) -> tuple[Path, Path]:
    """A fresh venv without pip: its interpreter and its site-packages directory."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=_clean_env()
        ).stdout.strip()
    )
    return python, site


def _clean_env() -> dict:
    return subprocess_env(drop=("PYTHONPATH", "PYTHONHOME"), COLUMNS="200")


def test_the_wheel_holds_every_package_and_the_package_data(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    missing = [name for name in EXPECTED_IN_WHEEL if name not in names]
    assert not missing, missing
    # The top-level recipes/ (the one copy in git) lands in the wheel as mta/recipes/.
    shipped = {
        "mta/" + p.relative_to(REPO).as_posix()
        for p in (REPO / "recipes").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert shipped <= names, sorted(shipped - names)
    # Every module of the source tree made it (no package forgotten by a hand-kept list).
    modules = {p.relative_to(REPO / "src").as_posix() for p in (REPO / "src" / "mta").rglob("*.py")}
    modules |= {p.relative_to(REPO / "cli").as_posix() for p in (REPO / "cli" / "mta_cli").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert not [name for name in names if "__pycache__" in name or name.startswith(("tests/", "bench/"))]


def test_the_installed_mta_is_the_wheel_not_the_clone(installed):
    python = installed["venv"] / "bin" / "python"
    code = "import mta, mta_cli, torch; print(mta.__file__, mta_cli.__file__, torch.__file__)"
    result = _run([str(python), "-c", code], cwd=installed["work"], env=_clean_env())
    mta_file, cli_file, torch_file = map(Path, result.stdout.split())
    assert mta_file.is_relative_to(installed["site"]), mta_file
    assert cli_file.is_relative_to(installed["site"]), cli_file
    assert not mta_file.resolve().is_relative_to(REPO) and not cli_file.resolve().is_relative_to(REPO)
    assert not torch_file.is_relative_to(installed["venv"])  # the rest comes from this environment


def test_recipes_list_and_a_dry_run_of_the_shipped_tiny_recipe_work_from_anywhere(installed):
    mta = str(installed["venv"] / "bin" / "mta")
    shipped = installed["site"] / "mta" / "recipes"
    listed = _run([mta, "recipes", "list"], cwd=installed["work"], env=_clean_env())
    for name in ("tiny", "gpt2", "qwen", "opt", "cross-tokenizer", "smollm2-demo"):
        assert name in listed.stdout
    result = _run([mta, "distill", "--recipe", "tiny", "--dry-run"], cwd=installed["work"], env=_clean_env())
    assert f"recipe: shipped tiny ({shipped / 'tiny.yaml'})" in result.stderr
    assert "LlamaForCausalLM" in result.stdout  # the plan is a result: stdout (issue 25)
    assert not (shipped / "runs").exists()  # outputs go to the working directory, never in there
    demo = _run(
        [
            str(installed["venv"] / "bin" / "python"),
            "-c",
            "from mta.demo.pipeline import DEMO_RECIPE; print(DEMO_RECIPE.resolve())",
        ],
        cwd=installed["work"],
        env=_clean_env(),
    )
    assert Path(demo.stdout.strip()) == (shipped / "smollm2-demo.yaml").resolve()


def test_an_editable_install_reads_the_recipes_from_the_source_tree(installed, tmp_path):
    """`make install` uses `pip install -e .`: the shipped recipes must come from the sources."""
    python, site = _fresh_venv(tmp_path / "venv")
    # setuptools (no build isolation) comes from this environment; --ignore-installed: the mta
    # this environment has installed is seen but never uninstalled.
    (site / "zz_dev_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [
            *installed["pip"],
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--no-build-isolation",
            "--ignore-installed",
            "-e",
            str(installed["source"]),
        ],
        cwd=tmp_path,
        env=_clean_env(),
    )
    code = (
        "from mta.training.config.catalog import SHIPPED_DIR as d; "
        "print(d); print(sorted(p.name for p in d.glob('*.yaml')))"
    )
    result = _run([str(python), "-c", code], cwd=installed["work"], env=_clean_env())
    shipped, names = result.stdout.splitlines()
    assert Path(shipped) == installed["source"] / "recipes"
    assert "'tiny.yaml'" in names
