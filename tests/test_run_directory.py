"""One run per output_dir: another run's outputs are never pruned, resumed or overwritten by
accident, two runs never train into one directory at once (a lock), --overwrite removes links as
links, a start that failed before its first step is taken over, and a step that leaves
non-finite weights is never saved."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import multiprocessing
import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from fixtures.commands import files_of, only_line, run_mta
from fixtures.distill import weights, write_recipe
from mta.errors import MtaError
from mta.files import exclusive_lock
from mta.training.config.loading import load_recipe
from mta.training.lifecycle import checkpointing, run_directory
from mta.training.lifecycle.checkpointing import TrainerState, prune_checkpoints
from mta.training.lifecycle.metrics import read_metrics
from mta.training.trainer import NonFiniteWeights, Trainer, run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _used_directory(root: Path) -> Path:
    """An output_dir as a finished run leaves it, plus the caches any run may reuse."""
    out = root / "run"
    for name in ("checkpoints/step-40", "checkpoints/step-48", "final", "data/train", "models/tokenizer-512-abc"):
        (out / name).mkdir(parents=True)
        (out / name / "file").write_text(name)
    (out / "metrics.jsonl").write_text('{"split": "train", "step": 48, "loss": 1.0}\n')
    (out / "run.json").write_text(json.dumps({"run_id": "old-run"}))
    return out


def _complete_checkpoint(path: Path, run_id: str) -> Path:
    """A directory ``complete_checkpoints`` lists (its state file), as far as claiming looks."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": 1, "total_steps": 9, "rng": [], "run_id": run_id}))
    return path


def test_a_new_run_into_a_used_directory_is_refused_and_touches_nothing(tmp_path):
    out = _used_directory(tmp_path)
    before = _files(out)
    with pytest.raises(MtaError) as error:
        run_directory.claim(out, "test", resume=None, overwrite=False)
    message = str(error.value)
    assert str(out) in message and "--resume auto" in message and "--overwrite" in message
    assert "checkpoints/" in message and "final/" in message and "metrics.jsonl" in message
    assert (
        f"{out} holds another run's outputs (run.json, checkpoints/, final/, metrics.jsonl) (run old-run); " in message
    )
    # Its step-N directories have no state file: the message says a resume would start over.
    assert f"it has no complete checkpoint under {out / 'checkpoints'}, so --resume auto would start it" in message
    assert _files(out) == before and not (out / run_directory.RUN_LOCK).exists()
    _complete_checkpoint(out / "checkpoints" / "step-48", "old-run")
    with pytest.raises(
        MtaError, match=f"its last complete checkpoint is {out / 'checkpoints' / 'step-48'} \\(step 48\\)"
    ):
        run_directory.claim(out, "test", resume=None, overwrite=False)


def test_overwrite_removes_the_run_outputs_and_keeps_the_caches(tmp_path):
    out = _used_directory(tmp_path)
    owner = run_directory.claim(out, "test", resume=None, overwrite=True)
    assert not owner.continued and owner.run_id != "old-run"
    assert sorted(p.name for p in out.iterdir()) == [run_directory.RUN_LOCK, "data", "models", "run.json"]
    run_directory.release(out)
    assert sorted(p.name for p in out.iterdir()) == ["data", "models", "run.json"]
    assert (out / "data" / "train" / "file").read_text() == "data/train"
    assert json.loads((out / "run.json").read_text())["run_id"] == owner.run_id


def test_resume_continues_the_run_that_owns_the_directory(tmp_path):
    out = _used_directory(tmp_path)
    before = _files(out)
    owner = run_directory.claim(out, "test", resume="auto", overwrite=False)
    run_directory.release(out)
    assert owner.continued and owner.run_id == "old-run"
    assert _files(out) == before
    with pytest.raises(MtaError, match="give one of them"):
        run_directory.claim(out, "test", resume="auto", overwrite=True)


def test_an_empty_or_cache_only_directory_starts_a_run(tmp_path):
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    (out / "checkpoints").mkdir()
    first = run_directory.claim(out, "test", resume=None, overwrite=False)
    run_directory.release(out)
    assert not first.continued and (out / "run.json").exists()
    # --resume auto on a directory without checkpoints continues nothing: same run, no refusal.
    assert run_directory.claim(out, "test", resume="auto", overwrite=False).run_id == first.run_id
    run_directory.release(out)


# --------------------------------------------------------------------------- the lock


