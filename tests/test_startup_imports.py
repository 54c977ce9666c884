"""Each command imports what it uses, when it uses it (issue 34), checked in fresh interpreters.

- ``mta --help``, ``mta --version``, ``mta recipes list`` / ``copy`` / ``keys`` and every command's and
  group's ``--help`` import neither torch nor any other heavy library;
- importing every module of ``mta.evaluation`` loads neither DeepSpeed nor the ROUGE scorer
  (nltk) nor the trackers, and ``mta evaluate`` on a tiny model, from the command line to the
  written results, never imports DeepSpeed (an evaluation does not train), ``datasets`` (JSONL
  input), spaCy, peft, ``mta.tracking`` (no ``--report-to``) or the training stage;
- ROUGE-L's first score imports nltk without scikit-learn and scipy.stats, which import as
  usual afterwards.

Import checks only, no timings (``bench/startup.py`` times the commands).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import EXAMPLES, subprocess_env

HEAVY = (
    "torch",
    "transformers",
    "deepspeed",
    "accelerate",
    "safetensors",
    "numpy",
    "pandas",
    "pyarrow",
    "datasets",
    "nltk",
    "rouge_score",
    "sklearn",
    "scipy",
    "spacy",
    "peft",
    "tokenizers",
)

# Runs ``mta ARGV`` for each ARGV of a JSON list (or, for "--every-help", each command's and
# group's --help) through the real entry point, in this one interpreter, and writes what each
# exited with and which WATCHED modules were loaded after it.
RUNNER = r"""
import json, sys

argv_lists, watched, report = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
from mta_cli.main import app, main

if argv_lists == "--every-help":
    import typer

    def helps(command, path):
        yield [*path, "--help"]
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            yield from helps(sub, [*path, name])

    argv_lists = list(helps(typer.main.get_command(app), []))
done = []
for argv in argv_lists:
    sys.argv = ["mta", *argv]
    try:
        main()
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    loaded = sorted(name for name in watched if name in sys.modules)
    done.append({"argv": argv, "code": code, "loaded": loaded})
with open(report, "w", encoding="utf-8") as handle:
    json.dump(done, handle)
"""


def run_commands(argv_lists, watched, tmp_path: Path, *, cwd: Path | None = None) -> list[dict]:
    """Each ``mta ARGV`` in one fresh interpreter (one torch thread): exit code and the
    ``watched`` modules loaded after it, command by command."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(argv_lists), json.dumps(list(watched)), str(report)],
        env=subprocess_env(COLUMNS="200"),
        cwd=cwd or tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and report.exists(), done.stderr[-3000:]
    return json.loads(report.read_text(encoding="utf-8"))


def loaded_after_importing(code: str) -> set[str]:
    """``sys.modules`` of a fresh interpreter after running ``code``."""
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.split())


def test_help_version_and_recipes_import_no_heavy_library(tmp_path):
    commands = [
        ["--help"],
        ["--version"],
        ["recipes", "list"],
        ["recipes", "copy", "tiny", str(tmp_path / "copy")],
        ["recipes", "keys"],  # both tasks' schemas, the embedding one included
    ]
    results = run_commands(commands, HEAVY, tmp_path)
    for result in results:
        assert result["code"] == 0, result
        assert not result["loaded"], f"mta {' '.join(result['argv'])} imports {result['loaded']}"
    assert (tmp_path / "copy" / "tiny.yaml").is_file()


def test_every_commands_help_imports_no_heavy_library(tmp_path):
    results = run_commands("--every-help", HEAVY, tmp_path)
    helped = {" ".join(result["argv"][:-1]) for result in results}
    assert {"", "annotate", "distill", "evaluate", "show", "generate", "embed", "recipes list"} <= helped
    assert {"models smollm2", "data download", "init-student", "demo", "demo-embed"} <= helped
    for result in results:
        assert result["code"] == 0, result
        assert not result["loaded"], f"mta {' '.join(result['argv'])} imports {result['loaded']}"


def test_importing_the_evaluation_stage_loads_no_deepspeed_scorer_or_tracker():
    modules = sorted(
        "mta.evaluation." + path.stem
        for path in (Path(__file__).resolve().parents[1] / "src" / "mta" / "evaluation").glob("*.py")
        if path.stem != "__init__"
    )
    loaded = loaded_after_importing(f"import importlib\nfor name in {modules!r}: importlib.import_module(name)")
    assert set(modules) <= loaded
    leaked = sorted(name for name in ("deepspeed", "nltk", "rouge_score", "sklearn", "mta.tracking") if name in loaded)
    assert not leaked, f"importing mta.evaluation.* loads {leaked}"
    light = loaded_after_importing("import mta.evaluation.datasets, mta.evaluation.download, mta.models.weights")
    assert "torch" not in light and "transformers" not in light


def test_an_evaluation_never_imports_deepspeed_datasets_spacy_peft_or_trackers(tiny_model_dir, tmp_path):
    watched = ("deepspeed", "datasets", "spacy", "peft", "mta.tracking", "mta.training", "torch", "nltk")
    out = tmp_path / "eval"
    argv = [str(tiny_model_dir), "-o", str(out), "--benchmarks", str(EXAMPLES), "--limit", "1", "--seeds", "10"]
    [result] = run_commands([["evaluate", *argv, "--max-new-tokens", "4", "--device", "cpu"]], watched, tmp_path)
    assert result["code"] == 0, result
    assert (out / "results.json").is_file()
    assert {"torch", "nltk"} <= set(result["loaded"])  # the model ran and its predictions were scored
    leaked = sorted(set(result["loaded"]) - {"torch", "nltk"})
    assert not leaked, f"mta evaluate imports {leaked}"


def test_rouge_imports_nltk_without_sklearn_and_scipy_stats_which_import_afterwards():
    loaded = loaded_after_importing(
        "import sys\n"
        "from mta.scoring import completion_text, has_rouge_tokens, rouge_l\n"
        "assert 'nltk' not in sys.modules and has_rouge_tokens('a cat') and 'nltk' not in sys.modules\n"
        "assert round(rouge_l('a cat sat on the mats', ['a cat sits on the mat']), 4) == 83.3333\n"  # stemmed
        "hidden = sorted(name for name in ('sklearn', 'scipy.stats', 'pandas') if name in sys.modules)\n"
        "assert not hidden, hidden\n"
        "import importlib.util\n"
        "for name in ('sklearn', 'scipy.stats'):\n"
        "    if importlib.util.find_spec(name.split('.')[0]) is not None:\n"
        "        importlib.import_module(name)\n"
    )
    assert "nltk" in loaded
