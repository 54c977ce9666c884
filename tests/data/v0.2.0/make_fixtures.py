"""Make the mta 0.2.0 artefacts committed beside this file: a run directory with a checkpoint of
a run with ``generation:`` on, and a teacher cache (tests/test_old_artefacts.py).

Run it with mta 0.2.0 (it refuses any other version: the point of the fixture is an *old*
artefact; a later mta's artefacts go into a new directory beside this one)::

    python tests/data/v0.2.0/make_fixtures.py            # rewrites tests/data/v0.2.0/
    python tests/data/v0.2.0/make_fixtures.py --out DIR  # elsewhere, e.g. to compare

Everything is built in a temporary directory with ``mta``'s own commands, from the repository's
example rows, then copied here; every path a committed file records is relative to this
directory (the recipe's paths resolve beside it), so a test copies the directory anywhere and
runs ``mta distill --recipe recipe.yaml ...`` inside it, as a user would:

- ``models/teacher``, ``models/student``: tiny random Llamas (2 layers, d = 32 and 16) sharing a
  300-token byte-level BPE trained on ``recipes/examples/tiny.jsonl``;
- ``annotations/``: the first 8 example rows, ``mta annotate --recipe recipe.yaml``;
- ``checkpoint-run/``: ``mta distill --recipe recipe.yaml`` (2 steps, adaptive off-policy
  sampling with a 4-row replay buffer, a checkpoint at step 2) with its exports ``final/`` and
  ``best/`` left out (a resume does not read them): ``run.json``, ``metrics.jsonl`` and
  ``checkpoints/step-2/`` (with ``off_policy_state.json``, ``replay_buffer-rank-00000.parquet``
  and ``checksums.sha256``) as the run wrote them, but for DeepSpeed's own conversion scripts,
  which it copies into every checkpoint (``deepspeed/zero_to_*.py``: third-party code a resume never
  reads), left out with their lines of ``checksums.sha256``;
- ``teacher-cache/``: ``mta teacher --recipe recipe.yaml generation.mode=off -o teacher-cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
EXAMPLES = REPO / "recipes" / "examples" / "tiny.jsonl"
ROWS = 8
VOCAB = 300
VERSION = "0.2.0"

RECIPE = """\
# mta 0.2.0's tiny run with the student's own responses (tests/data/v0.2.0/make_fixtures.py).
name: tiny-v0.2.0
seed: 42
output_dir: checkpoint-run
teacher:
  path: models/teacher
student:
  path: models/student
data:
  train: annotations
  dev: annotations
  max_length: 192
  max_prompt_length: 160
loss:
  base: srkl
  dsa_weight: 2.0
  hra_weight: 0.2
  layers:
    - [1, 1, word]
    - [2, 2, phrase]
train:
  lr: 3.0e-3
  projector_lr: 3.0e-3
  schedule: cosine
  warmup_steps: 1
  max_steps: 2
  batch_size: 4
  micro_batch_size: 2
  precision: fp32
  zero_stage: 1
  log_interval: 1
  eval_interval: 2
  save_interval: 2
  keep_checkpoints: 2
  num_sample_generations: 0
generation:
  mode: adaptive
  init_threshold: 1.0
  buffer_size: 4
  max_new_tokens: 8
teacher_cache:
  top_k: 8
"""
# What a resume reads of the run directory (the exports final/ and best/ are left out).
RUN_FILES = ("run.json", "metrics.jsonl", "checkpoints")
MADE = ("recipe.yaml", "rows.jsonl", "models", "annotations", "checkpoint-run", "teacher-cache")


def mta(work: Path, *args: str) -> None:
    """``mta ARGS`` in ``work``, one torch thread, this checkout's packages first."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MTA_CPU_BF16="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "cli"), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-m", "mta_cli.main", *args], cwd=work, env=env, check=True)


def build(work: Path) -> None:
    from mta.models.tiny import build_tiny_model, build_tiny_tokenizer

    rows = EXAMPLES.read_text(encoding="utf-8").splitlines()[:ROWS]
    (work / "rows.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    (work / "recipe.yaml").write_text(RECIPE, encoding="utf-8")
    build_tiny_tokenizer(EXAMPLES, work / "tokenizer", vocab_size=VOCAB)
    build_tiny_model(work / "tokenizer", work / "models" / "teacher", num_layers=2, hidden_size=32, seed=1)
    build_tiny_model(work / "tokenizer", work / "models" / "student", num_layers=2, hidden_size=16, seed=2)
    mta(work, "annotate", "rows.jsonl", "--recipe", "recipe.yaml", "--workers", "1", "-o", "annotations")
    # The one edit: annotate records its input's absolute path (a label, read by nothing) in its
    # manifests; the committed ones name it relative to this directory instead.
    for manifest in (work / "annotations" / ".mta").glob("*.json"):
        text = manifest.read_text(encoding="utf-8")
        manifest.write_text(text.replace(json.dumps(str(work / "rows.jsonl")), '"rows.jsonl"'), encoding="utf-8")
    mta(work, "distill", "--recipe", "recipe.yaml")
    mta(work, "teacher", "--recipe", "recipe.yaml", "generation.mode=off", "-o", "teacher-cache")


def copy_out(work: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in MADE:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    shutil.copy2(work / "recipe.yaml", out / "recipe.yaml")
    shutil.copy2(work / "rows.jsonl", out / "rows.jsonl")
    shutil.copytree(work / "models", out / "models")
    shutil.copytree(work / "annotations", out / "annotations")
    shutil.copytree(work / "teacher-cache", out / "teacher-cache")
    for name in RUN_FILES:
        source, target = work / "checkpoint-run" / name, out / "checkpoint-run" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)
    drop_deepspeed_scripts(out / "checkpoint-run")


def drop_deepspeed_scripts(run: Path) -> None:
    """Remove DeepSpeed's ``zero_to_*.py`` from each checkpoint and from its ``checksums.sha256``."""
    for scripts in run.glob("checkpoints/*/deepspeed"):
        for script in scripts.glob("zero_to_*.py"):
            script.unlink()
        listed = scripts.parent / "checksums.sha256"
        lines = listed.read_text(encoding="utf-8").splitlines(keepends=True)
        listed.write_text("".join(line for line in lines if "deepspeed/zero_to_" not in line), encoding="utf-8")


def check_no_machine_paths(out: Path, work: Path) -> None:
    """No committed file names the temporary directory, this checkout or the user's home."""
    needles = [str(work).encode(), str(work.resolve()).encode(), str(REPO).encode(), str(Path.home()).encode()]
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.suffix != ".py":
            data = path.read_bytes()
            found = [n.decode() for n in needles if n in data]
            if found:
                raise SystemExit(f"{path.relative_to(out)} records a machine path: {found}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where the fixtures go [default: beside this script]")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "src"), str(REPO / "cli")]
    from mta.versions import MTA_VERSION

    if MTA_VERSION != VERSION:
        raise SystemExit(
            f"this is mta {MTA_VERSION}: these fixtures are mta {VERSION}'s artefacts; check out a {VERSION} "
            f"commit to remake them, or add tests/data/v{MTA_VERSION}/ for this version's"
        )
    with tempfile.TemporaryDirectory(prefix="mta-fixtures-") as temporary:
        work = Path(temporary)
        build(work)
        copy_out(work, args.out)
        check_no_machine_paths(args.out, work)
    sizes = {name: sum(p.stat().st_size for p in (args.out / name).rglob("*") if p.is_file()) for name in MADE[2:]}
    print(json.dumps(sizes | {"total": sum(sizes.values())}, indent=1))


if __name__ == "__main__":
    main()
