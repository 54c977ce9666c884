"""The package versions every artefact records (checkpoints, evaluation results), and mta's own."""

from __future__ import annotations

import platform

# mta's version, its one home: pyproject.toml reads it (``dynamic``), ``mta.__version__`` re-exports it,
# and modules that record it import it from here rather than from the ``mta`` package.
MTA_VERSION = "0.2.0"
# The distribution that installs the `mta` package: "mta" on PyPI is another project that also
# imports as `mta`, so mta's version is read from this name (artefacts record it under "mta").
DISTRIBUTION = "mta-distill"

PACKAGES = (
    "mta",
    "torch",
    "transformers",
    "tokenizers",
    "deepspeed",
    "safetensors",
    "spacy",
    "pyarrow",
    "rouge-score",
    "nltk",
    "peft",  # peft: a LoRA student's adapters (student.lora)
)


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """``{"python": ..., package: version or None when it is not installed}``; ``"mta"`` is read
    from its distribution, :data:`DISTRIBUTION` (never another project's ``mta``)."""
    from importlib import metadata  # here: `import mta` (and `mta --help`) stays without it

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            versions[name] = metadata.version(DISTRIBUTION if name == "mta" else name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def source_commit() -> dict[str, str | bool | None]:
    """The git commit mta runs from, for results that name the code they came from:
    ``{"commit": sha or None, "dirty": whether tracked files differ from it}``; ``None`` when mta
    is not a git checkout (an installed wheel) or git is missing."""
    import subprocess  # here: `import mta` stays without it
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha or None, "dirty": bool(status.strip())}
