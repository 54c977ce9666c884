"""Stopping a run on a signal: at a step boundary, with a checkpoint when there is time for one.

- **SIGUSR1** (what Slurm's ``--signal=USR1@N`` sends N seconds before the time limit): every rank
  finishes the current optimizer step (its log line, dev evaluation and scheduled checkpoint
  included), the run writes a checkpoint of that step and stops: ``RunStopped`` with
  ``checkpoint`` set.
- **SIGTERM** (``scancel``, preemption, ``timeout``; Slurm sends SIGKILL ``KillWait`` = 30 s
  later, torchrun after its ``--shutdown-timeout``, 30 s): the same, only when the checkpoint fits
  the budget (``TERM_BUDGET_S``, 20 s; ``MTA_SIGTERM_BUDGET_S`` sets another): the time from the
  signal to the end of the step plus the last checkpoint's measured save time. Otherwise (no
  checkpoint timed yet in this process, or the last one too slow) it stops at once, where it is:
  ``RunStopped`` without ``checkpoint``; the last complete checkpoint is what ``--resume auto``
  continues from.
- A signal that arrives while a checkpoint is being written lets that checkpoint finish.

The ranks agree after every step (``agreed_request``: the largest request of any rank), so a
signal that reaches some ranks only stops all of them after the same step, and none writes before
all have stopped. ``mta distill`` exits 75 after a SIGUSR1 and 143 after a SIGTERM, saved or not
(``mta_cli.commands.distill``; docs/slurm.md has a job script that requeues on 75).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from mta import distributed
from mta.errors import MtaError

log = logging.getLogger(__name__)

TERM_BUDGET_S = 20.0  # a SIGTERM saves only when that fits in this (Slurm's default KillWait: 30 s)
TERM_BUDGET_ENV = "MTA_SIGTERM_BUDGET_S"
# The requests in order of urgency: the agreed request is the largest any rank holds.
REQUESTS = {0: None, 1: signal.SIGUSR1, 2: signal.SIGTERM}
_CODES: dict[int, int] = {int(signum): code for code, signum in REQUESTS.items() if signum is not None}
TORCHRUN_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # what torchrun forwards to its workers


def term_budget_s() -> float:
    """``TERM_BUDGET_S``, or ``MTA_SIGTERM_BUDGET_S`` (seconds, at least 0) where it is set."""
    raw = os.environ.get(TERM_BUDGET_ENV)
    if raw is None or not raw.strip():
        return TERM_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN included
        raise MtaError(f"{TERM_BUDGET_ENV}={raw!r}: give the seconds a SIGTERM may spend saving (a number >= 0)")
    return value


class RunStopped(BaseException):
    """The run stopped on a signal. ``checkpoint``: the one written for it (None: it stopped at once,
    without saving; ``reason`` says why). ``step``: optimizer steps completed (None: before the first
    step of this process ended).

    A ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` on the way swallows it."""

    def __init__(
        self, signal_name: str, *, step: int | None, checkpoint: Path | None = None, reason: str | None = None
    ) -> None:
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint
        self.reason = reason
        where = f"after step {step}" if step is not None else "before the first step"
        what = f"saved {checkpoint}" if checkpoint is not None else f"nothing saved ({reason})"
        super().__init__(f"stopped by {signal_name} {where}: {what}")

    @property
    def saved(self) -> bool:
        return self.checkpoint is not None


class StopRequests:
    """The signals a run has received, and how long a checkpoint takes, for the run loop to act on.

    ``installed()`` handles SIGUSR1 and SIGTERM while the run lasts (main thread only; elsewhere
    nothing is installed and no request ever arrives). The loop calls ``agreed_request`` after
    every step (every rank, a collective), writes checkpoints inside ``saving()``, and sets
    ``steps_done``.
    """

    def __init__(self, budget_s: float | None = None) -> None:
        self.budget_s = term_budget_s() if budget_s is None else budget_s
        self.signum: int | None = None
        self.received: dict[int, float] = {}  # signal -> time.monotonic() of its first arrival
        self.last_save_s: float | None = None  # the slowest rank's time for the last checkpoint
        self.steps_done: int | None = None
        self._saving = False

    @contextmanager
    def installed(self) -> Iterator[StopRequests]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {signum: signal.signal(signum, self._handle) for signum in _CODES}
        if os.environ.get("RANK", "0") == "0" and (warning := launcher_warning()) is not None:
            log.warning(warning)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.setdefault(signum, time.monotonic())
        if self.signum is None or _CODES[signum] > _CODES[self.signum]:
            self.signum = signum
        if signum == signal.SIGTERM and not self._saving:
            reason = self.refusal(_CODES[signum], 0.0)
            if reason is not None:
                raise RunStopped(signal.Signals(signum).name, step=self.steps_done, reason=reason)

    def request(self) -> int:
        """This rank's request: 0 (none), 1 (SIGUSR1), 2 (SIGTERM)."""
        return 0 if self.signum is None else _CODES[self.signum]

    def waited_ms(self) -> int:
        """Milliseconds since the signal of this rank's request first arrived (0: none)."""
        if self.signum is None:
            return 0
        return round((time.monotonic() - self.received[self.signum]) * 1000)

    def agreed_request(self) -> tuple[int, float]:
        """Every rank's call after a step: the most urgent request of any rank (``REQUESTS``) and,
        when there is one, the longest any rank has waited since its signal (seconds)."""
        code = distributed.max_over_ranks(self.request())
        if not code:
            return 0, 0.0
        return code, distributed.max_over_ranks(self.waited_ms()) / 1000

    def refusal(self, code: int, waited_s: float) -> str | None:
        """Why a stop on request ``code`` may not write a checkpoint now (None: it may)."""
        if REQUESTS[code] != signal.SIGTERM:
            return None
        budget = f"the {self.budget_s:g} s a SIGTERM may spend saving ({TERM_BUDGET_ENV})"
        if self.last_save_s is None:
            return f"no checkpoint written by this process yet to tell whether one fits {budget}"
        if waited_s + self.last_save_s > self.budget_s:
            spent = f" after {waited_s:.1f} s finishing the step" if waited_s else ""
            return f"the last checkpoint took {self.last_save_s:.1f} s{spent}, over {budget}"
        return None

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Write a checkpoint inside: a SIGTERM waits for it; its time (the slowest rank's, every
        rank calls) becomes ``last_save_s``."""
        started = time.monotonic()
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
        self.last_save_s = distributed.max_over_ranks(round((time.monotonic() - started) * 1000)) / 1000


def signal_name(code: int) -> str:
    signum = REQUESTS[code]
    assert signum is not None, "code 0 is no request"
    return signal.Signals(signum).name


def launcher_warning(environ: Any = None) -> str | None:
    """Under Slurm and torchrun: a warning when torchrun does not forward SIGUSR1 to its workers
    (by default it does not: the signal ends the launcher and leaves the workers running)."""
    environ = os.environ if environ is None else environ
    forwarded = environ.get(TORCHRUN_SIGNALS)
    if forwarded is None or "SLURM_JOB_ID" not in environ:
        return None
    if "SIGUSR1" in {name.strip() for name in forwarded.split(",")}:
        return None
    return (
        f"torchrun here forwards {forwarded} to its workers, not SIGUSR1: a SIGUSR1 from Slurm "
        "(--signal=USR1@N) ends the launcher and leaves the workers training. Launch with "
        "`torchrun --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout N`, "
        "or start one task per GPU with srun (docs/slurm.md)"
    )
