"""Mutation testing of mta's pure modules: do their fast tests notice a changed operator?

`make mutate` (not part of `make test` or CI). mutmut (pinned in pyproject's `mutate` extra)
mutates the functions of

    losses        src/mta/losses/*.py
    token_ranges  src/mta/data/token_ranges.py
    truncation    src/mta/data/truncation.py

and of the rule modules (GROUPS below: training_config, selection, stopping, sampling, lora, checkpoints,
asam, generation, store, talas, online_spans, pairs, hashing_scoring); the glue left out is EXCLUDED,
each with its reason. A module in scope that yields no mutant is an error.

and runs, for each mutant, only the fast tests (`-m "not slow"`) that call the mutated function:
tests/test_losses_*.py, tests/test_reference_code.py, tests/test_talas_reference_code.py,
tests/test_token_ranges.py, the long-row tests of
tests/test_annotate_faults.py (bounded encoding windows) and the tests written to kill survivors
(tests/test_mutation_kills_*.py, tests/test_truncation_mutants.py).

Everything happens in a scratch copy of the repository (a temporary directory, removed at the
end unless --keep): mutmut copies its sources into `mutants/` there, and the copy's sources are
what the tests import (mutmut puts `mutants/src` first on sys.path; its forced-failure check
stops the run if the mutated code is not the code under test). The working tree is only read,
and bench/results/mutation.json written.

One mutmut worker, one thread per library (OMP/MKL): the machine is shared. Each mutant's tests
run under a time limit derived from their clean duration and TIMEOUT_CONSTANT (a mutant that
loops forever is a "timeout", which counts as detected), and the whole run under --limit-min of
wall time (mutants it did not reach are reported as "not checked").

mutmut mutates only undecorated functions (and @staticmethod / @classmethod). So that the
decorated ones are tested too, the scratch copy rewrites each other single-decorator function
``@D def f`` into ``def f`` followed by ``f = D(f)`` (what the decorator syntax means); line
numbers in the report are those of the real file. Module-level constants are not mutated.

A surviving mutant is either a gap in the tests (write one that kills it) or equivalent: it
cannot change any result. Equivalent ones are listed under "equivalent" in
bench/mutation_survivors.json, each with its reason, matched on (file, function, the original
line, the mutated line) so the list survives mutmut's renumbering; they are reported and left
out of the kill rate's denominator. Its "accepted" lists the few that can change a result only
in a corner no cheap test reaches (each says what it would take); they stay "survived" and
count against the rate. Kill rate: (killed + timeout) /
(total - equivalent), per file, per group and overall. The results list every survivor and every
equivalent mutant with its original and mutated line (``mutmut show`` in a ``--keep`` scratch copy
gives the diff); "no tests" and "not checked" are counted per file only.

    .venv/bin/python bench/mutation.py                       # every group
    .venv/bin/python bench/mutation.py --modules truncation  # re-run one group, merge the rest
    .venv/bin/python bench/mutation.py --modules losses --only src/mta/losses/fdd.py  # one file of it
    .venv/bin/python bench/mutation.py --relabel             # apply edited survivor tables only
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "mutation.json"

# The annotate tests that drive truncation's encoding windows (and token_ranges through them):
# picked by name from tests/test_annotate_faults.py, so a renamed or added one is followed.
LONG_ROW_TESTS = ("tests/test_annotate_faults.py", r"bounded_encoding|multi_megabyte")

# The run-directory tests that need no training run (those that train are picked out by name).
RUN_DIRECTORY_TESTS = r"^(?!.*(same_command|the_command_refuses|bug_report|non_finite_weights|resume_applies))"

GROUPS: dict[str, dict] = {
    "losses": {
        "mutate": ["src/mta/losses/*.py"],
        "tests": [
            *("tests/test_losses_*.py", "tests/test_mutation_kills_losses*.py", "tests/test_teacher_topk.py"),
            # the authors' code paths (loss.reference_code) of the trajectory and TALAS losses
            *("tests/test_reference_code.py", "tests/test_talas_reference_code.py"),
        ],
    },
    "token_ranges": {
        "mutate": ["src/mta/data/token_ranges.py"],
        "tests": ["tests/test_token_ranges.py", "tests/test_mutation_kills_token_ranges*.py", LONG_ROW_TESTS],
    },
    "truncation": {
        "mutate": ["src/mta/data/truncation.py"],
        "tests": ["tests/test_token_ranges.py", "tests/test_truncation_mutants.py", LONG_ROW_TESTS],
    },
    # The rule modules added since (issue 32). Every group at once: about 64 minutes on one worker
    # (the sum of the last runs' wall times in bench/results/mutation.json, 2026-12-04).
    "training_config": {
        "mutate": [
            "src/mta/training/config/resume_rules.py",
            "src/mta/training/config/layers.py",
            "src/mta/training/config/overrides.py",
            "src/mta/training/config/extends.py",
            "src/mta/training/config/yaml_reader.py",
        ],
        "tests": [
            "tests/test_rules_resume.py",
            "tests/test_resume_rules.py",
            "tests/test_layers.py",
            "tests/test_recipe_extends.py",
            "tests/test_recipe_hostile.py",
            "tests/test_rules_registry.py",
        ],
    },
    "selection": {
        "mutate": ["src/mta/training/lifecycle/selection.py"],
        "tests": ["tests/test_selection.py", "tests/test_rules_selection.py"],
    },
    "stopping": {"mutate": ["src/mta/training/lifecycle/stopping.py"], "tests": ["tests/test_stop_signals.py"]},
    "sampling": {
        "mutate": ["src/mta/training/off_policy/policy.py", "src/mta/training/off_policy/replay_buffer.py"],
        "tests": ["tests/test_rules_off_policy.py", "tests/test_off_policy.py"],
    },
    "lora": {"mutate": ["src/mta/training/lora.py"], "tests": ["tests/test_lora.py"]},
    "checkpoints": {
        "mutate": [
            "src/mta/training/lifecycle/safe_loading.py",
            "src/mta/training/lifecycle/run_directory.py",
            "src/mta/training/lifecycle/checkpointing.py",
        ],
        # Not tests/test_checkpoint_faults.py (DeepSpeed engines at every ZeRO stage) nor the
        # tests of test_run_directory.py that train (a tiny run each): each mutant's session would
        # build them again, and with them the group ran out of time with 315 mutants unchecked.
        # What only they reached (load_state_file's refusals, the engine's wrapper, each decision
        # of a claim) has fast tests in tests/test_mutation_kills_checkpoints.py.
        "tests": [
            "tests/test_rules_checksums.py",
            ("tests/test_run_directory.py", RUN_DIRECTORY_TESTS),
            ("tests/test_rules_refusals.py", r"directory|state_file|run_output"),
            "tests/test_checkpointing.py",
        ],
    },
    # ASAM (TALAS's optimizer step): the closed form and the two-pass update by hand; not the tests
    # that build DeepSpeed engines or train the tiny recipe (with them, 71 of 205 mutants in 15
    # minutes; without, 174 in 35 s). What only they reach has fast tests in
    # tests/test_mutation_kills_asam*.py.
    "asam": {
        "mutate": ["src/mta/training/asam.py"],
        "tests": [("tests/test_asam.py", r"^(?!.*(tiny_llm_recipe_trains|trainer_steps_are_adamw))")],
    },
    "generation": {
        "mutate": ["src/mta/generation/sampling.py", "src/mta/generation/generator.py"],
        "tests": ["tests/test_generation.py"],
    },
    "store": {
        "mutate": ["src/mta/store/*.py", "src/mta/data/annotations.py"],
        "tests": ["tests/test_data_sources.py", "tests/test_annotate_faults.py"],
    },
    "talas": {
        "mutate": ["src/mta/embedding/objective.py", "src/mta/embedding/pooling.py"],
        "tests": [
            "tests/test_losses_talas.py",
            # Not its ASAM steps through DeepSpeed engines (asam_steps, clip_differs: 4 s of a
            # pool or objective mutant's 5 s of tests, and with them the group ran out of time with
            # 102 mutants unchecked; without them it takes about 3 minutes). What only they reached
            # (projector_parameters) has fast tests in tests/test_mutation_kills_talas_parts.py.
            ("tests/test_talas_reference_code.py", r"^(?!.*(asam_steps|clip_differs))"),
            # Not tests/test_embedding_training.py: its module fixtures train and export models
            # (12 s a mutant), and what it alone reaches (PoolingConfig.record, export_files) has
            # fast tests in tests/test_mutation_kills_talas.py.
        ],
    },
    "online_spans": {
        "mutate": ["src/mta/data/online_spans.py"],
        # The kill tests alone (tests/test_mutation_kills_online_spans*.py: stand-ins for spaCy and
        # the pool, the worker set-up run in-process). Not tests/test_online_spans.py: every test of
        # it loads spaCy and the tokenizers (3 s) or runs `mta annotate`, starts forked workers or
        # a trainer it kills, and with it the group ran out of time (142 mutants unchecked, slow
        # sessions counted as timeouts); its workers, the only callers of the worker set-up, report
        # nothing back to mutmut, so that set-up was "no tests" anyway.
        "tests": [],
    },
    # mta generate's pair files (tests/test_pair_rows.py and test_rules_pairs.py test the pair
    # rows of `mta annotate`, in mta.data, and call nothing here). Its rules by the kill tests
    # alone: tests/test_generate_command.py runs the models end to end, and each mutant's session
    # builds them again (about 15 s a mutant: 568 mutants take over two hours), so what only it
    # reaches (generate_pairs, _side_generator, _generate_side) is reported as "no tests".
    "pairs": {"mutate": ["src/mta/pairs/generate.py"], "tests": []},
    "hashing_scoring": {
        "mutate": ["src/mta/hashing.py", "src/mta/scoring.py"],
        "tests": ["tests/test_rouge.py", "tests/test_rules_checksums.py", "tests/test_foundation.py"],
    },
}

# Modules left out on purpose, each with its reason (bench/results/mutation.json lists them).
EXCLUDED: dict[str, str] = {
    "src/mta/training/engine.py": "DeepSpeed and optimizer setup: glue, killed only by whole runs (minutes a mutant)",
    "src/mta/training/trainer.py": "the training loop: glue over the rule modules above, end-to-end tests only",
    "src/mta/training/dry_run.py": "the plan's wording and tables: rendering",
    "src/mta/training/model_loading.py": "Hugging Face loading glue",
    "src/mta/generation/vllm_engine.py": "needs the vLLM environment and 25 s per engine start",
    "src/mta/generation/vllm_worker.py": "runs in the vLLM environment only",
    "src/mta/integrations/trl.py": "needs TRL; its tests train end to end",
    "cli/mta_cli": "the command line: parsing and rendering",
}

# What the scratch copy needs: the sources, the tests and their data, the project file.
COPIED = [
    *("src", "cli", "tests", "docs", "recipes", "examples", "bench"),
    *("pyproject.toml", "README.md", "ARCHITECTURE.md", "CHANGELOG.md", "Makefile"),
]

# Surviving mutants that are not gaps in the tests, in bench/mutation_survivors.json: "equivalent"
# (no result can change; each with its reason) and "accepted" (a corner no cheap test reaches; each
# with a note), matched on (file, function, original line, mutated line), lines compared stripped
# of surrounding whitespace.
SURVIVORS = REPO / "bench" / "mutation_survivors.json"
SURVIVOR_KEYS = {"equivalent": "reason", "accepted": "note"}


def load_survivors(path: Path = SURVIVORS) -> dict[str, list[dict[str, str]]]:
    """The "equivalent" and "accepted" tables of ``path``, each entry checked for its keys."""
    tables = json.loads(path.read_text(encoding="utf-8"))
    for table, explanation in SURVIVOR_KEYS.items():
        for index, entry in enumerate(tables[table]):
            missing = {"file", "function", "from", "to", explanation} - set(entry)
            if missing:
                raise SystemExit(f"{path}: {table}[{index}] lacks {sorted(missing)}")
    return {table: tables[table] for table in SURVIVOR_KEYS}


SURVIVOR_TABLES = load_survivors()
EQUIVALENT: list[dict[str, str]] = SURVIVOR_TABLES["equivalent"]
ACCEPTED: list[dict[str, str]] = SURVIVOR_TABLES["accepted"]

# A mutant is a "timeout" (detected) after (its tests' clean duration + TIMEOUT_CONSTANT) x
# TIMEOUT_MULTIPLIER seconds of wall time (twice that of CPU time). The clean durations are the
# tests' own, without their module fixtures, which each mutant's fresh pytest session builds
# again (a tiny model, a training run: up to about 12 s): the constant covers them, so a mutant
# is never counted as detected for its fixtures' time. mutmut's defaults (15, 1) give a mutant
# that loops forever in last_fitting_cut two minutes; these give it 30 s.
TIMEOUT_MULTIPLIER, TIMEOUT_CONSTANT = 2.0, 15.0

DETECTED = ("killed", "timeout", "segfault")  # segfault: mutmut's name for SIGKILL after SIGXCPU


def mutant_status(code: int | None, named: dict) -> str:
    """The status of a mutant whose tests exited with ``code``: mutmut's name for it (``named``,
    its ``status_by_exit_code``), except that a test process ended by a signal mutmut has no name
    for (a negative code: a SIGUSR1 or SIGTERM the mutant left unhandled, say) is "killed" where
    mutmut says "suspicious": the tests did not pass."""
    status = named[code]
    return "killed" if status == "suspicious" and code is not None and code < 0 else status


def log(message: str) -> None:
    print(f"[mutation] {message}", flush=True)


# --------------------------------------------------------------------------- scratch copy


def make_scratch(root: Path) -> Path:
    scratch = root / "repo"
    scratch.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.egg-info", "mutants")
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, scratch / name, ignore=ignore)
        elif source.is_file():
            shutil.copy2(source, scratch / name)
    return scratch


def undecorate(source: str) -> tuple[str, list[int | None]]:
    """``@D def f`` -> ``def f`` + ``f = D(f)`` for every function with one decorator other than
    @staticmethod / @classmethod (which mutmut handles). Returns the new source and, for each of
    its lines (1-based, index 0 unused), the line of ``source`` it came from (None: inserted)."""
    lines = source.splitlines(keepends=True)
    removed: set[int] = set()
    after: dict[int, list[str]] = {}  # 1-based line -> lines inserted after it
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.decorator_list) != 1:
            continue
        decorator = node.decorator_list[0]
        if isinstance(decorator, ast.Name) and decorator.id in ("staticmethod", "classmethod"):
            continue
        if decorator.lineno != decorator.end_lineno or decorator.end_lineno != node.lineno - 1:
            continue  # a multi-line decorator or comments between: left as it is (not mutated)
        indent = lines[node.lineno - 1][: len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
        expression = ast.get_source_segment(source, decorator)
        removed.add(decorator.lineno)
        after.setdefault(node.end_lineno, []).append(f"{indent}{node.name} = ({expression})({node.name})\n")
    out, origin = [], [None]
    for number, line in enumerate(lines, start=1):
        if number in removed:
            out.append("\n")  # kept as a blank line: the function's lines do not move
            origin.append(number)
            continue
        out.append(line)
        origin.append(number)
        for extra in after.get(number, []):
            out.append(extra)
            origin.append(None)
    return "".join(out), origin


def defines_functions(path: Path) -> bool:
    """Whether the module has a function or method for mutmut to mutate (it mutates function
    bodies only: a module of re-exports and constants, such as most ``__init__.py``, has none)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(tree))


