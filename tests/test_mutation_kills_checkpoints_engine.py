"""What checkpointing hands to the engine, the student, the tokenizer and the disk when it saves and
resumes (mta.training.lifecycle.checkpointing), driven through a fake engine on tmp_path: which
files land where and in which order, the checksum list written last, the unfinished directory
removed on an error with the message that says what was kept, the model card of final/ and best/,
the state a resume returns and the RNG it restores, and each refusal's wording.

The fake engine is a plain object with what checkpointing calls of a DeepSpeed engine
(``module.student``, ``save_checkpoint``, ``load_checkpoint``, ``checkpoint_engine``, the ZeRO-3
gather); the real engines are built in tests/test_checkpoint_faults.py, too slow for mutation
testing (bench/mutation.py). Expected checksums are restated with hashlib, expected files and
messages come from the module docstring's layout and the documented wording. One process.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from fixtures.recipes import tiny_recipe
from mta.errors import MtaError
from mta.training import lora
from mta.training.config.loading import recipe_to_yaml
from mta.training.lifecycle import checkpointing
from mta.training.lifecycle.checkpointing import TrainerState
from mta.training.lifecycle.safe_loading import CheckpointFileError
from mta.versions import package_versions

LIST = "checksums.sha256"


def restated_checksums(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` but the list itself and hidden files."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in directory.rglob("*")
        if p.is_file() and p.name != LIST and not p.name.startswith(".")
    }


def listed_checksums(directory: Path) -> dict[str, str]:
    return {
        name: digest for digest, name in (line.split("  ", 1) for line in (directory / LIST).read_text().splitlines())
    }


def files_under(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


class Student(torch.nn.Module):
    """A Hugging Face model as checkpointing sees it: a state dict and ``save_pretrained``."""

    def __init__(self, name_or_path: str | None = "base/student"):
        super().__init__()
        if name_or_path is not None:  # a student that is no Hugging Face model has none
            self.name_or_path = name_or_path
        self.proj = torch.nn.Linear(2, 3)
        self.saves = []

    def save_pretrained(self, path, state_dict=None, safe_serialization=False):
        self.saves.append((path, state_dict, safe_serialization))
        Path(path, "model.safetensors").write_bytes(b"weights:" + ",".join(sorted(state_dict)).encode())
        Path(path, "config.json").write_text('{"model_type": "tiny"}')


class Tokenizer:
    def __init__(self, fail: BaseException | None = None):
        self.saves = []
        self.fail = fail

    def save_pretrained(self, path):
        self.saves.append(path)
        if self.fail is not None:
            raise self.fail
        Path(path, "tokenizer.json").write_text("{}")


class Engine:
    """What checkpointing calls of a DeepSpeed engine; records each call with what the directory
    held at that moment."""

    def __init__(self, *, zero3_state=None, zero3=False, loaded="state", load_error=None, save_error=None):
        self.module = SimpleNamespace(student=Student())
        self.zero3, self.zero3_state = zero3, zero3_state
        self.loaded, self.load_error, self.save_error = loaded, load_error, save_error
        self.checkpoint_engine = "inner"
        self.saves, self.loads = [], []

    def zero_optimization_partition_weights(self):
        return self.zero3

    def _zero3_consolidated_16bit_state_dict(self):
        return self.zero3_state

    def save_checkpoint(self, save_dir, tag):
        self.saves.append((save_dir, tag, files_under(Path(save_dir).parent)))
        if self.save_error is not None:
            raise self.save_error
        (Path(save_dir) / tag).mkdir(parents=True)
        torch.save({"module": {"w": torch.zeros(2)}}, Path(save_dir) / tag / "mp_rank_00_model_states.pt")

    def load_checkpoint(self, load_dir, tag):
        self.loads.append((load_dir, tag, self.checkpoint_engine))
        if self.load_error is not None:
            raise self.load_error
        return (None if self.loaded is None else str(Path(load_dir) / tag)), {}


@pytest.fixture
def no_lora(monkeypatch):
    monkeypatch.setattr(lora, "is_wrapped", lambda model: False)


@pytest.fixture
def fake_lora(monkeypatch):
    """A student taken for a LoRA one: the adapter saves and merges are recorded."""
    calls = {"adapter": [], "merged": []}

    def save_adapter(model, state, directory, base_model=None):
        calls["adapter"].append((model, state, directory, base_model))
        (directory / "adapter").mkdir()
        (directory / "adapter" / "adapter_model.safetensors").write_bytes(b"adapter")

    def merged_state_dict(model, state):
        calls["merged"].append((model, state))
        return {"merged.weight": torch.ones(1)}

    monkeypatch.setattr(lora, "is_wrapped", lambda model: isinstance(model, Student))
    monkeypatch.setattr(lora, "save_adapter", save_adapter)
    monkeypatch.setattr(lora, "merged_state_dict", merged_state_dict)
    return calls


def published_checkpoint(output_dir: Path, step: int, run_id: str = "run-a") -> Path:
    path = output_dir / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "total_steps": 8, "rng": [], "run_id": run_id}))
    return path


# --------------------------------------------------------------------------- the student's state


def test_the_student_state_is_the_students_own_state_dict_without_zero3():
    engine = Engine()
    state = checkpointing.student_state_dict(engine)
    assert state.keys() == {"proj.weight", "proj.bias"}
    assert torch.equal(state["proj.weight"], engine.module.student.proj.weight)


def test_under_zero3_the_gathered_state_keeps_the_student_keys_without_their_prefix():
    weight, bias, teacher = torch.ones(2), torch.zeros(1), torch.full((1,), 7.0)
    gathered = {"student.proj.weight": weight, "teacher.proj.weight": teacher, "student.proj.bias": bias}
    state = checkpointing.student_state_dict(Engine(zero3=True, zero3_state=gathered))
    assert state == {"proj.weight": weight, "proj.bias": bias}


@pytest.mark.parametrize("gathered", [None, {}])
def test_under_zero3_a_rank_that_gathered_nothing_gets_none(gathered):
    assert checkpointing.student_state_dict(Engine(zero3=True, zero3_state=gathered)) is None


# --------------------------------------------------------------------------- export


def test_an_export_writes_weights_tokenizer_recipe_and_versions_into_a_new_directory(tmp_path, no_lora):
    engine, tokenizer, recipe = Engine(), Tokenizer(), tiny_recipe()
    directory = tmp_path / "a" / "b"
    checkpointing.export_student(engine, tokenizer, recipe, directory)
    (path, state, safe), *more = engine.module.student.saves
    assert not more and path == str(directory) and safe is True
    assert state.keys() == {"proj.weight", "proj.bias"}
    assert tokenizer.saves == [str(directory)]
    assert (directory / "recipe.yaml").read_text() == recipe_to_yaml(recipe)
    assert json.loads((directory / "versions.json").read_text()) == package_versions()
    assert files_under(directory) == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "recipe.yaml",
        "versions.json",
    }


def test_an_export_adds_the_modules_own_files_when_it_has_an_exporter(tmp_path, no_lora):
    engine = Engine()
    engine.module.export_files = lambda directory: (directory / "modules.json").write_text("[]")
    checkpointing.export_student(engine, Tokenizer(), tiny_recipe(), tmp_path / "out")
    assert (tmp_path / "out" / "modules.json").read_text() == "[]"


def test_a_lora_student_is_exported_merged_and_its_adapter_saved_only_when_asked(tmp_path, fake_lora):
    engine = Engine()
    student = engine.module.student
    checkpointing.export_student(engine, Tokenizer(), tiny_recipe(), tmp_path / "plain")
    assert fake_lora["adapter"] == []
    checkpointing.export_student(engine, Tokenizer(), tiny_recipe(), tmp_path / "ckpt", adapter=True)
    ((model, state, directory, base),) = fake_lora["adapter"]
    assert model is student and directory == tmp_path / "ckpt" and base == "base/student"
    assert state.keys() == {"proj.weight", "proj.bias"}
    assert [m for m, _ in fake_lora["merged"]] == [student, student]
    assert [set(s) for _, s in fake_lora["merged"]] == [{"proj.weight", "proj.bias"}] * 2
    assert [set(saved) for _, saved, _ in student.saves] == [{"merged.weight"}] * 2  # the merged state is written


def test_the_adapter_of_a_student_without_a_name_records_no_base_model(tmp_path, fake_lora):
    engine = Engine()
    engine.module.student = Student(name_or_path=None)
    checkpointing.export_student(engine, Tokenizer(), tiny_recipe(), tmp_path, adapter=True)
    assert [base for *_, base in fake_lora["adapter"]] == [None]


def test_a_lora_export_on_the_main_process_without_the_whole_state_stops_with_the_reason(tmp_path, fake_lora):
    with pytest.raises(AssertionError, match="^student_state_dict gives the main process the whole state$"):
        checkpointing.export_student(Engine(zero3=True, zero3_state=None), Tokenizer(), tiny_recipe(), tmp_path)


def test_a_rank_other_than_the_main_one_gathers_but_writes_nothing(tmp_path, no_lora, monkeypatch):
    monkeypatch.setattr(checkpointing.distributed, "is_main", lambda: False)
    engine = Engine(zero3=True, zero3_state=None)
    checkpointing.export_student(engine, Tokenizer(), tiny_recipe(), tmp_path / "out")
    assert not (tmp_path / "out").exists() and engine.module.student.saves == []


# --------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_is_written_in_order_published_whole_and_listed_last(tmp_path, fake_lora):
    engine, tokenizer, out = Engine(), Tokenizer(), tmp_path / "run"
    stale = out / "checkpoints" / "step-6.partial"
    stale.mkdir(parents=True)
    (stale / "stale.bin").write_bytes(b"from a crashed attempt")
    seen = []

    def extra_state(directory):
        seen.append((directory, files_under(directory)))
        (directory / "journal.json").write_text("{}")

    state = TrainerState(step=6, total_steps=8, run_id="run-a")
    rng = torch.get_rng_state().tolist()
    final = checkpointing.save_checkpoint(engine, tokenizer, tiny_recipe(), out, state, extra_state=extra_state)
    partial = out / "checkpoints" / "step-6.partial"
    assert final == out / "checkpoints" / "step-6" and final.is_dir() and not partial.exists()
    exported = {"model.safetensors", "config.json", "tokenizer.json", "recipe.yaml", "versions.json"}
    exported |= {"adapter/adapter_model.safetensors"}
    ((save_dir, tag, before),) = engine.saves
    assert (save_dir, tag) == (str(partial / "deepspeed"), "state") and before == exported
    assert tokenizer.saves == [str(partial)] and fake_lora["adapter"][0][2] == partial
    assert seen == [(partial, exported | {"deepspeed/state/mp_rank_00_model_states.pt"})]
    assert json.loads((final / "trainer_state.json").read_text()) == {
        "step": 6,
        "total_steps": 8,
        "rng": [rng],
        "run_id": "run-a",
    }
    everything = exported | {"deepspeed/state/mp_rank_00_model_states.pt", "journal.json", "trainer_state.json"}
    assert files_under(final) == everything | {LIST}
    assert listed_checksums(final) == restated_checksums(final) and listed_checksums(final).keys() == everything


def test_a_checkpoint_prunes_this_runs_older_ones_beyond_keep_checkpoints(tmp_path, no_lora):
    out = tmp_path / "run"
    for step in (2, 4):
        published_checkpoint(out, step)
    published_checkpoint(out, 3, run_id="other-run")
    state = TrainerState(step=6, total_steps=8, run_id="run-a")
    checkpointing.save_checkpoint(Engine(), Tokenizer(), tiny_recipe(keep_checkpoints=2), out, state)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-4", "step-6"]


def test_replacing_a_checkpoint_of_another_run_is_logged_and_of_the_same_run_is_not(tmp_path, no_lora, caplog):
    out = tmp_path / "run"
    published_checkpoint(out, 6, run_id="old-run")
    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        checkpointing.save_checkpoint(Engine(), Tokenizer(), tiny_recipe(), out, TrainerState(6, 8, run_id="run-a"))
    final = out / "checkpoints" / "step-6"
    assert caplog.messages == [f"replacing {final}, written by another run (run_id 'old-run')"]
    assert json.loads((final / "trainer_state.json").read_text())["run_id"] == "run-a"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        checkpointing.save_checkpoint(Engine(), Tokenizer(), tiny_recipe(), out, TrainerState(6, 8, run_id="run-a"))
    assert caplog.messages == []


def test_a_full_disk_while_checkpointing_removes_the_partial_and_names_the_intact_earlier_ones(tmp_path, no_lora):
    out = tmp_path / "run"
    for step in (2, 4, 6):
        published_checkpoint(out, step)
    full = OSError(errno.ENOSPC, "No space left on device")
    engine = Engine(save_error=full)
    with pytest.raises(MtaError) as raised:
        checkpointing.save_checkpoint(
            engine, Tokenizer(), tiny_recipe(keep_checkpoints=9), out, TrainerState(6, 8, run_id="run-a")
        )
    final = out / "checkpoints" / "step-6"
    assert str(raised.value) == (
        f"disk full while writing {final}; nothing was lost: the unfinished step-6.partial was removed and "
        "the earlier checkpoints (step-2, step-4) are intact; free space and continue with --resume auto"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]


def test_the_first_checkpoint_failing_says_there_was_none_before_and_an_interrupt_passes_unchanged(tmp_path, no_lora):
    out = tmp_path / "run"
    state = TrainerState(2, 8, run_id="run-a")
    with pytest.raises(MtaError, match="was removed and there was no earlier checkpoint; free space"):
        checkpointing.save_checkpoint(
            Engine(save_error=OSError(errno.ENOSPC, "full")), Tokenizer(), tiny_recipe(), out, state
        )
    interrupt = KeyboardInterrupt()

    def interrupted(directory):
        raise interrupt

    with pytest.raises(KeyboardInterrupt) as raised:
        checkpointing.save_checkpoint(Engine(), Tokenizer(), tiny_recipe(), out, state, extra_state=interrupted)
    assert raised.value is interrupt and list((out / "checkpoints").iterdir()) == []


# --------------------------------------------------------------------------- resuming


def saved(tmp_path: Path, step: int = 4, run_id: str = "run-a") -> Path:
    state = TrainerState(step=step, total_steps=8, run_id=run_id)
    return checkpointing.save_checkpoint(
        Engine(), Tokenizer(), tiny_recipe(keep_checkpoints=9), tmp_path / "run", state
    )


def test_a_resume_restores_the_state_and_the_rng_through_the_restricted_loader(tmp_path, no_lora):
    path = saved(tmp_path)
    expected_rng = torch.get_rng_state()
    engine = Engine()  # the generator moves on (its student's initialisation)
    torch.rand(5)
    state = checkpointing.load_checkpoint(engine, str(path))
    assert state == TrainerState(step=4, total_steps=8, rng=[expected_rng.tolist()], run_id="run-a")
    assert torch.equal(torch.get_rng_state(), expected_rng)
    ((load_dir, tag, during),) = engine.loads
    assert (load_dir, tag) == (str(path / "deepspeed"), "state")
    assert during != "inner" and engine.checkpoint_engine == "inner"  # restricted while loading only


def test_a_checkpoint_without_an_rng_for_this_rank_leaves_the_generator_alone(tmp_path, no_lora):
    path = saved(tmp_path)
    state_file = path / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "rng": []}))
    (path / LIST).unlink()  # as older mta wrote them: resumed after structural checks
    engine = Engine()  # its student's initialisation draws from the generator
    before = torch.get_rng_state()
    assert checkpointing.load_checkpoint(engine, path).rng == []
    assert torch.equal(torch.get_rng_state(), before)


def test_a_damaged_checkpoint_is_refused_before_the_engine_reads_it(tmp_path, no_lora):
    earlier, path = saved(tmp_path, 2), saved(tmp_path, 4)
    (path / "model.safetensors").write_bytes(b"other bytes")
    engine = Engine()
    with pytest.raises(MtaError) as raised:
        checkpointing.load_checkpoint(engine, path)
    message = str(raised.value)
    assert message.startswith(f"{path} is not the checkpoint that was written: ")
    assert "model.safetensors" in message
    assert message.endswith(f"Resume from the previous complete checkpoint instead: --resume {earlier}")
    assert engine.loads == []


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("size mismatch"),
        KeyError("optimizer"),
        ValueError("bad"),
        AssertionError("world size"),
        ZeRORuntimeException("zero stage"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_deepspeed_failing_to_restore_is_one_message_naming_the_state_and_the_way_on(tmp_path, no_lora, error):
    path = saved(tmp_path)
    with pytest.raises(MtaError) as raised:
        checkpointing.load_checkpoint(Engine(load_error=error), path)
    assert str(raised.value) == (
        f"{path / 'deepspeed'}: DeepSpeed could not restore this state into the run ({type(error).__name__}: "
        f"{error}); was it written with another model, ZeRO stage or number of processes? No other checkpoint "
        f"under {path.parent} passes these checks: start over with --overwrite, or resume from a copy you trust"
    )
    assert raised.value.__cause__ is error


def test_a_refused_state_file_and_an_empty_load_name_the_previous_checkpoint(tmp_path, no_lora):
    earlier, path = saved(tmp_path, 2), saved(tmp_path, 4)
    offer = f"Resume from the previous complete checkpoint instead: --resume {earlier}"
    refused = CheckpointFileError(path / "deepspeed" / "state" / "x.pt", "needs os.system")
    with pytest.raises(MtaError) as raised:
        checkpointing.load_checkpoint(Engine(load_error=refused), path)
    assert str(raised.value) == f"{refused}; the file was not loaded and the resume stopped. {offer}"
    assert raised.value.__cause__ is refused
    with pytest.raises(MtaError) as raised:
        checkpointing.load_checkpoint(Engine(loaded=None), path)
    assert str(raised.value) == f"{path / 'deepspeed'}: DeepSpeed found no state to load. {offer}"


# --------------------------------------------------------------------------- final/ and best/


def write_metrics(output_dir: Path, *records: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_final_is_exported_through_its_partial_with_the_newest_checkpoint_step_on_its_card(tmp_path, no_lora):
    out = tmp_path / "run"
    published_checkpoint(out, 3)
    published_checkpoint(out, 7)
    write_metrics(out, {"split": "dev", "step": 5, "loss": 1.25}, {"split": "train", "step": 7, "loss": 9.0})
    stale = out / "final.partial"
    stale.mkdir()
    (stale / "stale.bin").write_bytes(b"from a crashed attempt")
    engine, tokenizer = Engine(), Tokenizer()
    assert checkpointing.save_final(engine, tokenizer, tiny_recipe(), out) == out / "final"
    final = out / "final"
    assert tokenizer.saves == [str(stale)] and engine.module.student.saves[0][0] == str(stale)
    assert not stale.exists()
    assert files_under(final) == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "recipe.yaml",
        "versions.json",
        "README.md",
        LIST,
    }
    assert listed_checksums(final) == restated_checksums(final)
    card = (final / "README.md").read_text()
    assert "# tiny: distilled student (final)" in card
    assert "| steps | 7 (global batch 2," in card
    assert "## Dev metrics at step 5 (the last before saving)" in card and "| loss | 1.2500 |" in card


def test_final_without_a_checkpoint_or_metrics_says_so_on_its_card(tmp_path, no_lora):
    out = tmp_path / "run"
    checkpointing.save_final(Engine(), Tokenizer(), tiny_recipe(), out)
    card = (out / "final" / "README.md").read_text()
    assert "| steps | not recorded (global batch 2," in card
    assert "No dev metrics were recorded" in card


SELECTION = {"select_by": "loss", "metric": "dev/loss", "goal": "lowest", "value": 0.75, "step": 4, "run_id": "r"}


def test_best_carries_its_selection_and_a_card_at_the_selected_step(tmp_path, no_lora):
    out = tmp_path / "run"
    published_checkpoint(out, 8)
    write_metrics(out, {"split": "dev", "step": 4, "loss": 0.75}, {"split": "dev", "step": 6, "loss": 2.5})
    engine, tokenizer = Engine(), Tokenizer()
    assert checkpointing.save_best(engine, tokenizer, tiny_recipe(), out, dict(SELECTION)) == out / "best"
    best = out / "best"
    assert tokenizer.saves == [str(out / "best.partial")] and not (out / "best.partial").exists()
    assert json.loads((best / "selection.json").read_text()) == SELECTION
    assert (best / "recipe.yaml").read_text() == recipe_to_yaml(tiny_recipe())
    assert listed_checksums(best) == restated_checksums(best) and "selection.json" in listed_checksums(best)
    card = (best / "README.md").read_text()
    assert "# tiny: distilled student (best)" in card
    assert "| steps | 4 (global batch 2," in card
    assert "| selected by | dev/loss = 0.7500 at step 4 (lowest of the run's dev evaluations) |" in card
    assert "## Dev metrics at step 4 (the last before saving)" in card and "| loss | 0.7500 |" in card


@pytest.mark.parametrize(
    ("which", "kept"),
    [
        ("final", "the checkpoints and any earlier final/ are intact"),
        ("best", "the checkpoints, final/ and the earlier best/ are intact"),
    ],
)
def test_a_full_disk_while_exporting_keeps_the_earlier_directory_and_says_what_is_intact(
    which, kept, tmp_path, no_lora
):
    out = tmp_path / "run"
    (out / which).mkdir(parents=True)
    (out / which / "model.safetensors").write_bytes(b"earlier")
    tokenizer = Tokenizer(fail=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(MtaError) as raised:
        if which == "final":
            checkpointing.save_final(Engine(), tokenizer, tiny_recipe(), out)
        else:
            checkpointing.save_best(Engine(), tokenizer, tiny_recipe(), out, dict(SELECTION))
    assert str(raised.value) == (
        f"disk full while writing {out / which}; nothing was lost: the unfinished {which}.partial was removed "
        f"and {kept}; free space and continue with --resume auto"
    )
    assert tokenizer.saves == [str(out / f"{which}.partial")]
    assert not (out / f"{which}.partial").exists() and files_under(out / which) == {"model.safetensors"}
