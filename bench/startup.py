"""Benchmark: the commands' fixed cost, from launch to exit, and what each imports (issue 34).

    python bench/startup.py [--rounds 5] [--baseline DIR --baseline-label TEXT]

Each command runs as a fresh process (``python -m mta_cli.main``, one torch thread) on inputs
built once in a temporary directory: the tiny recipe's tokenizer (a byte-level BPE, 512 tokens,
on recipes/examples/tiny.jsonl), a random 4-layer Llama (d 32) on it, and the first row of that
file:

- ``help``: ``mta --help``;
- ``recipes_list``: ``mta recipes list`` (reads the shipped recipes: no torch);
- ``dry_run``: ``mta distill --recipe tiny --dry-run``;
- ``evaluate``: ``mta evaluate TINY -o OUT --benchmarks ONE_ROW.jsonl --limit 1 --seeds 10`` (one
  row, one seed, the protocol's 256 new tokens at most; a new OUT each run, so it generates);
- ``annotate``: ``mta annotate ONE_ROW.jsonl --teacher TOK --student TOK -o OUT`` (a new OUT);
- ``show``: ``mta show ANNOTATED`` (an annotate directory of that row);
- ``floor`` (a reference, current tree only): ``python -c "import transformers.modeling_utils,
  transformers.models.llama.modeling_llama; import gc; gc.freeze()"``: what any process that
  loads a Llama imports before it does anything, exiting as ``mta`` does (``mta_cli.main``
  freezes the heap at exit); no command that loads a model can start and end faster.

The variants run interleaved (``interleaving.interleaved_rounds``: each once to warm the page
cache, then ``--rounds`` rounds, the order rotated each round); with ``--baseline DIR`` (another
checkout's root, e.g. ``git archive`` of an older commit) every command runs on both trees in
the same rounds, so "before" and "after" share the machine's load. The median seconds (wall,
and CPU of the process: other users' load moves it less) go to bench/results/startup.json with
the targets (``--help`` <= 0.5 s, one-row evaluate <= 3 s), and, from one more run of each with
``python -X importtime``, the import seconds per top-level package (the sum of each module's
own time). Then the steps of ``mta evaluate`` that touch a checkpoint, timed inside one process
after its imports (``LOADING_PROBE``: check, fingerprint, load, release), ``--rounds`` times per
tree, on the tiny Llama and on a 12-layer d-768 one (286 MB of fp32 weights, GPT-2 small's
size). No machine path is written.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interleaving import interleaved_rounds  # noqa: E402
from machine import created, describe_machine  # noqa: E402
from mta.files import atomic_write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "recipes" / "examples" / "tiny.jsonl"
RESULTS = REPO / "bench" / "results" / "startup.json"
COMMANDS = ("help", "recipes_list", "dry_run", "evaluate", "annotate", "show")
FLOOR = "floor"
FLOOR_IMPORTS = "import transformers.modeling_utils, transformers.models.llama.modeling_llama; import gc; gc.freeze()"
TARGETS_S = {"help": 0.5, "evaluate": 3.0}
# The steps of `mta evaluate` that read a checkpoint, each timed once its imports are done.
LOADING_PROBE = r"""
import json, sys, time
import torch
from mta.models.weights import checkpoint_fingerprint
from mta.evaluation.models_under_test import check_checkpoint, loaded_checkpoint
checkpoint, seconds = sys.argv[1], {}
def timed(step, call):
    start = time.perf_counter()
    call()
    seconds[step] = time.perf_counter() - start
