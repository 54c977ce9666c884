"""The distribution a user installs: a wheel and an sdist built without network (``python -m build
--no-isolation``) pass ``twine check``, and the wheel installed with ``--no-deps`` into a fresh venv
over the tested environment's packages gives a working ``mta``: ``mta --version``, ``mta recipes
list`` and ``import mta`` from the venv, not from this checkout.

The fresh venv sees the tested environment through a ``.pth`` of plain paths, so the environment's
own ``.pth`` files (an editable install of this checkout among them) are not run there: ``mta``
can only come from the wheel. About 3 s (not marked slow).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from mta.versions import DISTRIBUTION, MTA_VERSION

pytest.importorskip("build", reason="building the wheel needs `build` (the dev extra: make install)")
pytest.importorskip("twine", reason="checking the metadata needs `twine` (the dev extra: make install)")

ROOT = Path(__file__).resolve().parents[1]


def _source_copy(target: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored), so a build writes
    its egg-info and build/ into a scratch copy, never into the checkout."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (entry.decode() for entry in listed)):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def _clean_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _outer_env() -> dict[str, str]:
    """build and twine run where this test finds them (the tested environment)."""
    return {**_clean_env(), "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}


def _fresh_venv(directory: Path) -> Path:
    """A venv whose site-packages come first, then the tested environment's (plain paths)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    python = directory / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    paths = sysconfig.get_paths()
    tested = dict.fromkeys([*site.getsitepackages(), paths["purelib"], paths["platlib"]])
    Path(own, "tested-environment.pth").write_text("".join(f"{path}\n" for path in tested if Path(path).is_dir()))
    return python


def test_wheel_and_sdist_build_check_and_install(tmp_path):
    source = _source_copy(tmp_path / "source")
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        check=True,
        capture_output=True,
        env=_outer_env(),
    )
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    normalised = DISTRIBUTION.replace("-", "_")
    assert wheels[0].name.startswith(f"{normalised}-{MTA_VERSION}-"), wheels[0].name
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(f"{normalised}-{MTA_VERSION}.dist-info/METADATA").decode()
    assert f"Name: {DISTRIBUTION}\n" in metadata
    assert "mta/recipes/tiny.yaml" in names and "mta_cli/main.py" in names

    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists)],
        capture_output=True,
        text=True,
        env=_outer_env(),
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    python = _fresh_venv(tmp_path / "venv")
    env = _clean_env()
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheels[0])],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    command = python.parent / "mta"
    version = subprocess.run([str(command), "--version"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"mta {MTA_VERSION}"
    listed = subprocess.run(
        [str(command), "recipes", "list"], capture_output=True, text=True, env=env, cwd=tmp_path, check=True
    )
    venv_root = str((tmp_path / "venv").resolve())
    assert "tiny" in listed.stdout and venv_root in listed.stdout  # the wheel's own recipes
    imported = subprocess.run(
        [str(python), "-c", "import mta, mta_cli; print(mta.__file__, mta_cli.__file__, mta.__version__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    ).stdout.split()
    assert all(Path(path).resolve().is_relative_to(venv_root) for path in imported[:2]), imported
    assert imported[2] == MTA_VERSION
