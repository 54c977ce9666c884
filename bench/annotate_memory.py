"""Benchmark: peak memory of `mta annotate` on hostile (multi-megabyte) rows and on many rows.

    python bench/annotate_memory.py [--tokenizer ../shared/tokenizers/gpt2] [--huge-mb 5]
                                    [--normal-rows 300,3000] [--reference-src DIR]

Each case is one fresh `mta annotate --workers 1` process; its peak resident set size comes from
``os.wait4`` (the process alone, interpreter and imports included), so the cases compare directly:

- ``baseline``:   the 36 example rows shipped with mta;
- ``huge_1``:     the same rows plus one row whose response is ``--huge-mb`` MB of real text;
- ``huge_4``:     the same rows plus four such rows (memory must not grow with their number);
- ``normal_N``:   the first N Dolly training rows for each N of ``--normal-rows`` (the example
  rows repeated without ../shared).

The text a model sees is cut to ``max_length`` tokens, so a huge row may cost no more than a row
at the limit: ``huge_*`` should stay within a few tens of MB of ``baseline`` (the rows themselves
are held while their chunk is annotated). Over many ordinary rows memory grows only with spaCy's
vocabulary (new word types), ever more slowly. ``--reference-src`` runs
``huge_1`` again with another checkout's ``src``/``cli`` on ``PYTHONPATH`` (e.g. the previous
release, exported with ``git archive``) to show the difference, and checks that both wrote the same
table. Results go to
bench/results/annotate_memory.json, with no machine paths in them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from itertools import cycle, islice
from pathlib import Path

from mta import distributed
from mta.files import atomic_write_json
from mta.store.layout import manifest_path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MTA_SHARED_DIR", REPO.parent / "shared"))
EXAMPLES = REPO / "recipes" / "examples" / "tiny.jsonl"
DOLLY = SHARED / "data" / "instruct" / "dolly" / "train.jsonl"
DEFAULT_TOKENIZER = SHARED / "tokenizers" / "gpt2"
RESULTS = REPO / "bench" / "results" / "annotate_memory.json"


def write_inputs(scratch: Path, huge_mb: float, normal_rows: list[int]) -> dict[str, Path]:
    examples = EXAMPLES.read_text(encoding="utf-8").splitlines()
    source = DOLLY if DOLLY.exists() else EXAMPLES
    responses = [
        json.loads(line).get("output") or json.loads(line).get("response") or ""
        for line in islice(source.open(encoding="utf-8"), 2000)
    ]
    text, size = [], 0
    for response in cycle(r for r in responses if r):  # real sentences, not one repeated word
        text.append(response)
        size += len(response) + 1
        if size >= huge_mb * 1e6:
            break
    huge = json.dumps({"instruction": "Describe it at length.", "input": "", "output": " ".join(text)})
    inputs = {
        "baseline": examples,
        "huge_1": examples + [huge],
        "huge_4": examples + [huge] * 4,
    }
    for rows in normal_rows:
        inputs[f"normal_{rows}"] = list(islice(cycle(source.read_text(encoding="utf-8").splitlines()), rows))
    paths = {}
    for name, lines in inputs.items():
        paths[name] = scratch / f"{name}.jsonl"
        paths[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def measure(data: Path, out: Path, tokenizer: Path, pythonpath: str | None = None) -> dict:
    """Peak RSS (MiB) and wall seconds of one `mta annotate` process; its row counts."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    command = [
        sys.executable,
        "-m",
        "mta_cli.main",
        "annotate",
        str(data),
        "--teacher",
        str(tokenizer),
        "--student",
        str(tokenizer),
        "--workers",
        "1",
        "-o",
        str(out),
        "--force",
    ]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    stderr = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    manifest = json.loads(manifest_path(out).read_text(encoding="utf-8"))
    return {
        "input_mb": round(data.stat().st_size / 1e6, 2),
        "rows": manifest["rows"],
        "max_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux reports KiB
        "wall_s": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=DEFAULT_TOKENIZER,
        help="teacher and student tokenizer (default: ../shared/tokenizers/gpt2)",
    )
    parser.add_argument("--huge-mb", type=float, default=5.0)
    parser.add_argument("--normal-rows", default="300,3000", help="comma-separated row counts")
    parser.add_argument(
        "--reference-src",
        type=Path,
        default=None,
        help="another checkout whose src/ and cli/ run huge_1 again, for comparison",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not (args.tokenizer / "tokenizer.json").exists():
        raise SystemExit(f"{args.tokenizer} holds no tokenizer.json (set MTA_SHARED_DIR or pass --tokenizer)")

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="mta-bench-memory-") as scratch:
        inputs = write_inputs(Path(scratch), args.huge_mb, [int(n) for n in args.normal_rows.split(",")])
        for name, data in inputs.items():
            results[name] = measure(data, Path(scratch) / f"out-{name}", args.tokenizer)
            print(name, json.dumps(results[name]), flush=True)
        reference = None
        if args.reference_src is not None:
            src = args.reference_src.resolve()
            reference = measure(
                inputs["huge_1"],
                Path(scratch) / "out-reference",
                args.tokenizer,
                pythonpath=f"{src / 'src'}{os.pathsep}{src / 'cli'}",
            )
            from mta.data.annotations import read_annotations

            reference["same_table_as_huge_1"] = read_annotations(Path(scratch) / "out-reference").table.equals(
                read_annotations(Path(scratch) / "out-huge_1").table
            )
            print("reference huge_1", json.dumps(reference), flush=True)

    baseline = results["baseline"]["max_rss_mib"]
    payload = {
        "what": "peak RSS of one `mta annotate --workers 1` process per case (os.wait4)",
        "tokenizer": args.tokenizer.name,
        "data": "dolly/train.jsonl rows" if DOLLY.exists() else "the example rows",
        "huge_response_mb": args.huge_mb,
        "cases": results,
        "rss_over_baseline_mib": {name: round(r["max_rss_mib"] - baseline, 1) for name, r in results.items()},
        "python": platform.python_version(),
        "cores": distributed.available_cores(),
    }
    if reference is not None:
        payload["reference_huge_1"] = {
            **reference,
            "source": "--reference-src (a checkout before bounded encoding and parsing)",
            "rss_over_baseline_mib": round(reference["max_rss_mib"] - baseline, 1),
        }
    atomic_write_json(args.out, payload)
    print(json.dumps(payload["rss_over_baseline_mib"]))


if __name__ == "__main__":
    main()
