"""What a long stage tells a person, as one small protocol for annotate, distill and evaluate.

The library calls a ``Reporter``; it never draws anything itself. The command line passes one
that renders rich progress bars (``mta_cli.reporting.RichReporter``); library users and tests get
``SilentReporter``. A stage reports a sequence of tasks, each ``start`` -> ``advance``... ->
``stop``, with ``message`` lines and metrics ``record``s in between.
"""

from __future__ import annotations

from typing import Any, Protocol


class Reporter(Protocol):
    def message(self, text: str) -> None:
        """One line a person should read (what is being reused, a summary, a warning)."""

    def start(self, description: str, total: int | None, *, completed: int = 0, unit: str = "rows") -> None:
        """A task of ``total`` units (``rows``, ``steps``), ``completed`` of them already done."""

    def advance(self, amount: int = 1, **counters: float) -> None:
        """``amount`` more units of the running task; ``counters`` add up too (``tokens=...``)."""

    def record(self, record: dict[str, Any]) -> None:
        """A metrics record as written to ``metrics.jsonl`` (``split`` train or dev)."""

    def stop(self) -> None:
        """The running task ended (normally or not)."""


class SilentReporter:
    """Reports nothing: library use, tests."""

    def message(self, text: str) -> None:
        pass

    def start(self, description: str, total: int | None, *, completed: int = 0, unit: str = "rows") -> None:
        pass

    def advance(self, amount: int = 1, **counters: float) -> None:
        pass

    def record(self, record: dict[str, Any]) -> None:
        pass

    def stop(self) -> None:
        pass