def test_a_second_run_is_refused_while_another_holds_the_directory(tmp_path):
    """A fresh run, a --resume of the same run (a job submitted twice) and an --overwrite are all
    refused naming the holder, and touch nothing; once it is gone the resume goes on."""
    out = _used_directory(tmp_path)
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    with exclusive_lock(out / run_directory.RUN_LOCK, wait_s=0):  # another open file: flock refuses it
        before = _files(out)
        for resume, overwrite in ((None, False), ("auto", False), (None, True)):
            with pytest.raises(MtaError) as error:
                run_directory.claim(out, "test", resume=resume, overwrite=overwrite)
            message = str(error.value)
            assert message.startswith(f"another `mta distill` ({holder}) is training into {out} (it holds ")
            assert "give this run another output_dir" in message
        assert _files(out) == before
    assert not (out / run_directory.RUN_LOCK).exists()
    assert run_directory.claim(out, "test", resume="auto", overwrite=False).continued
    run_directory.release(out)
    assert not (out / run_directory.RUN_LOCK).exists()


def _claim_behind(out: Path, start, end, results) -> None:
    """One of two runs started together: claim behind a barrier, report, hold until both did."""
    start.wait()
    try:
        results.put("claimed " + run_directory.claim(out, "test", resume=None, overwrite=False).run_id)
    except MtaError as error:
        results.put("refused " + str(error))
    end.wait()  # the winner still holds the directory while the other claims


def test_two_runs_started_together_never_both_claim_the_directory(tmp_path):
    context = multiprocessing.get_context("fork")
    for trial in range(10):
        out = tmp_path / f"run-{trial}"
        start, end, results = context.Barrier(2), context.Barrier(2), context.Queue()
        processes = [context.Process(target=_claim_behind, args=(out, start, end, results)) for _ in range(2)]
        for process in processes:
            process.start()
        outcomes = sorted(results.get(timeout=60) for _ in processes)
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
        assert outcomes[0].startswith("claimed "), outcomes
        # In so close a race the winner may hold the lock before it has written its pid there.
        holder = r"\(pid \d+ on \S+\)|\(a process that has not written its pid yet\)"
        assert re.match(
            rf"refused another `mta distill` ({holder}) is training into {re.escape(str(out))} ", outcomes[1]
        )
        assert json.loads((out / "run.json").read_text())["run_id"] == outcomes[0].split()[1]


def test_without_flock_a_run_warns_once_and_goes_on(tmp_path, monkeypatch, caplog):
    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        first = run_directory.claim(out, "test", resume=None, overwrite=False)
        run_directory.release(out)
        again = run_directory.claim(out, "test", resume="auto", overwrite=False)
        run_directory.release(out)
    assert again.run_id == first.run_id
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"{out} does not support file locks (No locks available): nothing keeps a second")
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]
    # Only run.json, as a failed start leaves it, but also as a run still loading its models
    # does: without a lock it is not taken over; the refusal gives the way on.
    with pytest.raises(MtaError, match="no complete checkpoint under .*, so --resume auto would start it again"):
        run_directory.claim(out, "test", resume=None, overwrite=False)


# --------------------------------------------------------------------------- removing


def test_overwrite_removes_linked_outputs_as_links_and_keeps_what_they_point_to(tmp_path, caplog):
    out = _used_directory(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "final", elsewhere / "final")
    shutil.rmtree(out / "final")
    (out / "final").symlink_to(elsewhere / "final")  # a link to a directory
    _complete_checkpoint(elsewhere / "step-8", "old-run")
    (out / "checkpoints" / "step-8").symlink_to(elsewhere / "step-8")  # a link inside checkpoints/
    (out / "best").symlink_to(elsewhere / "gone")  # a dangling link is an output too
    (out / "tensorboard").symlink_to(elsewhere / "final" / "file")  # a link to a file
    kept = _files(elsewhere)
    with pytest.raises(MtaError) as error:
        run_directory.claim(out, "test", resume=None, overwrite=False)
    assert f"final (a link to {elsewhere / 'final'})" in str(error.value)
    assert f"best (a link to {elsewhere / 'gone'})" in str(error.value)
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        run_directory.claim(out, "test", resume=None, overwrite=True)
    run_directory.release(out)
    assert sorted(p.name for p in out.iterdir()) == ["data", "models", "run.json"]
    assert _files(elsewhere) == kept
    assert f"removed the link {out / 'final'}; {elsewhere / 'final'}, what it points to, is kept" in caplog.text


def test_overwrite_that_cannot_remove_one_output_removes_none(tmp_path, monkeypatch):
    out = _used_directory(tmp_path)
    before = _files(out)
    stuck = out / "checkpoints" / "step-48"
    allowed = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != stuck and allowed(path, mode, **kw))
    with pytest.raises(MtaError) as error:
        run_directory.claim(out, "test", resume=None, overwrite=True)
    assert str(error.value) == (
        f"cannot remove the outputs of the run in {out}: {stuck} is not readable and writable by this user. "
        "Nothing was removed; make them removable, or choose another output_dir"
    )
    assert _files(out) == before and not (out / run_directory.RUN_LOCK).exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may remove anything: no permission to miss")
