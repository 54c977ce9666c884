"""The rules of mta.training.lifecycle.checkpointing on checkpoints laid out by hand in tmp_path:
which checkpoint is the newest, each refusal of a resume in its exact wording (a trainer state
that is not one, a checksum list that differs, no other checkpoint to offer), the warning for a
checkpoint without a list, which of this run's checkpoints pruning removes (and what it logs),
and what an error while saving becomes (a full disk, a directory that cannot be written, mta's
own errors and interrupts untouched; the partial directory always gone). No DeepSpeed engine and
no model: the save is driven with an engine stub that fails at its first call."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mta.errors import MtaError
from mta.hashing import checksum_text, directory_checksums
from mta.training.lifecycle import checkpointing
from mta.training.lifecycle.checkpointing import TrainerState

LIST = "checksums.sha256"
WARNING = (
    "{} has no checksums.sha256 (written by an older mta): its files could not be verified; resuming "
    "from it after structural checks only"
)
NOT_LOADED = "; the checkpoint was not loaded (nothing of it was read into the run). "


def checkpoint(out: Path, step: int, state: object = None, *, listed: bool = True, run_id: str = "r") -> Path:
    """``out/checkpoints/step-N`` with a trainer state (``state``: its JSON value, or text as is), a
    DeepSpeed model state file, a config, and (``listed``) a checksum list written last."""
    path = out / "checkpoints" / f"step-{step}"
    (path / "deepspeed" / "state").mkdir(parents=True)
    torch.save({"weights": torch.zeros(2)}, path / "deepspeed" / "state" / "mp_rank_00_model_states.pt")
    if state is None:
        state = {"step": step, "total_steps": 10, "rng": [], "run_id": run_id}
    text = state if isinstance(state, str | bytes) else json.dumps(state)
    state_file = path / "trainer_state.json"
    state_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    (path / "config.json").write_text('{"model_type": "llama"}')
    if listed:
        (path / LIST).write_text(checksum_text(directory_checksums(path)))
    return path


def no_other(path: Path) -> str:
    return (
        f"No other checkpoint under {path.parent} passes these checks: start over with --overwrite, "
        "or resume from a copy you trust"
    )


def refused(path: Path) -> str:
    with pytest.raises(MtaError) as caught:
        checkpointing.verify_checkpoint(path)
    return str(caught.value)


# --- which checkpoint is the newest ---------------------------------------------------------


def test_the_latest_of_three_checkpoints_is_the_highest_step_not_the_second(tmp_path):
    for step in (2, 10, 7):
        checkpoint(tmp_path, step)
    assert checkpointing.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-10"


# --- verify_checkpoint: the trainer state ---------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ['{"step": 1, "total_steps"', b'{"step": 1, "run_id": "\xff"}'],
    ids=["truncated", "not utf-8"],
)
def test_a_trainer_state_that_is_not_json_is_refused_with_the_parsers_reason(tmp_path, text):
    path = checkpoint(tmp_path, 3, text, listed=False)
    try:
        json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = str(error)
    state_file = path / "trainer_state.json"
    expected = f"{state_file} is not valid JSON (truncated or corrupt: {reason})"
    assert refused(path) == expected + NOT_LOADED + no_other(path)


def test_a_trainer_state_that_is_a_list_is_not_a_json_object(tmp_path):
    path = checkpoint(tmp_path, 3, [1, 2], listed=False)
    assert refused(path) == f"{path / 'trainer_state.json'} is not a JSON object" + NOT_LOADED + no_other(path)


def test_unknown_keys_are_named_sorted_and_said_to_come_from_a_newer_mta(tmp_path):
    state = {"step": 3, "total_steps": 10, "zeta": 1, "alpha": 2}
    path = checkpoint(tmp_path, 3, state, listed=False)
    expected = (
        f"{path / 'trainer_state.json'} has keys this mta does not know (alpha, zeta): it was written "
        "by a newer mta; resume with that version"
    )
    assert refused(path) == expected + NOT_LOADED + no_other(path)


def test_a_trainer_state_without_total_steps_names_the_missing_key(tmp_path):
    path = checkpoint(tmp_path, 3, {"step": 3}, listed=False)
    message = refused(path)
    assert message.startswith(f"{path / 'trainer_state.json'} lacks a required key (")
    assert "'total_steps')" in message.split(NOT_LOADED)[0]


@pytest.mark.parametrize(
    "change",
    [{"step": "3"}, {"total_steps": 10.0}, {"rng": "seed"}, {"run_id": 5}],
    ids=["step", "total_steps", "rng", "run_id"],
)
def test_each_field_of_the_wrong_type_alone_is_refused(tmp_path, change):
    path = checkpoint(tmp_path, 3, {"step": 3, "total_steps": 10, "rng": [], "run_id": "r"} | change, listed=False)
    expected = f"{path / 'trainer_state.json'}: step/total_steps must be integers, rng a list, run_id a string"
    assert refused(path) == expected + NOT_LOADED + no_other(path)


def test_a_trainer_state_gone_while_the_checkpoint_is_checked_is_named_missing(tmp_path, monkeypatch):
    path = checkpoint(tmp_path, 3, listed=False)

    def read_then_lose_the_state(directory):  # another process removes it between two checks
        (Path(directory) / "trainer_state.json").unlink()
        return None

    monkeypatch.setattr(checkpointing, "read_checksums", read_then_lose_the_state)
    assert refused(path) == f"{path / 'trainer_state.json'} is missing" + NOT_LOADED + no_other(path)


# --- verify_checkpoint: the checksum list and the warning -----------------------------------


def test_every_difference_from_the_list_is_named_in_one_message_joined_by_semicolons(tmp_path):
    path = checkpoint(tmp_path, 3)
    (path / "config.json").write_text("{}")
    (path / "planted.py").write_text("print('hi')")
    expected = (
        f"{path} is not the checkpoint that was written: config.json (changed: sha256 differs); "
        f"planted.py (not in {LIST}) (compared with its {LIST})"
    )
    assert refused(path) == expected + NOT_LOADED + no_other(path)


def test_a_listed_checkpoint_that_passes_logs_no_warning(tmp_path, caplog):
    path = checkpoint(tmp_path, 3)
    with caplog.at_level(logging.WARNING):
        checkpointing.verify_checkpoint(path)
    assert caplog.records == []


def test_a_checkpoint_without_a_list_resumes_with_a_warning_naming_it_and_the_list(tmp_path, caplog):
    path = checkpoint(tmp_path, 3, listed=False)
    with caplog.at_level(logging.WARNING):
        checkpointing.verify_checkpoint(path)
    assert [record.getMessage() for record in caplog.records] == [WARNING.format(path)]


def test_a_damaged_checkpoint_offers_the_newest_other_one_that_passes(tmp_path):
    older = checkpoint(tmp_path, 2)
    checkpoint(tmp_path, 4, [], listed=False)  # newer than the one offered, but not resumable
    path = checkpoint(tmp_path, 6)
    (path / "config.json").write_text("{}")
    message = refused(path)
    assert message.endswith(f"{NOT_LOADED}Resume from the previous complete checkpoint instead: --resume {older}")


# --- prune_checkpoints ----------------------------------------------------------------------


def steps(out: Path) -> list[int]:
    return [step for step, _ in checkpointing.complete_checkpoints(out)]


def test_fewer_older_checkpoints_than_keep_allows_are_all_kept(tmp_path):
    for step in (1, 2, 3):
        checkpoint(tmp_path, step)
    checkpointing.prune_checkpoints(tmp_path / "checkpoints", TrainerState(step=3, total_steps=10, run_id="r"), 4)
    assert steps(tmp_path) == [1, 2, 3]


def test_pruning_keeps_the_newest_keep_counting_the_one_just_written(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint(tmp_path, step)
    checkpointing.prune_checkpoints(tmp_path / "checkpoints", TrainerState(step=4, total_steps=10, run_id="r"), 2)
    assert steps(tmp_path) == [3, 4]


def test_a_run_without_a_run_id_prunes_old_checkpoints_that_have_none_and_keeps_unreadable_ones(tmp_path):
    checkpoint(tmp_path, 1, {"step": 1, "total_steps": 10})  # older mta: no run_id
    checkpoint(tmp_path, 2, "[]")  # state that is no mapping: whose it is cannot be told
    checkpoint(tmp_path, 3, "{")  # unreadable
    checkpoint(tmp_path, 4, {"step": 4, "total_steps": 10, "run_id": "other"})
    checkpoint(tmp_path, 5, {"step": 5, "total_steps": 10})
    checkpointing.prune_checkpoints(tmp_path / "checkpoints", TrainerState(step=5, total_steps=10), 1)
    assert steps(tmp_path) == [2, 3, 4, 5]


def test_a_checkpoint_that_cannot_be_removed_is_logged_and_the_next_is_still_pruned(tmp_path, monkeypatch, caplog):
    for step in (1, 2, 3):
        checkpoint(tmp_path, step)
    first = tmp_path / "checkpoints" / "step-1"
    real = checkpointing.remove_path

    def refuse_the_first(path):
        if Path(path) == first:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        real(path)

    monkeypatch.setattr(checkpointing, "remove_path", refuse_the_first)
    with caplog.at_level(logging.WARNING):
        checkpointing.prune_checkpoints(tmp_path / "checkpoints", TrainerState(step=3, total_steps=10, run_id="r"), 1)
    assert steps(tmp_path) == [1, 3]
    assert [record.getMessage() for record in caplog.records] == [
        f"could not prune {first} ({os.strerror(errno.EACCES)}): it stays until removed by hand"
    ]


def test_a_checkpoint_that_is_a_link_is_pruned_as_a_link_and_the_log_names_its_target(tmp_path, caplog):
    elsewhere = checkpoint(tmp_path / "elsewhere", 1)
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    link = tmp_path / "out" / "checkpoints" / "step-1"
    link.symlink_to(elsewhere)
    checkpoint(tmp_path / "out", 2)
    with caplog.at_level(logging.WARNING):
        checkpointing.prune_checkpoints(link.parent, TrainerState(step=2, total_steps=10, run_id="r"), 1)
    assert not os.path.lexists(link) and (elsewhere / "trainer_state.json").is_file()
    assert [record.getMessage() for record in caplog.records] == [
        f"pruned {link}, a link: the link was removed, {elsewhere} (what it points to) is kept"
    ]


# --- an error while saving ------------------------------------------------------------------


def save_failing_with(out: Path, error: BaseException, *, before=None) -> None:
    """``save_checkpoint`` of step 3 with an engine whose first call runs ``before`` and raises."""

    def fail():
        if before is not None:
            before()
        raise error

    engine = SimpleNamespace(zero_optimization_partition_weights=fail)
    checkpointing.save_checkpoint(engine, None, None, out, TrainerState(step=3, total_steps=10, run_id="r"))


def partial_of(out: Path) -> Path:
    return out / "checkpoints" / "step-3.partial"


def test_a_full_disk_becomes_one_error_saying_nothing_was_lost_and_the_partial_is_gone(tmp_path):
    checkpoint(tmp_path, 1)
    with pytest.raises(MtaError) as caught:
        save_failing_with(tmp_path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    final = tmp_path / "checkpoints" / "step-3"
    assert str(caught.value) == (
        f"disk full while writing {final}; nothing was lost: the unfinished step-3.partial was removed and "
        "the earlier checkpoints (step-1) are intact; free space and continue with --resume auto"
    )
    assert isinstance(caught.value.__cause__, OSError)
    assert not partial_of(tmp_path).exists()


def test_a_directory_that_cannot_be_written_asks_for_the_checkpoints_directory_to_be_made_writable(tmp_path):
    partial = partial_of(tmp_path)
    error = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(partial / "model.safetensors"))
    with pytest.raises(MtaError) as caught:
        save_failing_with(tmp_path, error)
    final = tmp_path / "checkpoints" / "step-3"
    assert str(caught.value) == (
        f"cannot write {final}: permission denied; nothing was lost: the unfinished step-3.partial was removed "
        f"and there was no earlier checkpoint; make {final.parent} writable by this user and continue with "
        "--resume auto"
    )
    assert not partial.exists()


def test_an_unreadable_input_elsewhere_is_not_a_write_failure_and_passes_through(tmp_path):
    error = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "inputs" / "teacher.bin"))
    with pytest.raises(PermissionError) as caught:
        save_failing_with(tmp_path, error)
    assert caught.value is error
    assert not partial_of(tmp_path).exists()


@pytest.mark.parametrize("kind", [MtaError, KeyboardInterrupt])
def test_mtas_own_errors_and_interrupts_pass_through_even_with_a_full_disk_behind_them(tmp_path, kind):
    error = kind("stopped here")
    error.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(kind) as caught:
        save_failing_with(tmp_path, error)
    assert caught.value is error
    assert not partial_of(tmp_path).exists()


def test_the_partial_directory_already_gone_does_not_hide_the_error(tmp_path):
    def remove_partial():
        partial_of(tmp_path).rmdir()

    with pytest.raises(MtaError, match="^disk full while writing"):
        save_failing_with(tmp_path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), before=remove_partial)
