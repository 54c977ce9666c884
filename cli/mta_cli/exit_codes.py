"""The exit codes of a command that stops before its end, one home for every command."""

from __future__ import annotations

INTERRUPTED = 130  # the shell's code for a command ended by SIGINT (128 + 2)
# SIGUSR1 (Slurm's warning before the time limit): stopped after a step with a checkpoint of it;
# a job script requeues on it (docs/slurm.md). 75 is EX_TEMPFAIL, "try again later" (sysexits.h).
STOPPED = 75
# SIGTERM, with a checkpoint when it fitted (the line says): 128 + 15, what the signal alone gives,
# so that scancel's job is not requeued by a script that requeues on STOPPED.
TERMINATED = 143


def stopped_exit_code(stopped) -> int:
    """The code for a run stopped by a signal (``mta.training.lifecycle.stopping.RunStopped``)."""
    return TERMINATED if stopped.signal_name == "SIGTERM" else STOPPED
