"""Every checksum path on tiny files, against a plain restatement: a checkpoint's and ``final/``'s
``checksums.sha256`` (sha256sum format; a resume refuses changed bytes), the sha256 the annotate
manifest records per part, and the evaluation fingerprint of a checkpoint's model files."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fixtures.recipes import tiny_recipe
from mta.data.annotations import read_annotations
from mta.errors import MtaError
from mta.evaluation.layout import CheckpointPaths, check_claim, generation_manifest
from mta.evaluation.settings import EvalSettings
from mta.hashing import checksum_text, directory_checksums, read_checksums
from mta.models.weights import check_weights, checkpoint_fingerprint
from mta.store.manifests import checked_manifest, part_is_intact
from mta.training.lifecycle import checkpointing

COMMITTED_V1 = Path(__file__).parent / "data" / "annotate-v1"
LIST = "checksums.sha256"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def restated_list(directory: Path) -> str:
    """``sha256sum`` lines of every file under ``directory`` but the list and hidden files, sorted."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != LIST and not p.name.startswith("."))
    return "".join(f"{sha256(p)}  {p.relative_to(directory).as_posix()}\n" for p in files)


def restated_differences(directory: Path) -> set[str]:
    """The files whose bytes are not what the directory's list records, missing or unlisted."""
    listed = dict(reversed(line.split("  ", 1)) for line in (directory / LIST).read_text().splitlines())
    present = {p.relative_to(directory).as_posix(): sha256(p) for p in directory.rglob("*") if p.is_file()}
    present.pop(LIST)
    return {name for name in listed.keys() | present.keys() if listed.get(name) != present.get(name)}


def fake_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint with every file a resume checks, a few bytes each, and its list written last."""
    path = root / "checkpoints" / f"step-{step}"
    (path / "deepspeed" / "state").mkdir(parents=True)
    torch.save({"weights": torch.zeros(2)}, path / "deepspeed" / "state" / "mp_rank_00_model_states.pt")
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "total_steps": 10, "rng": [], "run_id": "r"}))
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"weights of step %d" % step)
    (path / "recipe.yaml").write_text("name: fake\n")
    (path / LIST).write_text(checksum_text(directory_checksums(path)))
    return path


def test_a_checkpoint_list_is_sha256sum_of_every_other_file(tmp_path):
    path = fake_checkpoint(tmp_path, 2)
    assert (path / LIST).read_text() == restated_list(path)
    assert read_checksums(path) == {
        name: digest for digest, name in (line.split("  ") for line in restated_list(path).splitlines())
    }
    checkpointing.verify_checkpoint(path)  # as written: resumes


@pytest.mark.parametrize(
    "damage",
    ["changed byte", "listed file missing", "unlisted file", "state file changed"],
)
def test_a_resume_refuses_changed_bytes_naming_the_file_and_the_previous_checkpoint(damage, tmp_path):
    previous = fake_checkpoint(tmp_path, 2)
    path = fake_checkpoint(tmp_path, 4)
    if damage == "changed byte":
        (path / "model.safetensors").write_bytes(b"weights of step 5")
    elif damage == "listed file missing":
        (path / "config.json").unlink()
    elif damage == "unlisted file":
        (path / "planted.py").write_text("print('hi')")
    else:
        torch.save({"weights": torch.ones(2)}, path / "deepspeed" / "state" / "mp_rank_00_model_states.pt")
    (named,) = restated_differences(path)
    with pytest.raises(MtaError) as caught:
        checkpointing.verify_checkpoint(path)
    message = str(caught.value)
    assert named in message and "not the checkpoint that was written" in message
    assert f"--resume {previous}" in message and "nothing of it was read" in message


def test_a_corrupt_list_is_refused_and_a_checkpoint_without_one_resumes_with_a_warning(tmp_path, caplog):
    path = fake_checkpoint(tmp_path, 2)
    (path / LIST).write_text((path / LIST).read_text() + "not-a-digest  config.json\n")
    with pytest.raises(MtaError, match="the list is corrupt"):
        checkpointing.verify_checkpoint(path)
    (path / LIST).write_text(f"{'0' * 64}  ../outside.txt\n")
    with pytest.raises(MtaError, match="the list is corrupt"):
        checkpointing.verify_checkpoint(path)
    (path / LIST).unlink()
    with caplog.at_level(logging.WARNING):
        checkpointing.verify_checkpoint(path)
    assert "could not be verified" in caplog.text


def export_tiny(engine, tokenizer, recipe, directory: Path, **kwargs) -> None:
    """What export_student writes, a few bytes a file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(b"student weights")
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.json").write_text("{}")
    (directory / "sub").mkdir()
    (directory / "sub" / "nested.json").write_text("{}")


@pytest.mark.parametrize("which", ["final", "best"])
def test_final_and_best_carry_the_list_of_every_file_they_hold(which, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "export_student", export_tiny)
    if which == "final":
        directory = checkpointing.save_final(None, None, tiny_recipe(), tmp_path)
    else:
        chosen = {"select_by": "loss", "metric": "dev/loss", "goal": "lowest", "value": 1.0, "step": 2, "run_id": "r"}
        directory = checkpointing.save_best(None, None, tiny_recipe(), tmp_path, chosen)
    assert directory == tmp_path / which and not (tmp_path / f"{which}.partial").exists()
    assert (directory / LIST).read_text() == restated_list(directory)
    listed = read_checksums(directory)
    assert {"README.md", "model.safetensors", "sub/nested.json"} <= listed.keys()
    assert ("selection.json" in listed) is (which == "best")


