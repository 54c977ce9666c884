"""Reading DeepSpeed's state files without running their code (mta.training.lifecycle.
safe_loading) on small files saved here, and claiming a run directory (run_directory) on
directories laid out by hand: every refusal's exact wording, each way a file is unreadable, the
allow-list by name, the checkpoint engine's wrapper, the decisions of a claim. No engine and no
model: what mutation testing (bench/mutation.py) found the DeepSpeed fault tests leave to
minutes-long runs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from fixtures.planted import Planted
from mta.errors import MtaError
from mta.files import LockHeld
from mta.training.lifecycle import run_directory, safe_loading
from mta.training.lifecycle.safe_loading import CheckpointFileError

ALLOWED = "DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address"  # sorted by name


class Other:
    """A pickle that calls ``os.rmdir``: a second refused global."""

    def __reduce__(self):
        return os.rmdir, ("/nonexistent-mta-test",)


def refusal(path: Path, types: str) -> str:
    return (
        f"{path}: refused: unpickling it would call {types}, which DeepSpeed's state of an mta run "
        f"never holds (tensors, plain values and DeepSpeed's {ALLOWED} only), so the file was "
        "replaced or written by other software; nothing in it ran"
    )


# --- safe_loading: the allow-list -----------------------------------------------------------


def test_the_allow_list_is_deepspeeds_four_types_by_class():
    assert safe_loading.allowed_globals() == (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)


def test_a_file_of_every_allowed_type_passes_the_static_check_and_loads(tmp_path):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = {"stage": ZeroStageEnum(2), "scaler": LossScaler(1.0), "w": torch.arange(3.0)}
    torch.save(state, path)
    assert safe_loading.refused_globals(path) == []
    safe_loading.check_state_file(path)  # no error
    loaded = safe_loading.load_state_file(path)
    assert loaded["stage"] is ZeroStageEnum(2)
    assert isinstance(loaded["scaler"], LossScaler)
    assert torch.equal(loaded["w"], torch.arange(3.0))


def test_refused_types_are_listed_once_each_and_sorted(tmp_path):
    path = tmp_path / "planted.pt"
    torch.save({"b": Planted(tmp_path / "x"), "c": Planted(tmp_path / "y"), "a": Other(), "s": ZeroStageEnum(1)}, path)
    assert safe_loading.refused_globals(path) == ["posix.mkdir", "posix.rmdir"]
    with pytest.raises(CheckpointFileError) as raised:
        safe_loading.check_state_file(path)
    assert str(raised.value) == refusal(path, "posix.mkdir, posix.rmdir")
    assert raised.value.path == path
    assert raised.value.problem == str(raised.value).removeprefix(f"{path}: ")
    assert not (tmp_path / "x").exists()


def test_a_planted_zip_file_is_refused_before_torch_reads_it(tmp_path, monkeypatch):
    path, marker = tmp_path / "planted.pt", tmp_path / "ran"
    torch.save({"optimizer": Planted(marker)}, str(path))

    def never(*args, **kwargs):
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(torch, "load", never)
    with pytest.raises(CheckpointFileError) as raised:
        safe_loading.load_state_file(str(path))  # a str path too
    assert str(raised.value) == refusal(path, "posix.mkdir")
    assert not marker.exists()


# --- safe_loading: files the static check cannot read ---------------------------------------


def test_a_legacy_file_is_left_to_the_restricted_unpickler_which_refuses_it(tmp_path):
    path, marker = tmp_path / "legacy.pt", tmp_path / "ran"
    torch.save({"optimizer": Planted(marker)}, path, _use_new_zipfile_serialization=False)
    assert safe_loading.refused_globals(path) is None
    safe_loading.check_state_file(path)  # nothing it can list
    with pytest.raises(CheckpointFileError) as raised:
        safe_loading.load_state_file(path)
    assert str(raised.value) == (
        f"{path}: refused by torch's restricted (weights-only) unpickler: Trying to load unsupported "
        "GLOBAL posix.mkdir whose module posix is blocked; nothing in it ran"
    )
    assert isinstance(raised.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()


def test_a_legacy_file_of_plain_values_loads(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"global_steps": 7, "stage": ZeroStageEnum(3)}, path, _use_new_zipfile_serialization=False)
    assert safe_loading.load_state_file(path) == {"global_steps": 7, "stage": ZeroStageEnum(3)}


def test_a_missing_file_is_named_missing(tmp_path):
    path = tmp_path / "absent.pt"
    for check in (safe_loading.refused_globals, safe_loading.check_state_file, safe_loading.load_state_file):
        with pytest.raises(CheckpointFileError) as raised:
            check(path)
        assert str(raised.value) == f"{path}: missing"
        assert raised.value.__suppress_context__


def test_a_truncated_zip_file_is_unreadable_with_the_first_sentence_of_the_reason(tmp_path):
    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.zeros(4)}, whole)
    path = tmp_path / "cut.pt"
    path.write_bytes(whole.read_bytes()[:50])
    with pytest.raises(CheckpointFileError) as raised:
        safe_loading.refused_globals(path)
    assert str(raised.value) == (
        f"{path}: unreadable (truncated or corrupt: PytorchStreamReader failed reading zip archive: "
        "failed finding central directory)"
    )
    assert isinstance(raised.value.__cause__, RuntimeError)


@pytest.mark.parametrize("length", [5, 30, 60])
def test_a_truncated_legacy_file_is_unreadable_never_another_error(tmp_path, length):
    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.zeros(4), "n": 3}, whole, _use_new_zipfile_serialization=False)
    path = tmp_path / "cut.pt"
    path.write_bytes(whole.read_bytes()[:length])
    with pytest.raises(CheckpointFileError, match=r"^.*cut\.pt: unreadable \(truncated or corrupt: .+\)$"):
        safe_loading.load_state_file(path)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (RuntimeError("first sentence. second sentence\nsecond line"), "first sentence"),
        (EOFError(), "EOFError"),
        (OSError("  disk gone  "), "disk gone"),
        (ValueError("bad. worse"), "bad"),
        (KeyError("data.pkl"), "'data.pkl'"),
    ],
)
def test_each_error_of_torch_load_is_unreadable_naming_its_first_sentence(tmp_path, monkeypatch, error, reason):
    path = tmp_path / "state.pt"
    path.write_bytes(b"")
    monkeypatch.setattr(safe_loading, "refused_globals", lambda path: [])

    def load(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointFileError) as raised:
        safe_loading.load_state_file(path)
    assert str(raised.value) == f"{path}: unreadable (truncated or corrupt: {reason})"
    assert raised.value.__cause__ is error


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "Weights only load failed.\nWeightsUnpickler error:   Unsupported global: GLOBAL a.b. Please use x.\n",
            "Unsupported global: GLOBAL a.b",
        ),
        (
            "Weights only load failed. Trying to load unsupported GLOBAL os.system whose module os is blocked.\nmore",
            "Trying to load unsupported GLOBAL os.system whose module os is blocked",
        ),
        ("first line only\nsecond", "first line only"),
        ("", "refused by the weights-only unpickler"),
    ],
)
def test_the_restricted_unpicklers_refusal_says_what_was_refused(tmp_path, monkeypatch, text, reason):
    path = tmp_path / "state.pt"
    path.write_bytes(b"")
    monkeypatch.setattr(safe_loading, "refused_globals", lambda path: [])

    def load(*args, **kwargs):
        raise pickle.UnpicklingError(text)

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointFileError) as raised:
        safe_loading.load_state_file(path)
    assert (
        str(raised.value)
        == f"{path}: refused by torch's restricted (weights-only) unpickler: {reason}; nothing in it ran"
    )


def test_a_file_gone_between_the_check_and_the_load_is_missing(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    monkeypatch.setattr(safe_loading, "refused_globals", lambda path: [])

    def load(*args, **kwargs):
        raise FileNotFoundError(str(path))

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointFileError) as raised:
        safe_loading.load_state_file(path)
    assert str(raised.value) == f"{path}: missing"
    assert raised.value.__suppress_context__


def test_the_load_is_weights_only_with_the_allow_list_and_the_callers_map_location(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2)}, path)
    seen = {}
    real_load = torch.load

    def load(file, map_location=None, weights_only=None):
        seen.update(file=file, map_location=map_location, weights_only=weights_only)
        seen["safe"] = set(torch.serialization.get_safe_globals())
        return real_load(file, map_location=map_location, weights_only=weights_only)

    monkeypatch.setattr(torch, "load", load)
    assert torch.equal(safe_loading.load_state_file(path, map_location="cpu")["w"], torch.ones(2))
    assert seen["file"] == path and seen["map_location"] == "cpu" and seen["weights_only"] is True
    assert set(safe_loading.allowed_globals()) <= seen["safe"]
    assert not set(safe_loading.allowed_globals()) & set(torch.serialization.get_safe_globals())  # only inside


# --- safe_loading: the checkpoint engine's wrapper ------------------------------------------


class FakeCheckpointEngine:
    name = "inner"

    def __init__(self):
        self.loads = []

    def load(self, path, map_location=None):
        self.loads.append(path)
        return {"unrestricted": True}

    def save(self, state, path):
        return ("saved", path)


def test_inside_restricted_loading_every_load_is_checked_and_the_rest_is_the_engines(tmp_path):
    inner = FakeCheckpointEngine()
    engine = SimpleNamespace(checkpoint_engine=inner)
    good, planted = tmp_path / "good.pt", tmp_path / "planted.pt"
    torch.save({"w": torch.zeros(1), "n": 2}, good)
    torch.save({"x": Planted(tmp_path / "ran")}, planted)
    with safe_loading.restricted_loading(engine):
        wrapped = engine.checkpoint_engine
        assert wrapped is not inner
        assert wrapped.load(str(good), map_location="cpu")["n"] == 2
        with pytest.raises(CheckpointFileError, match="refused: unpickling it would call posix.mkdir"):
            wrapped.load(str(planted))
        assert wrapped.name == "inner" and wrapped.save({}, "p") == ("saved", "p")
    assert engine.checkpoint_engine is inner
    assert inner.loads == []
    assert not (tmp_path / "ran").exists()


def test_restricted_loading_gives_the_engine_back_after_an_error():
    inner = FakeCheckpointEngine()
    engine = SimpleNamespace(checkpoint_engine=inner)
    with pytest.raises(RuntimeError, match="boom"):
        with safe_loading.restricted_loading(engine):
            raise RuntimeError("boom")
    assert engine.checkpoint_engine is inner


# --- run_directory: what a claim sees and decides --------------------------------------------


@pytest.fixture(autouse=True)
def released(tmp_path):
    yield
    for path in [tmp_path, *tmp_path.iterdir()] if tmp_path.exists() else []:
        run_directory.release(path)


def write_run(out: Path, **record) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / run_directory.RUN_RECORD).write_text(json.dumps(record), encoding="utf-8")


def test_existing_outputs_are_named_in_order_with_dirs_and_links_shown(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").mkdir()  # empty: does not count
    (out / "final").mkdir()
    (out / "metrics.jsonl").write_text("")
    (out / "best").symlink_to(tmp_path / "elsewhere")  # dangling still counts
    (out / "data").mkdir()  # a cache
    (out / "notes.txt").write_text("")  # not a run output
    assert run_directory.existing_outputs(out) == [
        "final/",
        f"best (a link to {tmp_path / 'elsewhere'})",
        "metrics.jsonl",
    ]
    (out / "checkpoints" / "step-1").mkdir()
    assert run_directory.existing_outputs(out)[0] == "checkpoints/"
    (out / "checkpoints").rename(out / "c")
    (out / "checkpoints").write_text("a file, not a directory")
    assert run_directory.existing_outputs(out)[0] == "checkpoints"


def test_a_refusal_names_the_outputs_the_owner_and_the_three_ways_on(tmp_path):
    out = tmp_path / "run"
    write_run(out, run_id="abc", recipe="qwen", started="2026-01-01T00:00:00+00:00")
    (out / "final").mkdir()
    with pytest.raises(MtaError) as raised:
        run_directory.claim(out, "other", resume=None, overwrite=False)
    assert str(raised.value) == (
        f"{out} holds another run's outputs (run.json, final/) (run abc, recipe qwen, started "
        f"2026-01-01T00:00:00+00:00); it has no complete checkpoint under {out / 'checkpoints'}, so "
        "--resume auto would start it again at step 0. Continue that run with --resume auto, or start "
        "over with --overwrite (removes run.json, checkpoints, final, best, metrics.jsonl, generated, "
        "tensorboard, tracking.json; keeps the data and models caches), or choose another output_dir"
    )
    assert json.loads((out / "run.json").read_text())["run_id"] == "abc"


def test_a_refusal_without_a_readable_record_names_no_owner(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "final").mkdir()
    (out / "run.json").write_text("[1, 2]")  # not a mapping
    with pytest.raises(MtaError, match=r"holds another run's outputs \(run.json, final/\); it has no"):
        run_directory.claim(out, "r", resume=None, overwrite=False)
    (out / "run.json").write_text('{"recipe": "only"')  # cut
    with pytest.raises(MtaError, match=r"holds another run's outputs \(run.json, final/\); it has no"):
        run_directory.claim(out, "r", resume=None, overwrite=False)
    (out / "run.json").write_text('{"recipe": "only"}')
    with pytest.raises(MtaError, match=r"\(run.json, final/\) \(recipe only\); it has no"):
        run_directory.claim(out, "r", resume=None, overwrite=False)


def test_resume_and_overwrite_together_are_refused_before_anything_is_read(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(MtaError) as raised:
        run_directory.claim(out, "r", resume="auto", overwrite=True)
    assert str(raised.value) == "--resume continues a run and --overwrite removes it: give one of them"
    assert not out.exists()


def test_a_fresh_claim_writes_the_record_and_a_resume_reads_it(tmp_path):
    out = tmp_path / "run"
    first = run_directory.claim(out, "qwen", resume=None, overwrite=False)
    record = json.loads((out / "run.json").read_text())
    assert set(record) == {"run_id", "recipe", "started"}
    assert record["run_id"] == first.run_id and len(first.run_id) == 32 and record["recipe"] == "qwen"
    assert record["started"].endswith("+00:00") and "." not in record["started"]
    assert first == run_directory.RunClaim(out, first.run_id, False)
    run_directory.release(out)
    again = run_directory.claim(out, "qwen", resume="auto", overwrite=False)
    assert again == run_directory.RunClaim(out, first.run_id, True)


def test_a_resume_of_a_directory_from_before_run_ids_continues_the_run_without_one(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"split": "train", "step": 3}\n')
    assert run_directory.claim(out, "r", resume="auto", overwrite=False) == run_directory.RunClaim(out, "", True)


@pytest.mark.parametrize("text", ["not json", "{}", "[]"])
def test_a_resume_with_a_corrupt_record_says_how_to_start_over(tmp_path, text):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(text)
    with pytest.raises(MtaError) as raised:
        run_directory.claim(out, "r", resume="auto", overwrite=False)
    assert str(raised.value).startswith(f"{out / 'run.json'} is corrupt (")
    assert str(raised.value).endswith("); if this directory is yours, start over with --overwrite")
    assert (out / "run.json").read_text() == text
    run_directory.claim(out, "r", resume=None, overwrite=True)  # the lock was released: it may go on


def test_a_resume_of_an_empty_directory_starts_a_new_run(tmp_path):
    out = tmp_path / "run"
    claimed = run_directory.claim(out, "r", resume="auto", overwrite=False)
    assert claimed.continued is False
    assert json.loads((out / "run.json").read_text())["run_id"] == claimed.run_id


def test_overwrite_removes_run_json_last(tmp_path, monkeypatch):
    out = tmp_path / "run"
    write_run(out, run_id="old")
    for name in ("final", "best", "tensorboard"):
        (out / name).mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    order = []
    real = run_directory.remove_path
    monkeypatch.setattr(run_directory, "remove_path", lambda path: (order.append(path.name), real(path)))
    claimed = run_directory.claim(out, "r", resume=None, overwrite=True)
    assert order[-1] == "run.json" and sorted(order) == ["best", "final", "metrics.jsonl", "run.json", "tensorboard"]
    assert claimed.run_id != "old" and not claimed.continued


def test_overwrite_that_cannot_remove_six_outputs_names_five_and_counts_the_rest(tmp_path, monkeypatch):
    out = tmp_path / "run"
    write_run(out, run_id="old")
    monkeypatch.setattr(run_directory, "removal_problems", lambda path: [f"p{path.name}"])
    for name in ("final", "best", "generated", "tensorboard"):
        (out / name).mkdir()
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(MtaError) as raised:
        run_directory.claim(out, "r", resume=None, overwrite=True)
    assert str(raised.value) == (
        f"cannot remove the outputs of the run in {out}: prun.json; pfinal; pbest; pmetrics.jsonl; "
        "pgenerated; and 1 more. Nothing was removed; make them removable, or choose another output_dir"
    )
    (out / "generated").rmdir()
    with pytest.raises(MtaError, match=r": prun.json; pfinal; pbest; pmetrics.jsonl; ptensorboard\. Nothing"):
        run_directory.claim(out, "r", resume=None, overwrite=True)
    assert (out / "final").is_dir()


def test_a_failed_start_is_taken_over_naming_its_record(tmp_path, caplog):
    out = tmp_path / "run"
    write_run(out, run_id="gone", recipe="qwen")
    (out / "metrics.jsonl").write_text('{"split": "dev", "step": 0}\n')
    (out / "tensorboard").mkdir()
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        claimed = run_directory.claim(out, "r", resume=None, overwrite=False)
    assert claimed.run_id != "gone"
    assert [record.getMessage() for record in caplog.records] == [
        f"{out} holds only the start of run gone (recipe qwen, started ?), which ended before its first "
        "step (no checkpoint, no train metrics): this run takes the directory over and removes run.json, "
        "metrics.jsonl, tensorboard/"
    ]
    assert not (out / "tensorboard").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "leftover",
    [
        "no record",
        "train record",
        "later step",
        "a final",
        "linked tensorboard",
    ],
)
def test_what_got_further_than_a_start_is_refused(tmp_path, leftover):
    out = tmp_path / "run"
    if leftover != "no record":
        write_run(out, run_id="r1")
    out.mkdir(exist_ok=True)
    metrics = {"train record": '{"split": "train", "step": 0}\n', "later step": '{"split": "dev", "step": 5}\n'}
    (out / "metrics.jsonl").write_text(metrics.get(leftover, '{"split": "dev", "step": 0}\n'))
    if leftover == "a final":
        (out / "final").mkdir()
    if leftover == "linked tensorboard":
        (tmp_path / "tb").mkdir()
        (out / "tensorboard").symlink_to(tmp_path / "tb")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(MtaError, match="holds another run's outputs"):
        run_directory.claim(out, "r", resume=None, overwrite=False)
    assert sorted(p.name for p in out.iterdir()) == before


def test_without_a_lock_a_failed_start_is_refused_not_taken_over(tmp_path, monkeypatch):
    out = tmp_path / "run"
    write_run(out, run_id="maybe-loading")
    monkeypatch.setattr(run_directory, "_lock", lambda output_dir: False)
    with pytest.raises(MtaError, match="holds another run's outputs"):
        run_directory.claim(out, "r", resume=None, overwrite=False)
    assert json.loads((out / "run.json").read_text())["run_id"] == "maybe-loading"


def test_the_lock_is_taken_once_per_process_and_held_until_release(tmp_path):
    out = tmp_path / "run"
    first = run_directory.claim(out, "r", resume=None, overwrite=False)
    again = run_directory.claim(out, "r", resume="auto", overwrite=False)  # same process: not refused
    assert again.run_id == first.run_id
    run_directory.release(out)
    run_directory.release(out)  # a no-op the second time
    run_directory.release(tmp_path / "never-claimed")


def test_a_refused_claim_lets_the_lock_go(tmp_path):
    out = tmp_path / "run"
    write_run(out, run_id="abc")
    (out / "final").mkdir()
    with pytest.raises(MtaError):
        run_directory.claim(out, "r", resume=None, overwrite=False)
    assert run_directory.claim(out, "r", resume=None, overwrite=True).continued is False


def test_a_record_that_is_not_a_mapping_names_no_owner_even_as_a_string_holding_its_keys(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "final").mkdir()
    (out / "run.json").write_text('"run_id recipe started"')  # a JSON string: `key in` would match
    with pytest.raises(MtaError, match=r"holds another run's outputs \(run.json, final/\); it has no"):
        run_directory.claim(out, "r", resume=None, overwrite=False)
    (out / "final").rmdir()
    (out / "run.json").write_text("[1, 2]")  # only a failed start's record left, not a mapping
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        run_directory.claim(out, "r", resume=None, overwrite=False)
    assert caplog.records[0].getMessage().startswith(f"{out} holds only the start of run ? (recipe ?, started ?)")


def test_a_failed_start_that_left_every_start_output_is_still_taken_over(tmp_path):
    out = tmp_path / "run"
    write_run(out, run_id="gone")
    (out / "metrics.jsonl").write_text('{"split": "dev", "step": 0}\n')
    (out / "tensorboard").mkdir()
    (out / "tracking.json").write_text("{}")
    assert sorted(run_directory.START_OUTPUTS) == sorted(p.name for p in out.iterdir())
    assert run_directory.claim(out, "r", resume=None, overwrite=False).run_id != "gone"
    assert sorted(p.name for p in out.iterdir()) == [run_directory.RUN_LOCK, "run.json"]


def test_an_output_dir_that_is_a_file_is_named_by_its_recipe_key(tmp_path):
    out = tmp_path / "run"
    out.write_text("not a directory")
    with pytest.raises(MtaError) as raised:
        run_directory.claim(out, "r", resume=None, overwrite=False)
    assert str(raised.value) == f"output_dir {out} is a file, not a directory; give a directory to write into"


def test_overwrite_names_each_link_it_removes_and_what_it_pointed_to(tmp_path, caplog):
    out = tmp_path / "run"
    write_run(out, run_id="old")
    (tmp_path / "kept").mkdir()
    (out / "best").symlink_to(tmp_path / "kept")
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        run_directory.claim(out, "r", resume=None, overwrite=True)
    assert [record.getMessage() for record in caplog.records] == [
        f"removed the link {out / 'best'}; {tmp_path / 'kept'}, what it points to, is kept"
    ]
    assert (tmp_path / "kept").is_dir()


def test_a_directory_another_process_trains_into_is_refused_at_once_naming_it(tmp_path, monkeypatch):
    out = tmp_path / "run"
    waits = []

    @contextlib.contextmanager
    def held(path, *, wait_s):
        waits.append(wait_s)
        raise LockHeld("pid 7 on host-a")
        yield

    monkeypatch.setattr(run_directory, "exclusive_lock", held)
    with pytest.raises(MtaError) as raised:
        run_directory.claim(out, "r", resume=None, overwrite=False)
    assert str(raised.value) == (
        f"another `mta distill` (pid 7 on host-a) is training into {out} (it holds {out / run_directory.RUN_LOCK}): "
        "two runs in one directory would write the same checkpoints and metrics.jsonl. Wait for it to end "
        "or stop it (a job submitted twice: cancel one), or give this run another output_dir"
    )
    assert waits == [0]  # refused at once, never waiting for the other run


def test_without_file_locks_a_claim_warns_once_and_remembers_it_holds_no_lock(tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"

    @contextlib.contextmanager
    def unsupported(path, *, wait_s):
        yield f"{path.parent} does not support file locks (nope)"

    monkeypatch.setattr(run_directory, "exclusive_lock", unsupported)
    with caplog.at_level(logging.WARNING, logger=run_directory.__name__):
        run_directory.claim(out, "r", resume=None, overwrite=False)
        write_run(out, run_id="loading")  # a failed start's leftovers, or a run still loading
        with pytest.raises(MtaError, match="holds another run's outputs"):  # never taken over unlocked
            run_directory.claim(out, "r", resume=None, overwrite=False)
    assert [record.getMessage() for record in caplog.records] == [
        f"{out} does not support file locks (nope): nothing keeps a second `mta distill` (a job submitted "
        f"twice) out of {out}, and a run that failed before its first step is not taken over (--resume "
        "auto continues it); make sure one runs at a time"
    ]


def test_the_engines_load_passes_the_callers_map_location(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"w": torch.ones(2)}, path)
    seen = []

    def map_location(storage, location):
        seen.append(location)
        return storage

    engine = SimpleNamespace(checkpoint_engine=FakeCheckpointEngine())
    with safe_loading.restricted_loading(engine):
        assert torch.equal(engine.checkpoint_engine.load(str(path), map_location=map_location)["w"], torch.ones(2))
    assert seen == ["cpu"]


def test_a_refused_globals_name_keeps_its_last_letter(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    path.write_bytes(b"")
    monkeypatch.setattr(safe_loading, "refused_globals", lambda path: [])

    def load(*args, **kwargs):
        raise pickle.UnpicklingError("WeightsUnpickler error: Unsupported global: GLOBAL a.X.")

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointFileError, match=r"unpickler: Unsupported global: GLOBAL a\.X; nothing in it ran$"):
        safe_loading.load_state_file(path)
