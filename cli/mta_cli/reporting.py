"""The library's ``Reporter`` for a person: rich bars on a terminal, plain lines in a log.

``RichReporter``: one live display for a whole command: each task the library starts gets a bar
(rows/s and tokens/s for row tasks; losses, lr, gradient norm and tokens/s for training steps),
``message`` prints above the bars, and dev records print their losses and samples.

``PlainReporter``: what a batch system's log (Slurm, ``> log``, CI) can read: whole lines, no
carriage returns, no bars, nothing wrapped. One line per train record (step/total, each loss
term, lr, gradient norm, tokens/s, elapsed, ETA), a line per dev record plus its samples,
messages as lines, and for row tasks a line every 10 % or every 30 s with rows/s and ETA.

Losses and other metrics print to 4 significant digits (``significant``), not fixed decimals.

``make_reporter`` picks one: rich when the console is a terminal (or Jupyter), plain otherwise;
``MTA_PROGRESS=plain`` or ``MTA_PROGRESS=rich`` decides instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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

from mta.errors import MtaError
from mta_cli.consoles import stderr_console

PROGRESS_ENV = "MTA_PROGRESS"
PROGRESS_STYLES = ("auto", "rich", "plain")


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


def significant(value: float | None, digits: int = 4) -> str:
    """A metric to ``digits`` significant digits (``1.235``, ``0.0123``, ``2.1e-05``, ``1.235e+04``),
    so a small loss term never reads ``0.0000``; ``-`` for a value the record holds as null."""
    return "-" if value is None else f"{value:.{digits}g}"


def loss_summary(record: dict[str, Any]) -> str:
    """``loss 1.235 · base 1 · dsa 2.1e-05 ...`` from a metrics record (``significant`` digits)."""
    parts = [f"loss {significant(record['loss'])}"]
    parts += [f"{key[5:]} {significant(value)}" for key, value in record.items() if key.startswith("loss/")]
    return " · ".join(parts)


def step_summary(record: dict[str, Any]) -> str:
    """``loss ... · lr 1.00e-04 · grad_norm 0.8312 · 5120 tok/s`` from a train record (the
    gradient norm where the record has one)."""
    text = f"{loss_summary(record)} · lr {record['lr']:.2e}"
    if "grad_norm" in record:
        text += f" · grad_norm {significant(record['grad_norm'])}"
    return text + f" · {record['tokens_per_s']:.0f} tok/s"


def utilisation_summary(record: dict[str, Any]) -> str:
    """`` · 190 GFLOP/s`` (`` · 312.4 TFLOP/s · MFU 31.6%`` on a known GPU) from a train record's
    ``flops_per_s`` and ``mfu`` (mta.training.lifecycle.utilisation); empty when the record has none."""
    flops = record.get("flops_per_s")
    if not flops:
        return ""
    if flops >= 1e12:
        text = f" · {flops / 1e12:.1f} TFLOP/s"
    else:
        text = f" · {flops / 1e9:.0f} GFLOP/s" if flops >= 1e9 else f" · {flops / 1e6:.0f} MFLOP/s"
    if record.get("mfu") is not None:
        text += f" · MFU {100 * record['mfu']:.1f}%"
    return text


def off_policy_summary(record: dict[str, Any]) -> str:
    """``τ 0.20 · gold 3 / generated 1 / buffer 0`` from an off-policy run's train record (the
    micro batches of each source since the last line; τ in adaptive mode only)."""
    counts = " / ".join(
        f"{source} {record.get(f'off_policy/{source}', 0):.0f}" for source in ("gold", "generated", "buffer")
    )
    if "off_policy/threshold" not in record:
        return counts
    return f"τ {record['off_policy/threshold']:.2f} · {counts}"


PROMPT_CHARS, GENERATION_CHARS = 240, 160  # an Alpaca template is about 130 characters


def _shortened(text: str, limit: int) -> str:
    """``text`` from its start, cut at the end with "…" when longer than ``limit``."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def sample_parts(sample: dict[str, Any]) -> tuple[str, str]:
    """A dev sample's prompt and generation as printed: each from its start, quoted (so a newline
    reads ``\\n`` and the line stays one), "…" where cut: a prompt's template, then its
    instruction, read in order."""
    return (
        repr(_shortened(sample.get("prompt", ""), PROMPT_CHARS)),
        repr(_shortened(sample.get("generation", ""), GENERATION_CHARS)),
    )


class RichReporter:
    """Use as a context manager around a command so its bars share one live display."""

    def __init__(self, console: Console | None = None):
        self.console = console or stderr_console()
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
        self._task: int | None = None

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.progress.stop()

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def start(self, description: str, total: int | None, *, completed: int = 0, unit: str = "rows") -> None:
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
                prompt, generation = sample_parts(sample)
                self.console.print(Text.assemble("  ", (prompt, "dim"), " → ", generation))
        elif self._task is not None:
            status = step_summary(record) + utilisation_summary(record)
            if "off_policy/gold" in record:
                status += " · " + off_policy_summary(record)
            self.progress.update(self._task, completed=record["step"], status=status)

    def stop(self) -> None:
        if self._task is not None:
            self.progress.stop_task(self._task)
            self._task = None


