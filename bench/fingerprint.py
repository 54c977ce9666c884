"""Benchmark: what fingerprinting a checkpoint's weights costs `mta evaluate`.

    python bench/fingerprint.py [--mb 500] [--rounds 3]

`mta evaluate` hashes every weight, tokenizer and config file of a local checkpoint on every run
(``mta.models.weights``), so a rerun can tell whether the weights changed in place. This
times ``mta.hashing.file_sha256`` on one file of random bytes in the temporary directory (the
first round may read from disk, later ones from the page cache; the median of the rounds goes to
bench/results/fingerprint.json with the machine's load, since the CPU may be shared). The file
is deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from mta.files import atomic_write_json
from mta.hashing import file_sha256

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "fingerprint.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=500, help="file size in MB (10^6 bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mta-bench-fingerprint-") as scratch:
        path = Path(scratch) / "weights.bin"
        with open(path, "wb") as handle:
            for _ in range(args.mb):
                handle.write(os.urandom(10**6))
        seconds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            file_sha256(path)
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    results = {
        "file_mb": args.mb,
        "rounds": args.rounds,
        "seconds": seconds,
        "median_s": median,
        "mb_per_s": args.mb / median,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
    }
    atomic_write_json(RESULTS, results)
    print(
        f"file_sha256 on {args.mb} MB: median {median:.2f} s over {args.rounds} rounds "
        f"({args.mb / median:.0f} MB/s); wrote {RESULTS.relative_to(REPO)}"
    )


if __name__ == "__main__":
    main()
