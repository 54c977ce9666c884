"""`mta evaluate` when the checkpoint or the disk lets it down: weights changed in place, a
corrupted file under a checksum list, missing or truncated weights, a full disk."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import mta.files
from mta.errors import MtaError
from mta.evaluation import EvalSettings, evaluate_checkpoints
from mta.evaluation import runner as runner_module
from mta.evaluation.models_under_test import check_checkpoint
from mta.files import Journal
from mta.hashing import CHECKSUMS, checksum_text, directory_checksums
from mta.models.weights import check_weights, checkpoint_fingerprint

SETTINGS = EvalSettings(benchmarks=["dolly"], seeds=[10], max_new_tokens=4, max_prompt_length=48, limit=2)


@pytest.fixture
def data_dir(tmp_path) -> Path:
    rows = [{"instruction": f"Name a colour, {i}.", "input": "", "output": f"Blue number {i}."} for i in range(4)]
    path = tmp_path / "data" / "dolly" / "valid.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return tmp_path / "data"


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny model, free to be changed."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "runs" / "final"))


def write_checksums(directory: Path) -> None:
    """What `mta distill` leaves in a checkpoint: the sha256sum list of its files."""
    (directory / CHECKSUMS).write_text(checksum_text(directory_checksums(directory)), encoding="utf-8")


def resave_perturbed(directory: Path) -> None:
    """The same path, other weights: what a re-run of training into the same directory does."""
    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(directory)


def must_not_load(*args, **kwargs):
    raise AssertionError("a model was loaded")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --------------------------------------------------------------------------- case 1: stale weights


def test_weights_changed_in_place_are_refused_not_scored_from_old_predictions(
    model_dir, data_dir, tmp_path, monkeypatch
):
    out = tmp_path / "eval"
    first = evaluate_checkpoints([model_dir], ["m"], data_dir, out, SETTINGS)
    manifest = json.loads((out / "predictions" / "m" / "generation.json").read_text())
    assert manifest["checkpoint_fingerprint"].startswith("sha256:")
    assert set(manifest["checkpoint_files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert first["checkpoints"]["m"]["fingerprint"] == manifest["checkpoint_fingerprint"]

    # Unchanged weights: reused, no model loaded.
    monkeypatch.setattr(runner_module, "loaded_checkpoint", must_not_load)
    again = evaluate_checkpoints([model_dir], ["m"], data_dir, out, SETTINGS)
    assert again["checkpoints"]["m"]["sets"] == first["checkpoints"]["m"]["sets"]
    results_before = (out / "results.json").read_bytes()  # after the reuse: it stamps a new time

    # Changed in place: refused before anything loads, naming the checkpoint and the file.
    resave_perturbed(model_dir)
    with pytest.raises(MtaError) as refused:
        evaluate_checkpoints([model_dir], ["m"], data_dir, out, SETTINGS)
    message = str(refused.value)
    assert f"the checkpoint {model_dir.resolve()} changed since they were made: model.safetensors changed" in message
    assert "another -o" in message and "--names" in message and "delete that directory" in message
    assert (out / "results.json").read_bytes() == results_before  # the old score is not reported anew

    # The fix the message gives: another label regenerates from the new weights.
    monkeypatch.undo()
    fresh = evaluate_checkpoints([model_dir], ["m2"], data_dir, out, SETTINGS)
    assert fresh["checkpoints"]["m2"]["fingerprint"] != manifest["checkpoint_fingerprint"]
    old = read_jsonl(out / "predictions" / "m" / "dolly" / "seed-10.jsonl")
    new = read_jsonl(out / "predictions" / "m2" / "dolly" / "seed-10.jsonl")
    assert [r["prediction"] for r in old] != [r["prediction"] for r in new]


def test_the_fingerprint_covers_tokenizer_and_config_not_training_records(model_dir):
    fingerprint, files = checkpoint_fingerprint(str(model_dir))
    (model_dir / "trainer_state.json").write_text("{}")
    (model_dir / "recipe.yaml").write_text("name: x\n")
    assert checkpoint_fingerprint(str(model_dir))[0] == fingerprint
    write_checksums(model_dir)  # the list changes nothing: the digests are the files' bytes
    assert checkpoint_fingerprint(str(model_dir)) == (fingerprint, files)
    (model_dir / CHECKSUMS).unlink()
    for name in ("tokenizer.json", "generation_config.json"):
        text = (model_dir / name).read_text()
        (model_dir / name).write_text(text.rstrip() + " \n")
        changed, _ = checkpoint_fingerprint(str(model_dir))
        assert changed != fingerprint, name
        fingerprint = changed


def test_predictions_from_an_mta_without_fingerprints_are_not_trusted(model_dir, data_dir, tmp_path):
    out = tmp_path / "eval"
    evaluate_checkpoints([model_dir], ["m"], data_dir, out, SETTINGS)
    manifest_path = out / "predictions" / "m" / "generation.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["checkpoint_fingerprint"], manifest["checkpoint_files"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(MtaError, match=r"an earlier mta made them without recording the fingerprint"):
        evaluate_checkpoints([model_dir], ["m"], data_dir, out, SETTINGS)


def test_a_hub_name_is_keyed_on_its_resolved_revision(monkeypatch):
    from transformers.utils import hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setattr(hub, "cached_file", lambda name, file, **_: f"/cache/models--org--m/snapshots/{commit}/{file}")
    assert checkpoint_fingerprint("org/m") == (f"hub:org/m@{commit}", {})

    def offline(*args, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(hub, "cached_file", offline)
    assert checkpoint_fingerprint("org/m") == ("hub:org/m", {})


# --------------------------------------------------------------------------- case 2: checksum list


def test_a_corrupted_weight_file_under_its_checksum_list_is_refused_first(
    tiny_model_dir, model_dir, data_dir, tmp_path, monkeypatch
):
    write_checksums(model_dir)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # same length, header intact: only the checksum can tell
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(runner_module, "loaded_checkpoint", must_not_load)
    with pytest.raises(MtaError, match=r"model\.safetensors does not match its checksums\.sha256") as refused:
        evaluate_checkpoints([tiny_model_dir, model_dir], None, data_dir, tmp_path / "eval", SETTINGS)
    assert str(model_dir) in str(refused.value) and "Restore the file" in str(refused.value)
    assert not (tmp_path / "eval").exists()

    (model_dir / "generation_config.json").unlink()  # listed, gone
    with pytest.raises(MtaError, match=r"generation_config\.json is listed in its checksums\.sha256 but missing"):
        checkpoint_fingerprint(str(model_dir))


# --------------------------------------------------------------------------- case 3: whole weights


def _truncate(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _garbage_header(directory: Path) -> None:
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"\x00" * 16 + data[24:])


def _no_weights(directory: Path) -> None:
    (directory / "model.safetensors").unlink()


def _empty_bin(directory: Path) -> None:
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"")


@pytest.mark.parametrize(
    "breaks, message",
    [
        (_truncate, r"model\.safetensors is truncated: its header describes \d+ bytes but the file holds \d+"),
        (_garbage_header, r"model\.safetensors has a corrupt safetensors header"),
        (_no_weights, r"has no weights \(model\.safetensors"),
        (_empty_bin, r"pytorch_model\.bin is empty"),
    ],
)
def test_broken_weights_fail_before_the_first_checkpoint_loads(
    tiny_model_dir, model_dir, data_dir, tmp_path, monkeypatch, breaks, message
):
    breaks(model_dir)
    monkeypatch.setattr(runner_module, "loaded_checkpoint", must_not_load)
    with pytest.raises(MtaError, match=message) as refused:
        evaluate_checkpoints([tiny_model_dir, model_dir], None, data_dir, tmp_path / "eval", SETTINGS)
    assert "again" in str(refused.value) or "redone" in str(refused.value)  # the fix
    assert not (tmp_path / "eval").exists()


def test_sharded_safetensors_are_checked_shard_by_shard(tiny_model_dir, tmp_path):
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(sharded, max_shard_size="50KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    check_weights(sharded)
    shards[-1].write_bytes(shards[-1].read_bytes()[:-1])
    with pytest.raises(MtaError, match=rf"{shards[-1].name} is truncated"):
        check_weights(sharded)
    shards[0].unlink()
    with pytest.raises(MtaError, match=rf"names shard\(s\) {shards[0].name} that are not in"):
        check_weights(sharded)


def test_check_checkpoint_reads_headers_only(model_dir, monkeypatch):
    """The up-front check never builds a model."""
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", must_not_load)
    check_checkpoint(str(model_dir))


# --------------------------------------------------------------------------- case 4: full disk


def _enospc():
    return OSError(errno.ENOSPC, "No space left on device")


class CountingGenerator(runner_module.HFGenerator):
    generated = 0

    def generate(self, prompts, seeds):
        CountingGenerator.generated += len(prompts)
        yield from super().generate(prompts, seeds)


def test_a_full_disk_while_journalling_loses_nothing_and_resumes(model_dir, data_dir, tmp_path, monkeypatch):
    settings = SETTINGS.model_copy(update={"seeds": [10, 20], "limit": 3, "batch_size": 2})
    reference = evaluate_checkpoints([model_dir], ["m"], data_dir, tmp_path / "uninterrupted", settings)
    out = tmp_path / "eval"
    real_append = Journal.append
    appends = {"seed-20": 0}

    def append(self, rows):
        if "seed-20" in self.path.name:
            appends["seed-20"] += 1
            if appends["seed-20"] == 2:  # the second batch of seed 20 finds the disk full
                self._handle.write('{"index": 2, "predic')  # a torn line, as a real full disk leaves
                self._handle.flush()
                raise _enospc()
        real_append(self, rows)

    monkeypatch.setattr(Journal, "append", append)
    with pytest.raises(MtaError) as full:
        evaluate_checkpoints([model_dir], ["m"], data_dir, out, settings)
    journal = out / "predictions" / "m" / "dolly" / "seed-20.rank0.journal.jsonl"
    assert str(full.value).startswith(f"disk full while writing {journal}; nothing was lost")
    assert "free space and re-run" in str(full.value)
    finished = out / "predictions" / "m" / "dolly" / "seed-10.jsonl"
    assert finished.read_bytes() == (tmp_path / "uninterrupted" / finished.relative_to(out)).read_bytes()
    assert len(mta.files.read_jsonl_lenient(journal)) == 2

    monkeypatch.setattr(Journal, "append", real_append)
    monkeypatch.setattr(runner_module, "HFGenerator", CountingGenerator)
    CountingGenerator.generated = 0
    resumed = evaluate_checkpoints([model_dir], ["m"], data_dir, out, settings)
    assert CountingGenerator.generated == 1  # only the row the full disk cost
    assert resumed["checkpoints"] == reference["checkpoints"]
    assert not journal.exists()


@pytest.mark.parametrize("target", ["seed-10.jsonl", "results.json"])
def test_a_full_disk_while_publishing_a_file_loses_nothing_and_resumes(
    model_dir, data_dir, tmp_path, monkeypatch, target
):
    out = tmp_path / "eval"
    real_publish = mta.files.publish

    def publish(temporary, path):
        if Path(path).name == target:
            raise _enospc()
        real_publish(temporary, path)

    monkeypatch.setattr(mta.files, "publish", publish)
    with pytest.raises(MtaError, match=rf"disk full while writing \S*{target}; nothing was lost"):
        evaluate_checkpoints([model_dir], ["m"], data_dir, out, SETTINGS)
    assert not list(out.rglob("*.tmp"))  # the unfinished file was removed
    assert (out / "predictions" / "m" / "generation.json").is_file()
    if target == "results.json":
        assert len(read_jsonl(out / "predictions" / "m" / "dolly" / "seed-10.jsonl")) == 2
    else:
        assert len(read_jsonl(out / "predictions" / "m" / "dolly" / "seed-10.rank0.journal.jsonl")) == 2

    monkeypatch.setattr(mta.files, "publish", real_publish)
    monkeypatch.setattr(runner_module, "HFGenerator", CountingGenerator)
    CountingGenerator.generated = 0
    results = evaluate_checkpoints([model_dir], ["m"], data_dir, out, SETTINGS)
    assert CountingGenerator.generated == 0  # every row was kept
    assert json.loads((out / "results.json").read_text())["checkpoints"] == results["checkpoints"]
