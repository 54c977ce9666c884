"""Stopping on a signal without a training run (mta.training.lifecycle.stopping): the budget
setting, the requests and their agreement, when a SIGTERM may save, the messages. The whole runs
are in tests/test_stop_signals.py; these are what mutation testing (bench/mutation.py) needs in
seconds."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from mta.errors import MtaError
from mta.training.lifecycle import stopping
from mta.training.lifecycle.stopping import (
    TERM_BUDGET_ENV,
    RunStopped,
    StopRequests,
    launcher_warning,
    signal_name,
    term_budget_s,
)


class Clock:
    """``time.monotonic`` under the test's control."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(stopping.time, "monotonic", clock)
    return clock


def test_the_term_budget_is_20_s_unless_the_environment_gives_seconds(monkeypatch):
    monkeypatch.delenv(TERM_BUDGET_ENV, raising=False)
    assert term_budget_s() == 20.0
    for raw, value in (("  ", 20.0), ("0", 0.0), ("7.5", 7.5)):
        monkeypatch.setenv(TERM_BUDGET_ENV, raw)
        assert term_budget_s() == value
    for raw in ("-1", "nan", "soon"):
        monkeypatch.setenv(TERM_BUDGET_ENV, raw)
        with pytest.raises(MtaError) as refused:
            term_budget_s()
        assert str(refused.value) == (
            f"MTA_SIGTERM_BUDGET_S={raw!r}: give the seconds a SIGTERM may spend saving (a number >= 0)"
        )
    monkeypatch.setenv(TERM_BUDGET_ENV, "3")
    assert StopRequests().budget_s == 3.0 and StopRequests(budget_s=9.0).budget_s == 9.0


def test_a_stop_says_when_and_what_was_saved():
    saved = RunStopped("SIGUSR1", step=12, checkpoint=Path("out/step-12"))
    assert str(saved) == "stopped by SIGUSR1 after step 12: saved out/step-12"
    assert saved.saved and saved.signal_name == "SIGUSR1" and saved.step == 12 and saved.reason is None
    early = RunStopped("SIGTERM", step=None, reason="no time")
    assert str(early) == "stopped by SIGTERM before the first step: nothing saved (no time)"
    assert not early.saved and early.checkpoint is None and early.reason == "no time"
    assert str(RunStopped("SIGTERM", step=0, reason="r")).startswith("stopped by SIGTERM after step 0: ")
    assert not issubclass(RunStopped, Exception)


def test_requests_rank_by_urgency_and_remember_their_first_arrival(clock):
    requests = StopRequests(budget_s=20.0)
    assert requests.request() == 0 and requests.waited_ms() == 0 and requests.agreed_request() == (0, 0.0)
    requests._saving = True  # so a SIGTERM does not stop at once here
    requests._handle(signal.SIGUSR1, None)
    assert requests.request() == 1
    clock.now = 101.0
    requests._handle(signal.SIGTERM, None)
    clock.now = 102.5
    requests._handle(signal.SIGUSR1, None)  # a less urgent one later changes nothing
    requests._handle(signal.SIGTERM, None)  # nor does the same one again
    assert requests.request() == 2 and requests.received == {signal.SIGUSR1: 100.0, signal.SIGTERM: 101.0}
    assert requests.waited_ms() == 1500 and requests.agreed_request() == (2, 1.5)
    assert signal_name(1) == "SIGUSR1" and signal_name(2) == "SIGTERM"


def test_a_sigterm_outside_a_checkpoint_stops_at_once_when_no_checkpoint_fits(clock):
    requests = StopRequests(budget_s=20.0)
    requests.steps_done = 4
    with pytest.raises(RunStopped) as stopped:
        requests._handle(signal.SIGTERM, None)
    assert stopped.value.step == 4 and stopped.value.reason == (
        "no checkpoint written by this process yet to tell whether one fits the 20 s a SIGTERM may "
        "spend saving (MTA_SIGTERM_BUDGET_S)"
    )
    fits = StopRequests(budget_s=20.0)
    fits.last_save_s = 20.0
    fits._handle(signal.SIGTERM, None)  # exactly the budget: it waits for the step and saves
    assert fits.request() == 2
    StopRequests(budget_s=0.0)._handle(signal.SIGUSR1, None)  # a SIGUSR1 always waits


def test_a_sigterm_may_save_only_when_the_wait_and_the_last_save_fit_the_budget():
    requests = StopRequests(budget_s=10.0)
    assert requests.refusal(1, 99.0) is None and requests.refusal(0, 0.0) is None
    requests.last_save_s = 4.0
    assert requests.refusal(2, 6.0) is None
    assert requests.refusal(2, 6.5) == (
        "the last checkpoint took 4.0 s after 6.5 s finishing the step, over the 10 s a SIGTERM may "
        "spend saving (MTA_SIGTERM_BUDGET_S)"
    )
    requests.last_save_s = 10.5
    assert requests.refusal(2, 0.0) == (
        "the last checkpoint took 10.5 s, over the 10 s a SIGTERM may spend saving (MTA_SIGTERM_BUDGET_S)"
    )


def test_saving_times_the_checkpoint_and_holds_a_sigterm_until_it_is_written(clock):
    requests = StopRequests(budget_s=20.0)
    with requests.saving():
        assert requests._saving
        clock.now += 2.3456
        requests._handle(signal.SIGTERM, None)  # inside: noted, not raised
    assert not requests._saving and requests.last_save_s == 2.346 and requests.request() == 2
    with pytest.raises(RuntimeError), requests.saving():
        clock.now += 1.0
        raise RuntimeError
    assert not requests._saving and requests.last_save_s == 2.346  # a failed save times nothing


def test_installed_handles_both_signals_for_the_runs_span_on_the_main_thread_only(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGTERM)}
    requests = StopRequests(budget_s=20.0)
    with requests.installed() as same:
        assert same is requests
        os.kill(os.getpid(), signal.SIGUSR1)
        assert requests.request() == 1
    assert {signum: signal.getsignal(signum) for signum in before} == before
    other = StopRequests(budget_s=20.0)

    def in_a_thread():
        with other.installed():
            assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()


def test_installed_warns_on_rank_0_when_torchrun_does_not_forward_sigusr1(monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT")
    for rank, warned in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level("WARNING", logger=stopping.__name__), StopRequests(budget_s=1.0).installed():
            pass
        assert any("not SIGUSR1" in record.message for record in caplog.records) is warned


def test_the_launcher_warning_names_what_torchrun_forwards_and_the_fix():
    assert launcher_warning({}) is None
    assert launcher_warning({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"}) is None  # not under Slurm
    slurm = {"SLURM_JOB_ID": "1"}
    assert launcher_warning(slurm) is None  # not under torchrun
    assert launcher_warning({**slurm, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM, SIGUSR1"}) is None
    assert launcher_warning({**slurm, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT"}) == (
        "torchrun here forwards SIGTERM,SIGINT to its workers, not SIGUSR1: a SIGUSR1 from Slurm "
        "(--signal=USR1@N) ends the launcher and leaves the workers training. Launch with "
        "`torchrun --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout N`, "
        "or start one task per GPU with srun (docs/slurm.md)"
    )