timed("check_s", lambda: check_checkpoint(checkpoint))
timed("fingerprint_s", lambda: checkpoint_fingerprint(checkpoint))
context = loaded_checkpoint(checkpoint, torch.device("cpu"), torch.float32)
timed("load_s", context.__enter__)
timed("release_s", lambda: context.__exit__(None, None, None))
print(json.dumps(seconds))
"""
TOP_PACKAGES = 12
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


class Inputs:
    """The files every command reads, built once; each run that writes gets a new directory."""

    def __init__(self, scratch: Path):
        from mta.models.tiny import build_tiny_model, build_tiny_tokenizer

        self.scratch = scratch
        self.tokenizer = scratch / "tokenizer"
        build_tiny_tokenizer(EXAMPLES, self.tokenizer, vocab_size=512)
        self.model = build_tiny_model(self.tokenizer, scratch / "tiny-llama")
        self.models = {
            "tiny_llama_d32_4_layers": self.model,
            "llama_d768_12_layers_286MB": build_tiny_model(
                self.tokenizer, scratch / "small-llama", hidden_size=768, num_layers=12, num_heads=12
            ),
        }
        self.row = scratch / "one-row.jsonl"
        self.row.write_text(EXAMPLES.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
        self.annotated = scratch / "annotated"
        self.runs = 0

    def fresh(self, name: str) -> Path:
        self.runs += 1
        return self.scratch / "out" / f"{name}-{self.runs}"

    def argv(self, command: str) -> list[str]:
        """The interpreter's arguments: ``-m mta_cli.main`` and the command's, or the floor's."""
        if command == FLOOR:
            return ["-c", FLOOR_IMPORTS]
        return ["-m", "mta_cli.main", *self.mta_argv(command)]

    def mta_argv(self, command: str) -> list[str]:
        if command == "help":
            return ["--help"]
        if command == "recipes_list":
            return ["recipes", "list"]
        if command == "dry_run":
            return ["distill", "--recipe", "tiny", "--dry-run"]
        if command == "evaluate":
            out, row = str(self.fresh("evaluate")), str(self.row)
            return ["evaluate", str(self.model), "-o", out, "--benchmarks", row, "--limit", "1", "--seeds", "10"]
        if command == "annotate":
            return self.annotate_argv(self.fresh("annotate"))
        if command == "show":
            return ["show", str(self.annotated)]
        raise ValueError(command)

    def annotate_argv(self, out: Path) -> list[str]:
        tokenizer = str(self.tokenizer)
        return ["annotate", str(self.row), "--teacher", tokenizer, "--student", tokenizer, "-o", str(out)]


def described(command: str) -> str:
    """The command line as the JSON records it: placeholders for the scratch paths."""
    return {
        "help": "mta --help",
        "recipes_list": "mta recipes list",
        "dry_run": "mta distill --recipe tiny --dry-run",
        "evaluate": "mta evaluate TINY_LLAMA -o NEW_DIR --benchmarks ONE_ROW.jsonl --limit 1 --seeds 10",
        "annotate": "mta annotate ONE_ROW.jsonl --teacher TINY_TOKENIZER --student TINY_TOKENIZER -o NEW_DIR",
        "show": "mta show ANNOTATED_DIR",
        FLOOR: f'python -c "{FLOOR_IMPORTS}"',
    }[command]


