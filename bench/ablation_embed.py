"""`make ablation-embed`: the ablation of TALAS's parts on demo-embed's pair (mta.embedding.ablation).

    python bench/ablation_embed.py [--plan] [--out runs/ablation-embed] [--data-dir DIR]

Prints the plan (variants, seeds, splits, the dev choice) and its time estimate; ``--plan`` stops
there. Otherwise it runs: demo-embed's encoders (``make ablation-embed`` installs them), 18
training runs on this CPU, the teacher-agreement scores on the dev and held-out texts, then
OUT/results.md (the table) and OUT/results.json. A re-run reuses every finished stage.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


class PrintReporter:
    """Messages to stderr, one line per task when it ends; nothing else."""

    def __init__(self) -> None:
        self.task: tuple[str, int | None] | None = None
        self.done = 0

    def message(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def start(self, description: str, total: int | None, *, completed: int = 0, unit: str = "rows") -> None:
        self.task, self.done = (description, total), completed

    def advance(self, amount: int = 1, **counters: float) -> None:
        self.done += amount

    def record(self, record: dict) -> None:
        pass

    def stop(self) -> None:
        if self.task is not None:
            description, total = self.task
            self.message(f"{description}: {self.done}/{total if total is not None else '?'}")
        self.task = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the plan and the estimate, run nothing")
    parser.add_argument("--out", type=Path, default=Path("runs/ablation-embed"), help="where every stage writes")
    parser.add_argument("--data-dir", type=Path, default=None, help="holds dolly/train.jsonl, dolly/dev.jsonl")
    args = parser.parse_args(argv)

    from mta.embedding.ablation import AblationSettings, plan_lines, run_ablation, table, write_report
    from mta.tables import markdown_table

    settings = AblationSettings()
    print("\n".join(plan_lines(settings, args.out)), flush=True)
    if args.plan:
        return 0
    started = time.perf_counter()
    results = run_ablation(settings, args.out, data_dir=args.data_dir, reporter=PrintReporter())
    markdown = write_report(results, args.out, time.perf_counter() - started)
    print("\n".join(markdown_table(*table(results))))
    print(f"written: {markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
