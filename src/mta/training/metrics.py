"""What a run reports: ``metrics.jsonl`` for tools, a rich progress bar for people.

``metrics.jsonl`` holds one JSON object per log step::

    {"split": "train", "step": 20, "loss": 3.1, "loss/base": 2.9, "loss/dsa": 0.05,
     "loss/hra": 0.4, "lr": 9.8e-05, "tokens_per_s": 5120.0, "elapsed_s": 12.3}
    {"split": "dev", "step": 100, "loss": ..., "loss/base": ..., "samples": [{"prompt": ..., "generation": ...}]}

On resume the lines past the checkpoint's step are dropped, so the file never describes steps
twice.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from mta.files import atomic_write_text
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def loss_record(split: str, step: int, losses: dict[str, float]) -> dict[str, Any]:
    """``{"split", "step", "loss": total, "loss/<component>": ...}`` from ``{"total", ...}``."""
    record: dict[str, Any] = {"split": split, "step": step, "loss": losses["total"]}
    record.update({f"loss/{name}": value for name, value in losses.items() if name != "total"})
    return record


class LossWindow:
    """Loss components and tokens since the last log line, averaged per step when logged."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.tokens = 0
        self.since = time.perf_counter()

    def add(self, step_losses: dict[str, float]) -> None:
        """One step's ``{"total", components..., "tokens"}``."""
        self.tokens += step_losses["tokens"]
        self.steps += 1
        for name, value in step_losses.items():
            if name != "tokens":
                self.sums[name] = self.sums.get(name, 0.0) + value

    def record(
        self, step: int, *, lr: float, sum_over_processes: Callable[[dict[str, float]], dict[str, float]] = dict,
        world_size: int = 1,
    ) -> dict[str, Any]:
        """The train line for ``step``: losses averaged over steps and processes, tokens summed."""
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        totals = sum_over_processes({**self.sums, "tokens": float(self.tokens)})
        tokens = totals.pop("tokens")
        record = loss_record("train", step, {k: v / (self.steps * world_size) for k, v in totals.items()})
        record["lr"] = lr
        record["tokens_per_s"] = tokens / elapsed
        return record


class Reporter(Protocol):
    """Where the loop sends what a person should see (the CLI passes ``RichReporter``)."""

    def annotation_progress(self, split: str) -> Optional[Callable[[int, int], None]]: ...
    def start(self, total_steps: int, first_step: int) -> None: ...
    def message(self, text: str) -> None: ...
    def train_step(self, record: dict[str, Any]) -> None: ...
    def dev(self, record: dict[str, Any]) -> None: ...
    def stop(self) -> None: ...


class SilentReporter:
    """Reports nothing: library use, tests."""

    def annotation_progress(self, split: str) -> None:
        return None

    def start(self, total_steps: int, first_step: int) -> None: ...
    def message(self, text: str) -> None: ...
    def train_step(self, record: dict[str, Any]) -> None: ...
    def dev(self, record: dict[str, Any]) -> None: ...
    def stop(self) -> None: ...


def _loss_summary(record: dict[str, Any]) -> str:
    parts = [f"loss {record['loss']:.4f}"]
    parts += [f"{key[5:]} {value:.4f}" for key, value in record.items() if key.startswith("loss/")]
    return " · ".join(parts)


class RichReporter:
    """A progress bar (step, loss components, lr, tokens/s, ETA) and messages above it."""

    def __init__(self, console: Optional[Console] = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[losses]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[speed]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = None

    def annotation_progress(self, split: str) -> Callable[[int, int], None]:
        """A bar for annotating ``data.<split>`` on first use (rows done, rows in all)."""
        bar = Progress(TextColumn(f"annotating {split}"), BarColumn(), TextColumn("{task.completed}/{task.total} rows"),
                       TimeRemainingColumn(), console=self.console, transient=True)
        task = bar.add_task(split, total=None)

        def update(done: int, total: int) -> None:
            if not bar.live.is_started:
                bar.start()
            bar.update(task, completed=done, total=total)
            if done >= total:
                bar.stop()

        return update

    def start(self, total_steps: int, first_step: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task(
            "distill", total=total_steps, completed=first_step, losses="", lr="-", speed="-"
        )

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def train_step(self, record: dict[str, Any]) -> None:
        self.progress.update(
            self.task, completed=record["step"], losses=_loss_summary(record),
            lr=f"{record['lr']:.2e}", speed=f"{record['tokens_per_s']:.0f}",
        )

    def dev(self, record: dict[str, Any]) -> None:
        self.console.print(f"[cyan]dev @ step {record['step']}[/]: {_loss_summary(record)}", highlight=False)
        for sample in record.get("samples", []):
            self.console.print(f"  [dim]{sample['prompt'][-60:]!r}[/] → {sample['generation'][:120]!r}", highlight=False)

    def stop(self) -> None:
        self.progress.stop()


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (flushed per line, so a crash loses at most one)."""

    def __init__(self, path: Path, resume_step: Optional[int] = None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            path.unlink(missing_ok=True)
        elif path.exists():
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        kept = [
            line for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and _parse(line) is not None and _parse(line)["step"] <= step
        ]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def _parse(line: str) -> Optional[dict[str, Any]]:
    try:
        return json.loads(line)
    except json.JSONDecodeError:  # the half-written last line of a killed run
        return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a ``metrics.jsonl``."""
    return [record for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and (record := _parse(line)) is not None]