def environment(tree: Path) -> dict[str, str]:
    """One torch thread, no launcher variables, ``tree``'s packages first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="120", MTA_CPU_BF16="0")
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), str(tree / "cli")])
    return env


def run(
    tree: Path, argv: list[str], cwd: Path, *, importtime: bool = False, capture: bool = False
) -> tuple[float, float, str]:
    """Wall seconds from launch to exit of ``python ARGV``, its CPU seconds, and its stderr (its
    stdout with ``capture``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *(["-X", "importtime"] if importtime else []), *argv],
        env=environment(tree),
        cwd=cwd,
        stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or capture and not done.stdout.strip():
        raise SystemExit(f"python {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout if capture else done.stderr


def import_seconds(stderr: str) -> dict:
    """``-X importtime`` lines -> the total and the seconds of each top-level package (the sum of
    its modules' own times), the largest ``TOP_PACKAGES`` named and the rest as ``other``."""
    per_package: collections.Counter[str] = collections.Counter()
    for line in stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if match:
            per_package[match.group(4).split(".")[0]] += int(match.group(1)) / 1e6
    top = dict(per_package.most_common(TOP_PACKAGES))
    other = sum(per_package.values()) - sum(top.values())
    return {
        "total_s": round(sum(per_package.values()), 3),
        "packages_s": {name: round(seconds, 3) for name, seconds in top.items()} | {"other": round(other, 3)},
        "imported": sorted(per_package),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout's root, timed alongside")
    parser.add_argument("--baseline-label", default="baseline", help="what --baseline is, for the JSON")
    args = parser.parse_args()
    load_before = os.getloadavg()
    trees = {"current": REPO} | ({args.baseline_label: args.baseline.resolve()} if args.baseline else {})
    variants = [(tree, command) for command in COMMANDS for tree in trees] + [("current", FLOOR)]
    seconds: dict[tuple[str, str], dict[str, list[float]]] = {v: {"wall": [], "cpu": []} for v in variants}
    with tempfile.TemporaryDirectory(prefix="mta-bench-startup-") as scratch_name:
        scratch = Path(scratch_name)
        inputs = Inputs(scratch)
        run(REPO, ["-m", "mta_cli.main", *inputs.annotate_argv(inputs.annotated)], scratch)

        def measure(variant: tuple[str, str], record: bool = True) -> None:
            tree, command = variant
            wall, cpu, _ = run(trees[tree], inputs.argv(command), scratch)
            if record:
                seconds[variant]["wall"].append(wall)
                seconds[variant]["cpu"].append(cpu)

        interleaved_rounds(
            variants,
            args.rounds,
            measure,
            warm_up=lambda variant: measure(variant, record=False),
            describe=lambda variant: f"{variant[1]}[{variant[0]}] {seconds[variant]['wall'][-1]:.2f} s",
        )
        imports: dict[str, dict[str, dict]] = {tree: {} for tree in trees}
        for tree, command in variants:
            imports[tree][command] = import_seconds(run(trees[tree], inputs.argv(command), scratch, importtime=True)[2])
        steps: dict[tuple[str, str], list[dict]] = {(tree, model): [] for tree in trees for model in inputs.models}
        for _ in range(args.rounds):
            for tree, model in steps:
                probe = ["-c", LOADING_PROBE, str(inputs.models[model])]
                steps[(tree, model)].append(json.loads(run(trees[tree], probe, scratch, capture=True)[2]))
        loading = {
            tree: {
                model: {
                    step: round(statistics.median(timed[step] for timed in steps[(tree, model)]), 4)
                    for step in steps[(tree, model)][0]
                }
                for model in inputs.models
            }
            for tree in trees
        }

    medians: dict[str, dict[str, dict[str, float]]] = {tree: {} for tree in trees}
    for tree, command in variants:
        medians[tree][command] = {
            "median_wall_s": round(statistics.median(seconds[(tree, command)]["wall"]), 3),
            "median_cpu_s": round(statistics.median(seconds[(tree, command)]["cpu"]), 3),
        }
    results = {
        "created": created(),
        "rounds": args.rounds,
        "commands": {command: described(command) for command in (*COMMANDS, FLOOR)},
        "trees": {"current": "the working tree", **({args.baseline_label: "--baseline"} if args.baseline else {})},
        "median_s": medians,
        "targets_s": TARGETS_S,
        "met": {command: medians["current"][command]["median_wall_s"] <= limit for command, limit in TARGETS_S.items()},
        "runs": {
            tree: {
                command: {kind: [round(s, 3) for s in values] for kind, values in seconds[(tree, command)].items()}
                for variant_tree, command in variants
                if variant_tree == tree
            }
            for tree in trees
        },
        "imports": imports,
        "model_loading_median_s": loading,
        "machine": describe_machine(
            torch.device("cpu"), command_torch_threads=1, load_average_before=list(load_before)
        ),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS, results)
    print(json.dumps({"median_s": medians, "met": results["met"]}, indent=2))


if __name__ == "__main__":
    main()