# --- annotate parts ------------------------------------------------------------------------


def artefact_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(COMMITTED_V1, tmp_path / "annotations"))


def test_a_part_is_intact_exactly_when_its_bytes_have_the_recorded_sha256(tmp_path):
    out = artefact_copy(tmp_path)
    (entry,) = json.loads((out / "manifest.json").read_text())["parts"]
    part = out / entry["file"]
    assert entry["sha256"] == sha256(part) and part_is_intact(out, entry)
    assert part_is_intact(out, {**entry, "sha256": None})  # none recorded: the file is enough
    assert not part_is_intact(out, {**entry, "sha256": "0" * 64})
    part.write_bytes(part.read_bytes() + b"\0")
    assert entry["sha256"] != sha256(part) and not part_is_intact(out, entry)
    part.unlink()
    assert not part_is_intact(out, {**entry, "sha256": None})


def test_a_read_refuses_a_part_whose_sha256_differs_from_the_manifest(tmp_path):
    out = artefact_copy(tmp_path)
    assert len(read_annotations(out)) == 5
    (entry,) = json.loads((out / "manifest.json").read_text())["parts"]
    part = out / entry["file"]
    part.write_bytes(part.read_bytes()[:-1] + bytes([part.read_bytes()[-1] ^ 1]))
    with pytest.raises(MtaError, match=rf"{entry['file']} does not match manifest.json: its sha256 is {sha256(part)}"):
        read_annotations(out)


@pytest.mark.parametrize(
    "entry, named",
    [
        ({"file": "../part-00000-of-00001-x.parquet", "rows": 1, "sha256": "0" * 64}, "parts[0].file"),
        ({"file": "part-00000-of-00001-x.parquet", "rows": 1, "sha256": "ABC"}, "parts[0].sha256"),
        ({"file": "part-00000-of-00001-x.parquet", "rows": -1, "sha256": "0" * 64}, "parts[0].rows"),
    ],
)
def test_a_manifest_entry_that_is_no_part_of_the_directory_is_refused(entry, named, tmp_path):
    with pytest.raises(MtaError, match=rf"{re.escape(named)} is .* is refused \(nothing in it was read or deleted\)"):
        checked_manifest(tmp_path / ".mta" / "manifest.json", {"parts": [entry]})


# --- evaluation fingerprints ---------------------------------------------------------------


def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    save_file({"w": torch.zeros(3)}, directory / "model.safetensors")
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.json").write_text('{"vocab": 1}')
    (directory / "generation_config.json").write_text("{}")
    (directory / "recipe.yaml").write_text("name: x\n")  # a training record, not a model file
    (directory / "trainer_state.json").write_text("{}")
    return directory


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def restated_fingerprint(directory: Path) -> str:
    """sha256 of {model file: sha256} as canonical JSON (sorted keys), prefixed ``sha256:``."""
    digests = {name: sha256(directory / name) for name in MODEL_FILES}
    return "sha256:" + hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def test_the_fingerprint_is_the_sha256_of_the_model_files_and_nothing_else(tmp_path):
    directory = model_dir(tmp_path)
    fingerprint, files = checkpoint_fingerprint(str(directory))
    assert fingerprint == restated_fingerprint(directory) and sorted(files) == list(MODEL_FILES)
    (directory / "recipe.yaml").write_text("name: y\n")
    assert checkpoint_fingerprint(str(directory))[0] == fingerprint
    for name in ("tokenizer.json", "config.json"):
        (directory / name).write_text((directory / name).read_text() + " ")
        assert checkpoint_fingerprint(str(directory))[0] == restated_fingerprint(directory) != fingerprint


def test_the_list_is_verified_for_model_files_and_leaves_the_fingerprint_as_it_is(tmp_path):
    directory = model_dir(tmp_path)
    plain = checkpoint_fingerprint(str(directory))[0]
    (directory / LIST).write_text(restated_list(directory).replace("  ", "  ./"))  # `find .` style names
    assert checkpoint_fingerprint(str(directory))[0] == plain
    (directory / "recipe.yaml").write_text("name: changed\n")  # listed, but not a model file
    assert checkpoint_fingerprint(str(directory))[0] == plain
    (directory / "tokenizer.json").write_text('{"vocab": 2}')
    with pytest.raises(MtaError, match=r"tokenizer.json does not match its checksums.sha256"):
        checkpoint_fingerprint(str(directory))


def test_predictions_of_other_model_files_at_the_same_path_are_refused_naming_the_file(tmp_path):
    directory = model_dir(tmp_path)
    paths = CheckpointPaths.of(tmp_path / "eval", "model")
    paths.root.mkdir(parents=True)
    before = generation_manifest(str(directory), EvalSettings(), torch.float32, *checkpoint_fingerprint(str(directory)))
    paths.manifest.write_text(json.dumps(before))
    assert check_claim(paths, before) is True  # the same files: reused
    (directory / "tokenizer.json").write_text('{"vocab": 3}')
    after = generation_manifest(str(directory), EvalSettings(), torch.float32, *checkpoint_fingerprint(str(directory)))
    with pytest.raises(MtaError, match=r"cannot be reused: the checkpoint .* changed since .*: tokenizer.json changed"):
        check_claim(paths, after)


def test_weights_that_are_not_whole_are_refused_before_anything_loads(tmp_path):
    directory = model_dir(tmp_path)
    check_weights(directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(MtaError, match="is truncated"):
        check_weights(directory)
    weights.unlink()
    with pytest.raises(MtaError, match="has no weights"):
        check_weights(directory)
