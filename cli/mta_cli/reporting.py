"""``RichReporter``: the library's ``Reporter`` drawn as rich progress bars and lines.

One live display for a whole command: each task the library starts gets a bar (rows/s and
tokens/s for row tasks; losses, lr and tokens/s for training steps), ``message`` prints above
the bars, and dev records print their losses and samples.
"""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class _StatusColumn(ProgressColumn):
    """Rates of a row task, or the latest losses / lr / tokens per second of a training run."""

    def render(self, task: Task) -> Text:
        if task.fields.get("status"):
            return Text(task.fields["status"], style="cyan")
        elapsed = task.elapsed or 0.0
        if elapsed <= 0 or not task.completed:
            return Text("")
        rate = f"{task.completed / elapsed:.2f} {task.fields.get('unit', 'rows')}/s"
        tokens = task.fields.get("tokens", 0)
        return Text(rate + (f" · {tokens / elapsed:.0f} tok/s" if tokens else ""), style="cyan")


def loss_summary(record: dict[str, Any]) -> str:
    """``loss 1.2345 · base 1.0000 · dsa ...`` from a metrics record."""
    parts = [f"loss {record['loss']:.4f}"]
    parts += [f"{key[5:]} {value:.4f}" for key, value in record.items() if key.startswith("loss/")]
    return " · ".join(parts)


def generation_summary(record: dict[str, Any]) -> str:
    """``τ 0.20 · gold 3 / generated 1 / buffer 0`` from an off-policy run's train record (the
    micro batches of each source since the last line; τ in adaptive mode only)."""
    counts = " / ".join(
        f"{source} {record.get(f'generation/{source}', 0):.0f}" for source in ("gold", "generated", "buffer")
    )
    if "generation/threshold" not in record:
        return counts
    return f"τ {record['generation/threshold']:.2f} · {counts}"


class RichReporter:
    """Use as a context manager around a command so its bars share one live display."""

    def __init__(self, console: Optional[Console] = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _StatusColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task: Optional[int] = None

    def __enter__(self) -> "RichReporter":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.progress.stop()

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def start(self, description: str, total: Optional[int], *, completed: int = 0, unit: str = "rows") -> None:
        self.stop()
        if not self.progress.live.is_started:
            self.progress.start()
        self._task = self.progress.add_task(
            description, total=total, completed=completed, unit=unit, tokens=0, status=""
        )

    def advance(self, amount: int = 1, **counters: float) -> None:
        if self._task is None:
            return
        fields = self.progress.tasks[self._task].fields
        self.progress.update(
            self._task, advance=amount, **{name: fields.get(name, 0) + value for name, value in counters.items()}
        )

    def record(self, record: dict[str, Any]) -> None:
        if record.get("split") == "dev":
            self.console.print(f"[cyan]dev @ step {record['step']}[/]: {loss_summary(record)}", highlight=False)
            for sample in record.get("samples", []):
                self.console.print(
                    f"  [dim]{sample['prompt'][-60:]!r}[/] → {sample['generation'][:120]!r}", highlight=False
                )
        elif self._task is not None:
            status = f"{loss_summary(record)} · lr {record['lr']:.2e} · {record['tokens_per_s']:.0f} tok/s"
            if "generation/gold" in record:
                status += " · " + generation_summary(record)
            self.progress.update(self._task, completed=record["step"], status=status)

    def stop(self) -> None:
        if self._task is not None:
            self.progress.stop_task(self._task)
            self._task = None