def mutated_files(groups: list[str], scratch: Path, only: Iterable[str] = ()) -> list[str]:
    """The files of ``groups`` that have a function to mutate (the others are listed in the
    results as excluded), narrowed to those matching one of the ``only`` patterns if any."""
    patterns = [pattern for group in groups for pattern in GROUPS[group]["mutate"]]
    files = sorted({str(p.relative_to(scratch)) for pattern in patterns for p in scratch.glob(pattern)})
    files = [f for f in files if not only or any(fnmatch.fnmatch(f, pattern) for pattern in only)]
    return [f for f in files if defines_functions(scratch / f)]


def functionless_files(groups: list[str], root: Path = REPO) -> list[str]:
    """The files of ``groups`` that :func:`mutated_files` leaves out: no function in them."""
    patterns = [pattern for group in groups for pattern in GROUPS[group]["mutate"]]
    files = sorted({str(p.relative_to(root)) for pattern in patterns for p in root.glob(pattern)})
    return [f for f in files if not defines_functions(root / f)]


def select_tests(groups: list[str], scratch: Path, env: dict) -> list[str]:
    selected: list[str] = []
    for group in groups:
        # The tests written to kill a group's survivors: tests/test_mutation_kills_<group>*.py.
        for entry in [*GROUPS[group]["tests"], f"tests/test_mutation_kills_{group}*.py"]:
            if isinstance(entry, tuple):
                path, pattern = entry
                if not (scratch / path).exists():
                    continue
                listing = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pytest",
                        "--collect-only",
                        "-q",
                        "-p",
                        "no:cacheprovider",
                        "-m",
                        "not slow",
                        path,
                    ],
                    cwd=scratch,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                ids = {line.split("[")[0] for line in listing.stdout.splitlines() if "::" in line}
                selected += sorted(i for i in ids if re.search(pattern, i))
            else:
                selected += sorted(str(p.relative_to(scratch)) for p in scratch.glob(entry))
    return list(dict.fromkeys(selected))


