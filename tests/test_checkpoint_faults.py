"""Checkpoint faults: resume runs no code from a checkpoint, refuses files that are not the ones
written (checksums.sha256) or are broken, naming them and the previous checkpoint; a full disk
while saving loses nothing; pruning removes only this run's own checkpoints.

Engines are built directly on the tiny student (no teacher, no data): one DeepSpeed engine
builds in about a second.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from fixtures.checkpoints import Engines, student_recipe, train_step
from mta.errors import MtaError
from mta.hashing import CHECKSUMS, checksum_text, directory_checksums, read_checksums
from mta.training.lifecycle import checkpointing, safe_loading
from mta.training.lifecycle.checkpointing import TrainerState, load_checkpoint, resolve_resume, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

STATE = Path("deepspeed") / "state"
MODEL_STATES = STATE / "mp_rank_00_model_states.pt"
OPTIM_STATES = STATE / "zero_pp_rank_0_mp_rank_00_optim_states.pt"  # ZeRO 1 and 2, fp32


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in checkpointing.student_state_dict(engine).items()}


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """A ZeRO-1 fp32 run with two checkpoints of run "r" (step-2, step-4), and an engine to
    load into: the fault tests copy ``out`` and break the copy."""
    directory = tmp_path_factory.mktemp("saved")
    recipe = student_recipe(directory, tiny_model_dir)
    built = Engines(tiny_model_dir)
    engine = built(recipe)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for step in (2, 4):
        train_step(engine, step)
        save_checkpoint(engine, tokenizer, recipe, directory / "out", TrainerState(step, 8, run_id="r"))
    yield {"out": directory / "out", "recipe": recipe, "engine": engine, "tokenizer": tokenizer}
    built.destroy()


def _copy(saved, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(saved["out"], out)
    return out


def _rewrite_checksums(checkpoint: Path) -> None:
    """What someone who swaps a file and updates the list does."""
    (checkpoint / CHECKSUMS).write_text(checksum_text(directory_checksums(checkpoint)))


# --------------------------------------------------------------------------- restricted loading

# What DeepSpeed pickles beyond tensors and plain values, per ZeRO stage (fp32 and bf16 alike):
# the allow-list in mta.training.lifecycle.safe_loading is their union, plus fp16's DynamicLossScaler.
ZERO = "deepspeed.runtime.zero.config.ZeroStageEnum"
SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
FRAGMENT = "deepspeed.utils.tensor_fragment.fragment_address"
NEEDED = {0: set(), 1: {ZERO, SCALER, FRAGMENT}, 2: {ZERO, SCALER, FRAGMENT}, 3: {ZERO, SCALER}}


def test_the_allow_list_is_the_union_of_what_the_stages_need():
    names = {f"{kind.__module__}.{kind.__qualname__}" for kind in safe_loading.allowed_globals()}
    assert names == set().union(*NEEDED.values()) | {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}


@pytest.mark.parametrize(
    "stage,precision",
    [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16")],
)
def test_resume_restores_every_stage_through_the_restricted_loader(
    stage, precision, tmp_path, tiny_model_dir, new_engine, monkeypatch
):
    recipe = student_recipe(tmp_path, tiny_model_dir, zero_stage=stage, precision=precision)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    original = new_engine(recipe)
    train_step(original, 1)
    path = save_checkpoint(original, tokenizer, recipe, tmp_path / "out", TrainerState(1, 8, run_id="run-a"))
    assert read_checksums(path) == directory_checksums(path)  # the list covers every file
    assert (path / "trainer_state.json").name in read_checksums(path)
    needed = set().union(
        *(torch.serialization.get_unsafe_globals_in_checkpoint(str(f)) for f in (path / STATE).glob("*.pt"))
    )
    assert needed == NEEDED[stage]

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or real_load(*a, **k))
    resumed = new_engine(recipe)
    state = load_checkpoint(resumed, path)
    monkeypatch.setattr(torch, "load", real_load)
    assert (state.step, state.run_id) == (1, "run-a")
    assert loads and all(flag is True for flag in loads), loads  # every state file, restricted

    # Optimizer moments and schedule came back too: the next step lands on the same weights.
    train_step(original, 2)
    train_step(resumed, 2)
    expected, got = _weights(original), _weights(resumed)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=f"zero{stage} {precision} {name}")


class RunsShell:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class WritesFile:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.parametrize("payload,named", [(RunsShell, "posix.system"), (WritesFile, "builtins.exec")])
@pytest.mark.parametrize("defence", ["checksums rewritten", "no checksum list", "static check blind"])
def test_a_planted_pickle_runs_nothing_and_is_refused_by_name(payload, named, defence, saved, tmp_path, monkeypatch):
    out = _copy(saved, tmp_path)
    checkpoint = out / "checkpoints" / "step-4"
    marker = tmp_path / "ran"
    torch.save({"module": payload(marker)}, checkpoint / MODEL_STATES)
    if defence == "no checksum list":
        (checkpoint / CHECKSUMS).unlink()
    else:
        _rewrite_checksums(checkpoint)
    if defence == "static check blind":  # a global the static listing cannot see: torch.load stops it
        monkeypatch.setattr(safe_loading, "refused_globals", lambda path: [])
        named = named.split(".")[-1]

    with pytest.raises(MtaError) as error:
        load_checkpoint(saved["engine"], resolve_resume("auto", out))
    message = str(error.value)
    assert not marker.exists(), "code from the checkpoint ran"
    assert str(checkpoint / MODEL_STATES) in message and named in message
    assert "was not loaded" in message and "nothing in it ran" in message
    assert f"--resume {out / 'checkpoints' / 'step-2'}" in message

    # The planted file really would have run: this is what a plain torch.load did on resume.
    torch.load(checkpoint / MODEL_STATES, weights_only=False)
    assert marker.exists()


# --------------------------------------------------------------------------- integrity and broken files


def test_a_changed_byte_is_refused_before_anything_loads(saved, tmp_path, monkeypatch):
    out = _copy(saved, tmp_path)
    newest = out / "checkpoints" / "step-4"
    data = bytearray((newest / MODEL_STATES).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one weight different: loaded silently before
    (newest / MODEL_STATES).write_bytes(bytes(data))
    engine = saved["engine"]
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a, **k: pytest.fail("DeepSpeed was asked to load"))

    with pytest.raises(MtaError) as error:
        load_checkpoint(engine, resolve_resume("auto", out))
    message = str(error.value)
    assert f"{MODEL_STATES.as_posix()} (changed: sha256 differs)" in message
    assert "the checkpoint was not loaded" in message
    assert f"--resume {out / 'checkpoints' / 'step-2'}" in message

    # With the previous one damaged too, none is offered.
    (out / "checkpoints" / "step-2" / "recipe.yaml").write_text("edited\n")
    with pytest.raises(MtaError, match=r"No other checkpoint under .* passes") as error:
        load_checkpoint(engine, newest)
    assert "--resume" not in str(error.value).split("No other")[1]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


MODEL, OPTIM, EXTRA = (p.as_posix() for p in (MODEL_STATES, OPTIM_STATES, STATE / "mp_rank_01_model_states.pt"))
# fault: (how, what the message says with a checksum list, and without one: after "<checkpoint>/")
FAULTS = {
    "truncated model states": (lambda c: _truncate(c / MODEL), f"{MODEL} (changed", f"{MODEL}: unreadable (truncated"),
    "missing deepspeed/": (
        lambda c: shutil.rmtree(c / "deepspeed"),
        f"{MODEL} (missing)",
        f"{STATE.as_posix()} is missing",
    ),
    "truncated trainer_state.json": (
        lambda c: _truncate(c / "trainer_state.json"),
        "trainer_state.json (changed",
        "trainer_state.json is not valid JSON",
    ),
    "missing optimizer file": (
        lambda c: (c / OPTIM).unlink(),
        f"{OPTIM} (missing)",
        f"{OPTIM}: missing; the file was not loaded",
    ),
    "an unlisted state file": (lambda c: shutil.copy(c / MODEL, c / EXTRA), f"{EXTRA} (not in {CHECKSUMS})", None),
}


@pytest.mark.parametrize(
    "fault,listed",
    [
        pytest.param(fault, listed, id=f"{fault}, {'with list' if listed else 'older mta, no list'}")
        for fault in FAULTS
        for listed in (True, False)
        if listed or FAULTS[fault][2] is not None  # without a list an added file looks written
    ],
)
def test_a_broken_checkpoint_is_refused_naming_the_file_and_the_previous_one(fault, listed, saved, tmp_path):
    breaks, with_list, without_list = FAULTS[fault]
    out = _copy(saved, tmp_path)
    newest = out / "checkpoints" / "step-4"
    if not listed:
        (newest / CHECKSUMS).unlink()
    breaks(newest)

    assert resolve_resume("auto", out) == newest  # still the newest complete: refused, not skipped
    with pytest.raises(MtaError) as error:
        load_checkpoint(saved["engine"], resolve_resume("auto", out))
    message = str(error.value)
    if listed:
        assert f"{newest} is not the checkpoint that was written: " in message and with_list in message
    else:
        assert f"{newest}/{without_list}" in message
    assert f"--resume {out / 'checkpoints' / 'step-2'}" in message


def test_a_checkpoint_of_older_mta_resumes_with_a_warning(saved, tmp_path, caplog):
    out = _copy(saved, tmp_path)
    older = out / "checkpoints" / "step-4"
    (older / CHECKSUMS).unlink()
    state = json.loads((older / "trainer_state.json").read_text())
    del state["run_id"]
    (older / "trainer_state.json").write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="mta.training.lifecycle.checkpointing"):
        loaded = load_checkpoint(saved["engine"], older)
    assert (loaded.step, loaded.run_id) == (4, "")
    assert f"{older} has no {CHECKSUMS}" in caplog.text


# --------------------------------------------------------------------------- saving


def test_a_full_disk_while_saving_loses_nothing(saved, tmp_path, monkeypatch):
    out = _copy(saved, tmp_path)
    root = out / "checkpoints"
    partial = root / "step-6.partial"
    real_usage = shutil.disk_usage

    def usage(path):  # full while the partial checkpoint holds its bytes
        real = real_usage(path)
        return real._replace(free=1 << 20) if partial.exists() else real

    def torch_save_fills_the_disk(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK\x03\x04 half a file")
        raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 1472 vs 1400")

    monkeypatch.setattr(shutil, "disk_usage", usage)
    monkeypatch.setattr(torch, "save", torch_save_fills_the_disk)
    with pytest.raises(MtaError) as error:
        save_checkpoint(saved["engine"], saved["tokenizer"], saved["recipe"], out, TrainerState(6, 8, run_id="r"))
    message = str(error.value)
    assert message.startswith(f"disk full while writing {root / 'step-6'}; nothing was lost")
    assert "step-2, step-4) are intact" in message and "--resume auto" in message
    assert isinstance(error.value.__cause__, RuntimeError)
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4"]
    for step in (2, 4):
        checkpointing.verify_checkpoint(root / f"step-{step}")  # byte for byte as written


@pytest.mark.parametrize(
    ("text", "headline", "fix"),
    [  # safetensors' own texts, as it wrote them on a full 64 KiB tmpfs (and for a quota)
        ("Error while serializing: I/O error: No space left on device (os error 28)", "disk full", "free space"),
        (
            "Error while serializing: I/O error: Disk quota exceeded (os error 122)",
            "disk full (disk quota exceeded)",
            "free space or raise the quota",
        ),
    ],
    ids=["ENOSPC", "EDQUOT"],
)
def test_safetensors_finding_the_disk_full_while_saving_is_one_line_and_loses_nothing(
    text, headline, fix, saved, tmp_path, monkeypatch
):
    import transformers.modeling_utils
    from safetensors import SafetensorError

    out = _copy(saved, tmp_path)
    root = out / "checkpoints"

    def save_file_on_a_full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 64)  # what it wrote before the disk was full
        raise SafetensorError(text)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file_on_a_full_disk)
    with pytest.raises(MtaError) as error:
        save_checkpoint(saved["engine"], saved["tokenizer"], saved["recipe"], out, TrainerState(6, 8, run_id="r"))
    assert str(error.value) == (
        f"{headline} while writing {root / 'step-6'}; nothing was lost: the unfinished step-6.partial was "
        f"removed and the earlier checkpoints (step-2, step-4) are intact; {fix} and continue with --resume auto"
    )
    assert type(error.value.__cause__) is SafetensorError
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4"]
    for step in (2, 4):
        checkpointing.verify_checkpoint(root / f"step-{step}")


def test_final_carries_a_checksum_list(saved, tmp_path):
    final = checkpointing.save_final(saved["engine"], saved["tokenizer"], saved["recipe"], tmp_path)
    assert final == tmp_path / "final" and not (tmp_path / "final.partial").exists()
    listed = read_checksums(final)
    assert listed == directory_checksums(final) and "model.safetensors" in listed


def _other_runs_checkpoint(root: Path, step: int, run_id: str | None) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    state = {"step": step, "total_steps": 100, "rng": []} | ({"run_id": run_id} if run_id is not None else {})
    (path / "trainer_state.json").write_text(json.dumps(state))
    return path


def test_pruning_removes_only_this_runs_older_checkpoints(saved, tmp_path):
    out = tmp_path / "out"
    root = out / "checkpoints"
    # Another run's, older and newer in steps, and one of older mta (no run_id: run "").
    for step, run_id in ((4, "other"), (40, "other"), (48, "other"), (6, None)):
        _other_runs_checkpoint(root, step, run_id)
    engine, tokenizer, recipe = saved["engine"], saved["tokenizer"], saved["recipe"]
    assert recipe.train.keep_checkpoints == 2
    for step in (8, 16):
        save_checkpoint(engine, tokenizer, recipe, out, TrainerState(step, 64, run_id="this"))
    steps = lambda: sorted(int(p.name.split("-")[1]) for p in root.iterdir())  # noqa: E731
    assert steps() == [4, 6, 8, 16, 40, 48]  # the other runs' are not this run's to prune
    save_checkpoint(engine, tokenizer, recipe, out, TrainerState(24, 64, run_id="this"))
    assert steps() == [4, 6, 16, 24, 40, 48]
    assert json.loads((root / "step-24" / "trainer_state.json").read_text())["run_id"] == "this"