def test_overwrite_into_a_read_only_checkpoint_removes_none(tmp_path):
    out = _used_directory(tmp_path)
    before = _files(out)
    stuck = out / "checkpoints" / "step-40"
    stuck.chmod(0o555)
    try:
        with pytest.raises(MtaError, match=f"{stuck} is not readable and writable by this user"):
            run_directory.claim(out, "test", resume=None, overwrite=True)
        assert _files(out) == before
    finally:
        stuck.chmod(0o755)


def test_pruning_removes_a_linked_checkpoint_as_a_link_and_names_one_it_cannot(tmp_path, monkeypatch, caplog):
    root = tmp_path / "out" / "checkpoints"
    elsewhere = _complete_checkpoint(tmp_path / "elsewhere" / "step-2", "this")
    root.mkdir(parents=True)
    (root / "step-2").symlink_to(elsewhere)
    for step in (4, 6, 8):
        _complete_checkpoint(root / f"step-{step}", "this")
    kept = _files(elsewhere)
    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        prune_checkpoints(root, TrainerState(6, 9, run_id="this"), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6", "step-8"]
    assert _files(elsewhere) == kept
    assert f"pruned {root / 'step-2'}, a link: the link was removed, {elsewhere} (what it points to) is kept" in (
        caplog.text
    )

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(checkpointing, "remove_path", refuse)
    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        prune_checkpoints(root, TrainerState(8, 9, run_id="this"), keep=2)
    assert f"could not prune {root / 'step-4'} (Permission denied): it stays until removed by hand" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6", "step-8"]


# --------------------------------------------------------------------------- a failed start


def _failed_start(root: Path, metrics: str = '{"split": "dev", "step": 0, "loss": 2.0}\n') -> Path:
    """What a run that died in its first step leaves: run.json, the step-0 dev line, caches."""
    out = root / "run"
    (out / "data" / "train").mkdir(parents=True)
    (out / "checkpoints").mkdir()
    (out / "run.json").write_text(json.dumps({"run_id": "failed", "recipe": "test", "started": "2026-01-01T00:00:00"}))
    (out / "metrics.jsonl").write_text(metrics)
    return out


def test_a_failed_start_is_taken_over_and_the_log_says_so(tmp_path, caplog):
    out = _failed_start(tmp_path)
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        owner = run_directory.claim(out, "test", resume=None, overwrite=False)
    run_directory.release(out)
    assert not owner.continued and owner.run_id != "failed"
    assert caplog.messages == [
        f"{out} holds only the start of run failed (recipe test, started 2026-01-01T00:00:00), which ended "
        "before its first step (no checkpoint, no train metrics): this run takes the directory over and "
        "removes run.json, metrics.jsonl"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "data", "run.json"]
    assert json.loads((out / "run.json").read_text())["run_id"] == owner.run_id


@pytest.mark.parametrize("left", ["a train record", "a partial checkpoint", "final/"])
def test_a_start_that_got_further_is_another_run(tmp_path, left):
    out = _failed_start(tmp_path)
    if left == "a train record":
        with open(out / "metrics.jsonl", "a") as handle:
            handle.write('{"split": "train", "step": 1, "loss": 1.9}\n')
    elif left == "a partial checkpoint":
        (out / "checkpoints" / "step-2.partial").mkdir()
    else:
        (out / "final").mkdir()
    before = _files(out)
    with pytest.raises(MtaError, match="holds another run's outputs .* it has no complete checkpoint under"):
        run_directory.claim(out, "test", resume=None, overwrite=False)
    assert _files(out) == before


def test_the_same_command_after_a_start_that_failed_runs(tmp_path, monkeypatch, capsys, caplog, tiny_run_recipe):
    """The reported case: the first step fails (here an out-of-memory error), the same command again trains."""
    out = tmp_path / "run"
    recipe = tiny_run_recipe(
        out,
        data={"dev": None},
        train={"max_steps": 2},
    )

    def out_of_memory(self, step):
        raise RuntimeError("CUDA out of memory (a test)")

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "step", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            run_mta(patched, capsys, "distill", "--recipe", recipe)
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # and no lock left behind
    failed = json.loads((out / "run.json").read_text())["run_id"]
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        code, lines = run_mta(monkeypatch, capsys, "distill", "--recipe", recipe)
    assert code == 0, "\n".join(lines[-20:])
    assert f"{out} holds only the start of run {failed} (recipe test, started " in caplog.text
    assert only_line(lines, "done: ").startswith(f"done: {out / 'final'}")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"] == [1, 2]


# --------------------------------------------------------------------------- the command's refusals


def test_the_command_refuses_a_held_directory_and_one_it_cannot_clear_in_one_line(
    tmp_path, teacher_dir, tiny_model_dir, same_data, monkeypatch, capsys
):
    """Exit code 2, one line, nothing on disk changed: a directory another run holds (fresh
    and --resume auto), one holding another run's outputs, and an --overwrite that cannot remove them."""
    out = _used_directory(tmp_path)
    recipe = write_recipe(
        tmp_path / "r.yaml", teacher=teacher_dir, student=tiny_model_dir, annotations=same_data, output_dir=out
    )
    before = files_of(out)
    with exclusive_lock(out / run_directory.RUN_LOCK, wait_s=0):
        for extra in ([], ["--resume", "auto"]):
            code, lines = run_mta(monkeypatch, capsys, "distill", "--recipe", recipe, *extra)
            assert code == 2
            line = only_line(lines, "error: ")
            assert line.startswith(f"error: another `mta distill` (pid {os.getpid()} on {socket.gethostname()}) ")
            assert files_of(out) == {**before, run_directory.RUN_LOCK: (out / run_directory.RUN_LOCK).read_bytes()}

    code, lines = run_mta(monkeypatch, capsys, "distill", "--recipe", recipe)
    assert code == 2
    assert only_line(lines, "error: ").startswith(f"error: {out} holds another run's outputs (run.json, checkpoints/")
    assert files_of(out) == before

    stuck = out / "final"
    allowed = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != stuck and allowed(path, mode, **kw))
    code, lines = run_mta(monkeypatch, capsys, "distill", "--recipe", recipe, "--overwrite")
    assert code == 2
    assert only_line(lines, "error: ") == (
        f"error: cannot remove the outputs of the run in {out}: {stuck} is not readable and writable by this "
        "user. Nothing was removed; make them removable, or choose another output_dir"
    )
    assert files_of(out) == before and not (out / run_directory.RUN_LOCK).exists()