def write_config(scratch: Path, files: list[str], tests: list[str]) -> None:
    pyproject = scratch / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    if "[tool.mutmut]" in text:
        raise SystemExit("pyproject.toml already has a [tool.mutmut] table; this driver writes its own")
    table = {
        "source_paths": ["src"],
        "only_mutate": files,
        "pytest_add_cli_args_test_selection": [*tests, "-m", "not slow"],
        # A text file opened without an encoding in a mutated module is an error (the
        # `encoding=None` mutants: the locale's encoding is UTF-8 here, so nothing else tells).
        "pytest_add_cli_args": [
            *("-p", "no:cacheprovider"),
            *(arg for file in files for arg in ("-W", f"error::EncodingWarning:{module_name(file)}")),
        ],
        "use_git_change_detection": False,
        # CPU seconds per mutant: 2 x TIMEOUT_MULTIPLIER x (its tests' clean time + TIMEOUT_CONSTANT).
        "timeout_multiplier": TIMEOUT_MULTIPLIER,
        "timeout_constant": TIMEOUT_CONSTANT,
        # What the tests read besides the sources: the tiny models' corpus (recipes/examples), the
        # documents whose promises they check, the Makefile and the benchmarks they run.
        "also_copy": [
            *("cli/", "docs/", "recipes/", "examples/", "bench/"),
            *("README.md", "ARCHITECTURE.md", "CHANGELOG.md", "Makefile"),
        ],
    }
    lines = ["", "[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    pyproject.write_text(text + "\n".join(lines) + "\n", encoding="utf-8")


def module_name(file: str) -> str:
    """``src/mta/data/rows.py`` -> ``mta.data.rows``."""
    return ".".join(Path(file).with_suffix("").parts[1:]).removesuffix(".__init__")


def run_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST")}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[name] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONWARNDEFAULTENCODING"] = "1"  # EncodingWarning, an error in the mutated modules
    # The real GPT-2 tokenizer of ../shared where the working tree has one; never whatever sits
    # beside the scratch copy.
    shared = Path(os.environ.get("MTA_SHARED_DIR", REPO.parent / "shared"))
    env["MTA_SHARED_DIR"] = str(shared if (shared / "README.md").exists() else REPO / ".no-shared-dir")
    return env