def clock_text(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded), as rich's elapsed and ETA columns."""
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class _PlainTask:
    description: str
    total: int | None
    completed: int
    unit: str
    started: float
    first: int  # units already done when the task started (a resumed run): not in the rate
    counters: dict[str, float] = field(default_factory=dict)
    last_line: float = 0.0
    last_bucket: int = -1
    printed: int = -1  # ``completed`` at the last progress line

    def rate(self, now: float) -> float | None:
        elapsed = now - self.started
        done = self.completed - self.first
        return done / elapsed if elapsed > 0 and done > 0 else None

    def timing(self, now: float) -> str:
        text = f"elapsed {clock_text(now - self.started)}"
        rate = self.rate(now)
        if self.total is not None:
            left = max(self.total - self.completed, 0)
            eta = clock_text(left / rate) if rate else ("0:00:00" if left == 0 else "?")
            text += f" · ETA {eta}"
        return text


class PlainReporter:
    """Whole lines for a log; use as a context manager like ``RichReporter``.

    Row tasks (``unit`` other than ``steps``) print a line when the task starts, whenever
    another ``every_percent`` % is done or ``every_s`` seconds have passed since the last line,
    and when it stops; training (``steps``) prints one line per ``record``.
    """

    def __init__(
        self,
        console: Console | None = None,
        *,
        every_percent: int = 10,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console = console or stderr_console()
        self.every_percent = every_percent
        self.every_s = every_s
        self.clock = clock
        self._task: _PlainTask | None = None

    def __enter__(self) -> PlainReporter:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _line(self, text: str) -> None:
        stream = self.console.file  # resolved on each call: sys.stderr may have been replaced
        stream.write(text + "\n")
        stream.flush()  # a log read while the job runs shows every line as it comes

    def message(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                self._line(line.rstrip())

    def start(self, description: str, total: int | None, *, completed: int = 0, unit: str = "rows") -> None:
        self.stop()
        now = self.clock()
        self._task = _PlainTask(description, total, completed, unit, started=now, first=completed, last_line=now)
        of = f"/{total}" if total is not None else ""
        self._line(f"{description}: {completed}{of} {unit}")
        if total:
            self._task.last_bucket = self._bucket(self._task)

    def _bucket(self, task: _PlainTask) -> int:
        return task.completed * 100 // (task.total * self.every_percent) if task.total else 0

    def advance(self, amount: int = 1, **counters: float) -> None:
        task = self._task
        if task is None:
            return
        task.completed += amount
        for name, value in counters.items():
            task.counters[name] = task.counters.get(name, 0) + value
        if task.unit == "steps":
            return  # training speaks through its records
        now = self.clock()
        bucket = self._bucket(task)
        if bucket > task.last_bucket or now - task.last_line >= self.every_s:
            task.last_bucket = bucket
            self._progress_line(task, now)

    def _progress_line(self, task: _PlainTask, now: float) -> None:
        text = f"{task.description}: {task.completed}"
        if task.total is not None:
            text += f"/{task.total} {task.unit}"
            if task.total:
                text += f" ({100 * task.completed / task.total:.0f}%)"
        else:
            text += f" {task.unit}"
        rate = task.rate(now)
        if rate is not None:
            text += f" · {rate:.2f} {task.unit}/s"
            tokens = task.counters.get("tokens", 0)
            if tokens:
                text += f" · {tokens / (now - task.started):.0f} tok/s"
        self._line(f"{text} · {task.timing(now)}")
        task.last_line, task.printed = now, task.completed

    def record(self, record: dict[str, Any]) -> None:
        if record.get("split") == "dev":
            line = f"dev @ step {record['step']}: {loss_summary(record)}"
            if "off_policy/dev_ce" in record:
                line += f" · dev_ce {significant(record['off_policy/dev_ce'])}"
            self._line(line)
            for sample in record.get("samples", []):
                self._line("  {} → {}".format(*sample_parts(sample)))
            return
        task = self._task
        step = record["step"]
        head = f"step {step}" if task is None else f"{task.description}: step {step}"
        if task is not None and task.total is not None:
            head += f"/{task.total}"
        line = f"{head} · {step_summary(record)}" + utilisation_summary(record)
        if "off_policy/gold" in record:
            line += " · " + off_policy_summary(record)
        if task is not None:
            task.completed = max(task.completed, step)
            line += " · " + task.timing(self.clock())
        self._line(line)

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and task.unit != "steps" and task.printed != task.completed:
            self._progress_line(task, self.clock())


def progress_style(console: Console) -> str:
    """``rich`` or ``plain``: ``$MTA_PROGRESS`` when it says, else whether ``console`` is a terminal."""
    chosen = os.environ.get(PROGRESS_ENV, "auto").strip().lower() or "auto"
    if chosen not in PROGRESS_STYLES:
        raise MtaError(
            f"{PROGRESS_ENV}={os.environ[PROGRESS_ENV]!r}: give one of {', '.join(PROGRESS_STYLES)} "
            "(auto: rich bars on a terminal, plain lines otherwise)"
        )
    if chosen == "auto":
        return "rich" if console.is_terminal or console.is_jupyter else "plain"
    return chosen


def make_reporter(console: Console | None = None) -> RichReporter | PlainReporter:
    """The reporter a command draws with (a context manager): see ``progress_style``."""
    console = console or stderr_console()
    return RichReporter(console) if progress_style(console) == "rich" else PlainReporter(console)
