"""Signals a batch system sends: SIGUSR1 (Slurm's warning before the time limit) ends the step,
saves it and exits 75 with the line that resumes; SIGTERM (scancel, preemption) saves the same
way when the last checkpoint's save time fits its budget, otherwise stops at once naming the last
checkpoint, and exits 143 either way. In this process through the real entry point, then two
real processes: a SIGTERM to `mta distill`, and a SIGUSR1 to the torchrun launcher of a two-rank
run."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import subprocess_env
from fixtures.commands import files_of, only_line, run_mta, start_torchrun
from fixtures.distill import write_recipe
from mta.errors import MtaError
from mta.training.lifecycle import checkpointing, run_directory
from mta.training.lifecycle.metrics import read_metrics
from mta.training.lifecycle.stopping import TERM_BUDGET_ENV, StopRequests, launcher_warning, term_budget_s
from mta.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

FORWARD_USR1 = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


# --------------------------------------------------------------------------- the rules


def test_a_sigterm_saves_only_when_the_last_checkpoint_fits_its_budget():
    stops = StopRequests(budget_s=20)
    assert stops.refusal(1, 0.0) is None  # SIGUSR1 always saves
    assert stops.refusal(2, 0.0) == (
        "no checkpoint written by this process yet to tell whether one fits the 20 s a SIGTERM may "
        f"spend saving ({TERM_BUDGET_ENV})"
    )
    stops.last_save_s = 5.0
    assert stops.refusal(2, 15.0) is None
    assert stops.refusal(2, 15.5) == (
        f"the last checkpoint took 5.0 s after 15.5 s finishing the step, over the 20 s a SIGTERM may spend saving "
        f"({TERM_BUDGET_ENV})"
    )
    stops.last_save_s = 21.0
    assert stops.refusal(2, 0.0).startswith("the last checkpoint took 21.0 s, over the 20 s")


def test_the_budget_can_be_set_and_a_bad_one_is_refused(monkeypatch):
    assert term_budget_s() == 20.0
    monkeypatch.setenv(TERM_BUDGET_ENV, "90")
    assert StopRequests().budget_s == 90.0
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(TERM_BUDGET_ENV, bad)
        with pytest.raises(MtaError, match=f"{TERM_BUDGET_ENV}='{bad}': give the seconds"):
            term_budget_s()


def test_torchrun_under_slurm_that_does_not_forward_sigusr1_is_warned():
    slurm = {"SLURM_JOB_ID": "7"}
    assert "not SIGUSR1" in launcher_warning({**slurm, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT"})
    assert launcher_warning({**slurm, "TORCHELASTIC_SIGNALS_TO_HANDLE": FORWARD_USR1}) is None
    assert launcher_warning({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"}) is None  # not under Slurm
    assert launcher_warning(slurm) is None  # not under torchrun


# --------------------------------------------------------------------------- in this process


@pytest.fixture
def recipe(tmp_path, teacher_dir, tiny_model_dir, same_data) -> Path:
    return write_recipe(
        tmp_path / "r.yaml",
        teacher=teacher_dir,
        student=tiny_model_dir,
        annotations=same_data,
        output_dir=tmp_path / "run",
        data={"dev": None},
        train={"max_steps": 6, "save_interval": 2},
    )


def signal_after_step(monkeypatch, index: int, signum: int, seen: dict | None = None) -> None:
    """Send ``signum`` to this process when step ``index`` (0-based) has run, its checkpoints'
    bytes into ``seen`` first; only while mta's handler is installed (never this test's death)."""
    original = Trainer.step

    def step(self, step):
        losses = original(self, step)
        if step == index:
            handler = signal.getsignal(signum)
            assert isinstance(getattr(handler, "__self__", None), StopRequests), handler
            if seen is not None:
                seen.update(files_of(self.run.output_dir / "checkpoints"))
            os.kill(os.getpid(), signum)
        return losses

    monkeypatch.setattr(Trainer, "step", step)


def train_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [r["step"] for r in read_metrics(path) if r["split"] == "train"] if path.exists() else []


def assert_no_leftovers(out: Path) -> None:
    assert not (out / "final").exists() and not (out / run_directory.RUN_LOCK).exists()
    assert not list((out / "checkpoints").glob("*.partial"))


def test_sigusr1_saves_the_step_it_ends_exits_75_and_the_line_resumes(recipe, monkeypatch, capsys):
    out = recipe.parent / "run"
    with monkeypatch.context() as patched:
        signal_after_step(patched, 2, signal.SIGUSR1)
        code, lines = run_mta(patched, capsys, "distill", "--recipe", recipe)
    assert code == 75, "\n".join(lines[-20:])
    checkpoint = out / "checkpoints" / "step-3"
    line = only_line(lines, "stopped by ")
    assert line.startswith(f"stopped by SIGUSR1 after step 3: saved {checkpoint}; resume with: ")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-3"]
    checkpointing.verify_checkpoint(checkpoint)
    assert train_steps(out) == [1, 2, 3]
    assert_no_leftovers(out)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # given back when the run ended

    command = line.split("; resume with: ")[1]
    assert shlex.split(command) == ["mta", "distill", "--recipe", str(recipe), "--resume", "auto"]
    code, lines = run_mta(monkeypatch, capsys, *shlex.split(command)[1:])
    assert code == 0, "\n".join(lines[-20:])
    assert f"resumed from {checkpoint} at step 3" in "\n".join(lines)
    assert train_steps(out) == [1, 2, 3, 4, 5, 6]
    assert (out / "final" / "model.safetensors").exists() and not (out / run_directory.RUN_LOCK).exists()


@pytest.mark.parametrize("case", ["over the budget", "no checkpoint timed yet"])
def test_a_sigterm_without_time_to_save_exits_143_at_once_naming_the_last_checkpoint(case, recipe, monkeypatch, capsys):
    out = recipe.parent / "run"
    seen: dict[str, bytes] = {}
    index = 2 if case == "over the budget" else 0  # after step-2 was saved (and timed), or before
    if case == "over the budget":
        monkeypatch.setenv(TERM_BUDGET_ENV, "0")
    with monkeypatch.context() as patched:
        signal_after_step(patched, index, signal.SIGTERM, seen)
        code, lines = run_mta(patched, capsys, "distill", "--recipe", recipe)
    assert code == 143, "\n".join(lines[-20:])
    line = only_line(lines, "stopped by ")
    if case == "over the budget":
        why = rf"the last checkpoint took \d+\.\d s, over the 0 s a SIGTERM may spend saving \({TERM_BUDGET_ENV}\)"
        where = f"last complete checkpoint {out / 'checkpoints' / 'step-2'} (step 2)"
    else:
        why = r"no checkpoint written by this process yet to tell whether one fits the 20 s .*"
        where = f"no complete checkpoint yet under {out / 'checkpoints'}"
    assert re.fullmatch(
        rf"stopped by SIGTERM without saving \({why}\): {re.escape(where)}; resume with: .* --resume auto", line
    ), line
    assert files_of(out / "checkpoints") == seen  # nothing written since the signal, nothing removed
    assert train_steps(out) == list(range(1, index + 1))  # the step it was in is not logged
    assert_no_leftovers(out)


def test_a_sigterm_while_a_checkpoint_is_written_lets_it_finish(recipe, monkeypatch, capsys):
    """The first checkpoint has no measured time yet: the signal arrives inside it and waits."""
    out = recipe.parent / "run"
    original = checkpointing.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(checkpointing, "save_checkpoint", save_checkpoint)
        code, lines = run_mta(patched, capsys, "distill", "--recipe", recipe)
    assert code == 143, "\n".join(lines[-20:])
    checkpoint = out / "checkpoints" / "step-2"
    assert only_line(lines, "stopped by ").startswith(f"stopped by SIGTERM after step 2: saved {checkpoint}; ")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    checkpointing.verify_checkpoint(checkpoint)
    assert train_steps(out) == [1, 2]
    assert_no_leftovers(out)


# --------------------------------------------------------------------------- real processes


def wait_for(path: Path, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def assert_stopped_at_a_checkpoint(out: Path, line: str, prefix: str, suffix: str) -> None:
    """``line`` names the checkpoint written on the signal; it is whole, the metrics end there."""
    match = re.fullmatch(rf"{re.escape(prefix)}(\d+): saved (\S+); {re.escape(suffix)}", line)
    assert match, line
    step, checkpoint = int(match.group(1)), Path(match.group(2))
    assert checkpoint == out / "checkpoints" / f"step-{step}" and step >= 1
    checkpointing.verify_checkpoint(checkpoint)
    assert checkpointing.latest_checkpoint(out) == checkpoint
    assert train_steps(out) == list(range(1, step + 1))  # each step once
    assert_no_leftovers(out)


@pytest.mark.slow
def test_sigterm_to_a_training_distill_saves_then_exits_143(tmp_path, tiny_run_recipe):
    out = tmp_path / "run"
    recipe = tiny_run_recipe(
        out,
        data={"dev": None},
        train={"max_steps": 400, "save_interval": 1},
    )
    log = tmp_path / "distill.log"  # a file, not a pipe: a full pipe would stall the run
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "mta_cli.main", "distill", "--recipe", str(recipe)],
            env=subprocess_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(out / "checkpoints" / "step-1" / "trainer_state.json", process, log)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = log.read_text().splitlines()
    assert process.returncode == 143, "\n".join(lines[-30:])
    line = only_line(lines, "stopped by ")
    command = shlex.join(["mta", "distill", "--recipe", str(recipe), "--resume", "auto"])
    assert_stopped_at_a_checkpoint(out, line, "stopped by SIGTERM after step ", f"resume with: {command}")
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_sigusr1_to_the_torchrun_launcher_stops_both_ranks_after_one_checkpoint(tmp_path, tiny_run_recipe):
    """torchrun forwards SIGUSR1 only when told (--signals-to-handle); both ranks then stop after
    the same step, rank 0 prints the line, and the launcher exits 1 as it does after any signal."""
    out = tmp_path / "run"
    recipe = tiny_run_recipe(
        out,
        data={"dev": None},
        train={"max_steps": 400, "save_interval": 1},
    )
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as output:
        process = start_torchrun(
            ["-m", "mta_cli.main", "distill", "--recipe", recipe],
            output=output,
            launcher_args=["--signals-to-handle", FORWARD_USR1],
        )
    try:
        wait_for(out / "checkpoints" / "step-1" / "trainer_state.json", process, log)
        process.send_signal(signal.SIGUSR1)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:  # a hang: the launcher and every worker
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    lines = log.read_text().splitlines()
    assert process.returncode == 1, "\n".join(lines[-30:])
    assert "got signal: 10" in log.read_text()  # torchrun's own account: it forwarded SIGUSR1
    line = only_line(lines, "stopped by ")
    command = shlex.join(["mta", "distill", "--recipe", str(recipe), "--resume", "auto"])
    suffix = f"resume with (under the same launcher): {command}"
    assert_stopped_at_a_checkpoint(out, line, "stopped by SIGUSR1 after step ", suffix)