def run_mutmut(scratch: Path, env: dict, limit_s: float) -> tuple[int | None, float]:
    started = time.monotonic()
    with open(scratch / "mutmut.log", "w", encoding="utf-8") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "mutmut", "run", "--max-children", "1"],
            cwd=scratch,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            log(f"wall-clock limit of {limit_s / 60:.0f} min reached: stopping; unreached mutants are 'not checked'")
            os.killpg(process.pid, signal.SIGINT)  # mutmut saves what it has on Ctrl-C
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code = None
    return code, time.monotonic() - started


# --------------------------------------------------------------------------- results


def mangled_parts(mutant: str) -> tuple[str, str]:
    """``mta.losses.kd.x_f__mutmut_3`` -> (``mta.losses.kd``, ``f``); methods ``xǁCǁm`` -> ``C.m``."""
    module, _, name = mutant.rpartition(".")
    name = re.sub(r"__mutmut_\d+$", "", name)
    if name.startswith("xǁ"):
        return module, ".".join(part for part in name[2:].split("ǁ") if part)
    return module, name.removeprefix("x_")


def function_lines(source: str) -> dict[str, int]:
    """Qualified function name -> its ``def`` line."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(prefix + child.name, child.lineno)
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(source), "")
    return found


def changed_line(mutant: str, file: str, function: str, defs: dict[str, int]) -> tuple[int | None, str, str]:
    """(line in the scratch file of the first changed line, original line, mutated line)."""
    import difflib

    import libcst
    from mutmut.mutation.diff_apply import (
        read_functions_from_index,
        read_mutant_function,
        read_mutants_module,
        read_original_function,
    )

    functions = read_functions_from_index(mutant, file)
    if functions is None:
        module = read_mutants_module(file)
        functions = (read_original_function(module, mutant), read_mutant_function(module, mutant))
    original, mutated = (libcst.Module([f]).code.strip().split("\n") for f in functions)
    changes = [
        op for op in difflib.SequenceMatcher(None, original, mutated, autojunk=False).get_opcodes() if op[0] != "equal"
    ]
    if not changes:
        return None, "", ""
    _, i1, i2, j1, j2 = changes[0]
    old = original[i1].strip() if i1 < i2 else ""
    new = mutated[j1].strip() if j1 < j2 else ""
    def_index = next((i for i, text in enumerate(original) if re.match(r"\s*(async\s+)?def\s", text)), None)
    if def_index is None or function not in defs:
        return None, old, new
    return defs[function] + i1 - def_index, old, new


# Equivalent by construction wherever they occur, so not listed one by one in the survivors file.
CODEC_CASE = "codec names are case-insensitive (codecs.lookup): 'UTF-8' is the codec 'utf-8' names"


def equivalent_by_rule(old: str, new: str) -> str | None:
    """The reason a mutant is equivalent whatever its context, or None."""
    if new != old and old.replace('"utf-8"', '"UTF-8"') == new:
        return CODEC_CASE
    return None


def lookup(table: list[dict[str, str]], key: str, file: str, function: str, old: str, new: str) -> str | None:
    for entry in table:
        if (entry["file"], entry["function"], entry["from"], entry["to"]) == (file, function, old, new):
            return entry[key]
    return None


# Statuses counted per file but not listed mutant by mutant: thousands of them on a first run that
# stops at its wall-clock limit, and each says only "run longer" or "map a test to the function".
UNLISTED = ("not checked", "no tests")


def collect(scratch: Path, files: list[str], originals: dict[str, str], origins: dict[str, list]) -> dict:
    from mutmut.stats import status_by_exit_code

    per_file: dict[str, dict] = {}
    survivors: list[dict] = []
    here = os.getcwd()
    os.chdir(scratch)  # mutmut reads its config and files relative to the project
    try:
        for file in files:
            meta = scratch / "mutants" / (file + ".meta")
            codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
            if not codes:
                continue  # nothing to mutate (a package __init__ of imports only)
            statuses = {mutant: mutant_status(code, status_by_exit_code) for mutant, code in codes.items()}
            counts = Counter(statuses.values())
            mutated_source = (scratch / file).read_text(encoding="utf-8")
            defs = function_lines(mutated_source)
            equivalent = 0
            untested: set[str] = set()  # functions no selected test calls
            for mutant, status in sorted(statuses.items(), key=lambda item: natural(item[0])):
                _, function = mangled_parts(mutant)
                if status == "no tests":
                    untested.add(function)
                if status in DETECTED or status in UNLISTED:
                    continue  # counted per file below; only survivors are listed one by one
                scratch_line, old, new = changed_line(mutant, file, function, defs)
                line = None
                if scratch_line is not None and 0 < scratch_line < len(origins[file]):
                    line = origins[file][scratch_line]
                source_lines = originals[file].splitlines()
                if line is not None and source_lines[line - 1].strip() != old:
                    line = None  # the mapping missed: better no line than a wrong one
                reason = None
                if status == "survived":
                    reason = equivalent_by_rule(old, new) or lookup(EQUIVALENT, "reason", file, function, old, new)
                if reason:
                    equivalent += 1
                entry = {
                    "file": file,
                    "line": line,
                    "function": function,
                    "mutant": mutant.rpartition(".")[2],
                    "status": "equivalent" if reason else status,
                }
                if reason:
                    entry["reason"] = reason
                note = lookup(ACCEPTED, "note", file, function, old, new) if status == "survived" else None
                if note:
                    entry["note"] = note
                survivors.append({**entry, "from": old, "to": new})
            detected = sum(counts[s] for s in DETECTED)
            total = sum(counts.values())
            per_file[file] = {
                "total": total,
                "killed": counts["killed"],
                "timeout": counts["timeout"] + counts["segfault"],
                "survived": counts["survived"] - equivalent,
                "equivalent": equivalent,
                "no_tests": counts["no tests"],
                "not_checked": counts["not checked"],
                "other": total - detected - counts["survived"] - counts["no tests"] - counts["not checked"],
                "kill_rate": rate(detected, total - equivalent),
            }
            if untested:
                per_file[file]["untested_functions"] = sorted(untested)
    finally:
        os.chdir(here)
    return {"modules": per_file, "survivors": survivors}


def natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def rate(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def summarise(modules: dict[str, dict]) -> dict:
    keys = ("total", "killed", "timeout", "survived", "equivalent", "no_tests", "not_checked", "other")
    overall = {key: sum(m[key] for m in modules.values()) for key in keys}
    overall["kill_rate"] = rate(overall["killed"] + overall["timeout"], overall["total"] - overall["equivalent"])
    groups = {}
    for group, spec in GROUPS.items():
        members = {f: m for f, m in modules.items() if any(fnmatch.fnmatch(f, p) for p in spec["mutate"])}
        if members:
            sums = {key: sum(m[key] for m in members.values()) for key in keys}
            sums["kill_rate"] = rate(sums["killed"] + sums["timeout"], sums["total"] - sums["equivalent"])
            groups[group] = sums
    return {"groups": groups, "overall": overall}


def relabel(report: dict) -> dict:
    """``report`` with its survivors matched again against today's survivor tables (and rules):
    an entry added to "equivalent" or "accepted" takes effect without running mutmut again."""
    survivors = []
    for entry in report["survivors"]:
        entry = {key: value for key, value in entry.items() if key not in ("reason", "note")}
        if entry["status"] in ("survived", "equivalent"):
            args = (entry["file"], entry["function"], entry["from"], entry["to"])
            reason = equivalent_by_rule(entry["from"], entry["to"]) or lookup(EQUIVALENT, "reason", *args)
            entry["status"] = "equivalent" if reason else "survived"
            if reason:
                entry["reason"] = reason
            elif note := lookup(ACCEPTED, "note", *args):
                entry["note"] = note
        survivors.append(entry)
    modules = {file: dict(module) for file, module in report["modules"].items()}
    for file, module in modules.items():
        equivalent = sum(1 for s in survivors if s["file"] == file and s["status"] == "equivalent")
        module["survived"] += module["equivalent"] - equivalent
        module["equivalent"] = equivalent
        module["kill_rate"] = rate(module["killed"] + module["timeout"], module["total"] - equivalent)
    return {**report, **summarise(modules), "modules": modules, "survivors": survivors}


def merged(
    previous: dict, found: dict, groups: list[str], only_files: list[str] | None, run: dict
) -> tuple[dict, list, dict]:
    """The modules, survivors and runs of a report: ``found`` (this run's :func:`collect`) in place
    of what ``previous`` (the last report) had for the files this run stands in for, which are
    ``only_files`` (an ``--only`` run) or else every file of ``groups`` (so a file gone from a
    group leaves the report); the rest of ``previous`` kept. ``run`` is recorded for each group."""

    def replaced(file: str) -> bool:
        if file in found["modules"]:
            return True
        if only_files is not None:
            return file in only_files
        return any(fnmatch.fnmatch(file, pattern) for group in groups for pattern in GROUPS[group]["mutate"])

    modules = {f: m for f, m in previous.get("modules", {}).items() if not replaced(f)}
    modules.update(found["modules"])
    survivors = [s for s in previous.get("survivors", []) if s["file"] in modules and s["file"] not in found["modules"]]
    survivors += found["survivors"]
    runs = {g: r for g, r in previous.get("runs", {}).items() if g not in groups}
    runs.update({group: dict(run) for group in groups})
    return modules, survivors, runs


def write_report(path: Path, report: dict, private: Iterable[str] = ()) -> None:
    """``report`` as JSON at ``path``, replaced whole (a temporary file renamed), each ``private``
    path written as ``<path>``."""
    text = json.dumps(report, indent=2, ensure_ascii=False) + "\n"
    for name in private:
        text = text.replace(name, "<path>")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)


def tool_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modules",
        default=",".join(GROUPS),
        help=f"groups to run, comma-separated ({', '.join(GROUPS)}); the others keep their last results",
    )
    parser.add_argument(
        "--only",
        default="",
        help="re-run only these files of the groups, comma-separated globs (src/mta/losses/fdd.py); "
        "the groups' other files keep their last results",
    )
    parser.add_argument("--limit-min", type=float, default=25.0, help="wall-clock limit of the mutmut run (minutes)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    parser.add_argument("--output", type=Path, default=RESULT)
    parser.add_argument(
        "--relabel",
        action="store_true",
        help=f"match the survivors of --output again against {SURVIVORS.name} (no mutmut run) and rewrite it",
    )
    args = parser.parse_args(argv)
    if args.relabel:
        report = relabel(json.loads(args.output.read_text(encoding="utf-8")))
        write_report(args.output, report)
        log(f"relabelled {args.output.name}: overall kill rate {report['overall']['kill_rate']}")
        return 0
    groups = [g.strip() for g in args.modules.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; known: {', '.join(GROUPS)}")
    only = [pattern.strip() for pattern in args.only.split(",") if pattern.strip()]

    import importlib.util

    if importlib.util.find_spec("mutmut") is None:
        raise SystemExit("mutmut is not installed: `make mutate` installs it (pip install -e '.[mutate]')")
    root = Path(tempfile.mkdtemp(prefix="mta-mutation-"))
    try:
        scratch = make_scratch(root)
        env = run_environment()
        files = mutated_files(groups, scratch, only)
        if not files:
            parser.error(f"--only {args.only!r} matches no file of the groups {', '.join(groups)}")
        originals, origins = {}, {}
        for file in files:
            originals[file] = (scratch / file).read_text(encoding="utf-8")
            rewritten, origins[file] = undecorate(originals[file])
            (scratch / file).write_text(rewritten, encoding="utf-8")
        tests = select_tests(groups, scratch, env)
        write_config(scratch, files, tests)
        log(f"scratch copy: {scratch}")
        log(f"mutating {len(files)} files with {len(tests)} test files/ids; one worker, limit {args.limit_min:g} min")
        code, wall = run_mutmut(scratch, env, args.limit_min * 60)
        tail = (scratch / "mutmut.log").read_text(encoding="utf-8", errors="replace")[-3000:]
        if code not in (0, None):
            print(tail, file=sys.stderr)
            raise SystemExit(f"mutmut failed (exit {code}); its log is above")
        found = collect(scratch, files, originals, origins)
        if not any(m["total"] for m in found["modules"].values()):
            raise SystemExit("mutmut produced no mutants; its log:\n" + tail)
        empty = sorted(file for file in files if not found["modules"].get(file, {}).get("total"))
        if empty and code == 0:
            raise SystemExit(
                f"no mutant in {', '.join(empty)}: a module in scope must be mutated (a decorated or nested "
                "function mutmut skips?), or leave it out of GROUPS with its reason in EXCLUDED"
            )
        if all(m["no_tests"] == m["total"] for m in found["modules"].values()):
            raise SystemExit("no test reached a mutated function: were the scratch copy's sources imported?")

        previous = json.loads(args.output.read_text(encoding="utf-8")) if args.output.exists() else {}
        run = {"date": dt.date.today().isoformat(), "wall_s": round(wall), "completed": code == 0, "tests": tests}
        if only:
            run["only"] = files
        modules, survivors, runs = merged(previous, found, groups, files if only else None, run)
        report = {
            "benchmark": "mutation testing of the fast tests (bench/mutation.py, `make mutate`)",
            "tool": f"mutmut {tool_version()}",
            "settings": {
                "workers": 1,
                "threads": 1,
                "pytest": "-m 'not slow' -x, only the tests that call the mutated function",
                "timeout": (
                    f"wall-time limit per mutant: {TIMEOUT_MULTIPLIER:g} x (its tests' clean time + "
                    f"{TIMEOUT_CONSTANT:g} s, for the module fixtures a mutant's session builds again); "
                    "CPU time twice that"
                ),
                "kill_rate": "(killed + timeout) / (total - equivalent)",
                "decorators": (
                    "single-decorator functions rewritten to `f = D(f)` in the scratch copy so they are mutated"
                ),
                "not_mutated": "module-level constants and class attributes (mutmut mutates function bodies only)",
                "encoding": (
                    "PYTHONWARNDEFAULTENCODING=1 and EncodingWarning an error in the mutated modules, so a "
                    "text file opened with the locale's encoding fails its test"
                ),
                "equivalent_by_rule": CODEC_CASE,
                "signals": "a test process ended by a signal mutmut has no name for counts as killed, not 'suspicious'",
            },
            **summarise(modules),
            "excluded": {
                **EXCLUDED,
                **{
                    f: "no function to mutate (re-exports and constants only)" for f in functionless_files(list(GROUPS))
                },
            },
            "modules": dict(sorted(modules.items())),
            "runs": dict(sorted(runs.items())),
            "survivors": sorted(survivors, key=lambda s: (s["file"], s["line"] or 0, natural(s["mutant"]))),
        }
        write_report(args.output, report, private={str(root), str(scratch), str(REPO), str(Path.home())})
        overall = report["overall"]
        log(
            f"{overall['killed'] + overall['timeout']}/{overall['total'] - overall['equivalent']} detected "
            f"(kill rate {overall['kill_rate']}), {overall['survived']} survived, {overall['equivalent']} equivalent; "
            f"wrote {args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output}"
        )
        for group, sums in report["groups"].items():
            log(f"  {group:13s} {sums['kill_rate']}  ({sums['total']} mutants, {sums['survived']} survived)")
        return 0
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