@pytest.mark.slow
def test_the_used_directory_of_the_bug_report_is_refused_then_overwritten(
    tmp_path, teacher_dir, tiny_model_dir, same_data
):
    """The reported case: a second run (another lr) into the first run's output_dir."""
    out = tmp_path / "run"
    common = dict(teacher=teacher_dir, student=tiny_model_dir, annotations=same_data, output_dir=out)
    first = write_recipe(tmp_path / "a.yaml", train={"max_steps": 4, "save_interval": 2}, **common)
    run_distillation(load_recipe(first))
    finished = _files(out)
    second = write_recipe(tmp_path / "b.yaml", train={"max_steps": 2, "save_interval": 1, "lr": 1e-3}, **common)
    with pytest.raises(MtaError, match="holds another run's outputs"):
        run_distillation(load_recipe(second))
    assert _files(out) == finished
    final = run_distillation(load_recipe(second), overwrite=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"] == [1, 2]
    assert weights(final) != {}


@pytest.mark.slow
def test_a_step_that_leaves_non_finite_weights_is_never_saved(tmp_path, tiny_run_recipe):
    """Finite recipe values whose first update is not: lr x weight decay overflows fp32.

    (Infinite gradients alone do not get here: DeepSpeed skips a step whose gradient norm
    overflows. An infinite ``train.lr`` is refused by the recipe schema before any step.)
    """
    out = tmp_path / "run"
    recipe = load_recipe(
        tiny_run_recipe(
            out,
            train={"lr": 1e30, "weight_decay": 1e10, "save_interval": 1},
            data={"dev": None},
        )
    )
    with pytest.raises(NonFiniteWeights, match=r"step 1 left non-finite weights.*--resume auto train\.lr="):
        run_distillation(recipe)
    assert not (out / "final").exists()
    assert not any((out / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_a_resume_applies_a_lower_lr_and_a_longer_run_and_refuses_a_new_batch(
    tmp_path, teacher_dir, tiny_model_dir, same_data
):
    out = tmp_path / "run"
    common = dict(
        teacher=teacher_dir, student=tiny_model_dir, annotations=same_data, output_dir=out, data={"dev": None}
    )
    run_distillation(
        load_recipe(write_recipe(tmp_path / "a.yaml", train={"max_steps": 2, "save_interval": 2}, **common))
    )
    path = write_recipe(tmp_path / "b.yaml", train={"max_steps": 2, "save_interval": 2}, **common)
    with pytest.raises(MtaError) as error:
        run_distillation(load_recipe(path, ["train.batch_size=8", "train.micro_batch_size=4"]), resume="auto")
    assert "train.batch_size: 4 → 8" in str(error.value) and "train.micro_batch_size: 2 → 4" in str(error.value)
    run_distillation(load_recipe(path, ["train.lr=1e-4", "train.max_steps=4"]), resume="auto")
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["lr"] for r in records] == pytest.approx([5e-3, 5e-3, 1e-4, 1e-4])  # constant schedule
