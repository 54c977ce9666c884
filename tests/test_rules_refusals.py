"""Each refusal the README promises, at the function level on tiny inputs (no model, no
subprocess). ``tests/test_rules_registry.py`` checks that every README sentence saying "refused"
names one of these tests (or another fast one)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from fixtures.planted import Planted
from mta.data.annotations import read_annotations
from mta.errors import MtaError
from mta.evaluation.layout import CheckpointPaths, check_claim, generation_manifest
from mta.evaluation.settings import EvalSettings
from mta.store.locks import shard_lock
from mta.store.manifests import check_directory
from mta.training.config.loading import load_recipe
from mta.training.config.resume_rules import check_resume_length
from mta.training.config.schema import Recipe
from mta.training.lifecycle import run_directory, safe_loading
from mta.training.train_data import check_manifest
from mta.training.trainer import NonFiniteLoss, NonFiniteWeights, Trainer

COMMITTED_V1 = Path(__file__).parent / "data" / "annotate-v1"

RECIPE = """\
name: refusals
output_dir: runs/refusals
teacher:
  path: teacher-model
student:
  path: student-model
data:
  train: train.jsonl
  max_length: {max_length}
  max_prompt_length: {max_prompt_length}
loss:
  base: fkl
train:
  lr: {lr}
  max_steps: 10
  batch_size: 4
  micro_batch_size: 2
  zero_stage: {zero_stage}
{asam}"""


def write_recipe(tmp_path: Path, **keys) -> Path:
    values = {"max_length": 256, "max_prompt_length": 128, "lr": "1.0e-4", "zero_stage": 1, "asam": ""} | keys
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.format(**values), encoding="utf-8")
    return path


# --- the recipe schema ---------------------------------------------------------------------


def test_the_valid_recipe_loads(tmp_path):
    assert load_recipe(write_recipe(tmp_path)).train.lr == 1e-4


@pytest.mark.parametrize("lr", [".inf", "-.inf", ".nan", "1e400"])
def test_a_non_finite_number_is_refused_by_the_schema(lr, tmp_path):
    with pytest.raises(MtaError, match=r"recipe.yaml: invalid recipe\n  line 14: train.lr: must be a finite number"):
        load_recipe(write_recipe(tmp_path, lr=lr))


@pytest.mark.parametrize(
    "lengths, problem",
    [
        ({"max_length": 4}, "data.max_length"),
        ({"max_length": 128, "max_prompt_length": 128}, "max_prompt_length must be smaller than max_length"),
        ({"max_prompt_length": 0}, "data.max_prompt_length"),
    ],
)
def test_impossible_lengths_are_refused_by_the_schema(lengths, problem, tmp_path):
    with pytest.raises(MtaError, match=problem):
        load_recipe(write_recipe(tmp_path, **lengths))


def test_asam_under_zero3_is_refused(tmp_path):
    asam = "  asam: {rho: 0.05}\n"
    assert load_recipe(write_recipe(tmp_path, zero_stage=2, asam=asam)).train.asam is not None
    with pytest.raises(MtaError, match="ASAM does not run under train.zero_stage=3"):
        load_recipe(write_recipe(tmp_path, zero_stage=3, asam=asam))


# --- the run directory ---------------------------------------------------------------------


# What a run writes of its own (README: run.json, checkpoints/, final/, metrics.jsonl; ARCHITECTURE.md
# adds best/; the trackers' and train.save_generated's outputs too). data/ and models/ are caches.
RUN_OUTPUTS = [
    "run.json",
    "checkpoints/",
    "final/",
    "best/",
    "metrics.jsonl",
    "generated/",
    "tensorboard/",
    "tracking.json",
]


@pytest.mark.parametrize("output", [name for name in RUN_OUTPUTS if name != "run.json"])
def test_a_directory_holding_any_one_run_output_is_refused_and_left_as_it_was(output, tmp_path):
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)  # a cache: never in the way
    if output.endswith("/"):
        (out / output / "step-1").mkdir(parents=True)
    else:
        (out / output).write_text(json.dumps({"run_id": "old"}))
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(MtaError) as caught:
        run_directory.claim(out, "new", resume=None, overwrite=False)
    message = str(caught.value)
    assert message.startswith(f"{out} holds another run's outputs ({output})")
    assert "--resume auto" in message and "--overwrite" in message
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert run_directory.claim(out, "new", resume=None, overwrite=True).continued is False
    assert sorted(p.name for p in out.iterdir() if p.name != ".run.lock") == ["data", "run.json"]


def test_a_directory_holding_only_a_failed_starts_run_json_is_taken_over(tmp_path):
    """README: a run that failed before its first step is not another run (issue 24, case 6)."""
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"run_id": "old", "recipe": "tiny"}))
    claimed = run_directory.claim(out, "new", resume=None, overwrite=False)
    assert claimed.continued is False and claimed.run_id != "old"
    assert json.loads((out / "run.json").read_text())["run_id"] == claimed.run_id
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["data", "run.json"]


def test_every_run_output_is_restated():
    assert {name.rstrip("/") for name in RUN_OUTPUTS} == set(run_directory.RUN_OUTPUTS)


# --- resume --------------------------------------------------------------------------------


def test_a_checkpoint_past_the_new_total_is_refused(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path))
    check_resume_length(10, 10, recipe, "step-10")
    with pytest.raises(MtaError, match=r"step-11 is at step 11, past the 10 steps this recipe trains"):
        check_resume_length(11, 10, recipe, "step-11")


def test_a_state_file_needing_another_type_is_refused_by_name_and_runs_nothing(tmp_path):
    plain = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "global_steps": 3}, plain)
    assert safe_loading.load_state_file(plain)["global_steps"] == 3
    planted, marker = tmp_path / "planted_optim_states.pt", tmp_path / "ran"
    torch.save({"optimizer": Planted(marker)}, planted)
    with pytest.raises(safe_loading.CheckpointFileError, match=r"planted_optim_states.pt: refused: .*posix.mkdir"):
        safe_loading.load_state_file(planted)
    assert not marker.exists()


# --- annotate ------------------------------------------------------------------------------


def test_a_second_writer_of_the_same_shard_is_refused_naming_its_pid(tmp_path):
    out = tmp_path / "annotations"
    out.mkdir()
    with shard_lock(out, 0, 2):
        with pytest.raises(MtaError, match=rf"\(pid {os.getpid()} on .*\) is writing shard 0/2 of"):
            with shard_lock(out, 0, 2):
                pass
        with shard_lock(out, 1, 2):  # another shard of the set runs beside it
            pass
    with shard_lock(out, 0, 2):  # released: the next writer gets it
        pass


def artefact_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(COMMITTED_V1, tmp_path / "deep" / "annotations"))


def rewrite_manifest(out: Path, **part) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["parts"][0].update(part)
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_a_part_outside_the_directory_is_refused_never_read_or_deleted(tmp_path):
    out = artefact_copy(tmp_path)
    victim = out.parent / "part-00000-of-00001-victim.parquet"
    shutil.copy(out / "part-00000-of-00001-ca7422ef.parquet", victim)
    rewrite_manifest(out, file="../part-00000-of-00001-victim.parquet")
    for refusing in (read_annotations, check_directory):
        with pytest.raises(MtaError, match=r"parts\[0\].file is .* is refused \(nothing in it was read or deleted\)"):
            refusing(out)
    assert victim.is_file()


@pytest.mark.parametrize("damage", ["swapped", "corrupt", "row count"])
def test_a_swapped_or_corrupt_part_is_refused_naming_it(damage, tmp_path):
    out = artefact_copy(tmp_path)
    part = out / "part-00000-of-00001-ca7422ef.parquet"
    if damage == "swapped":  # another valid part, fewer rows
        pq.write_table(pq.read_table(part).slice(0, 3), part)
        problem = "does not match manifest.json"
    elif damage == "corrupt":
        part.write_bytes(part.read_bytes()[:100])
        problem = "does not match manifest.json"
    else:
        rewrite_manifest(out, rows=4)
        problem = "has 5 rows, manifest.json says 4"
    with pytest.raises(MtaError, match=rf"{part.name} {problem}.* into a new directory"):
        read_annotations(out)


def fitting_recipe(**data) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "fit",
            "output_dir": "runs/fit",
            "teacher": {"path": "t"},
            "student": {"path": "s"},
            "data": {"train": "train", "max_length": 180, "max_prompt_length": 160, **data},
            "train": {"max_steps": 2, "batch_size": 2, "micro_batch_size": 2},
        }
    )


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"template": "none"}, "its prompt template records none, so alpaca but data.template is none"),
        ({"span_rule": "reference"}, "its span rule is paper but data.span_rule is reference"),
        ({"max_length": 200}, "its max_length is 180 but data.max_length is 200"),
        ({"fingerprint": "sha256:other"}, "its student tokenizer is 'student-tok300'"),
    ],
)
def test_annotations_built_for_another_template_rule_length_or_tokenizer_are_refused(data, problem, tmp_path):
    annotations = read_annotations(artefact_copy(tmp_path))
    fingerprints = {side: annotations.manifest[side]["fingerprint"] for side in ("teacher", "student")}
    check_manifest(annotations, fitting_recipe(), "data.train", "t", "s", fingerprints)
    if "fingerprint" in data:
        fingerprints["student"] = data.pop("fingerprint")
    with pytest.raises(MtaError, match=rf"data.train: the annotations in .* do not fit this recipe: .*{problem}"):
        check_manifest(annotations, fitting_recipe(**data), "data.train", "t", "s", fingerprints)


# --- evaluate ------------------------------------------------------------------------------


def test_predictions_made_with_other_settings_are_refused_naming_the_setting_and_the_fix(tmp_path):
    paths = CheckpointPaths.of(tmp_path, "model")
    paths.root.mkdir(parents=True)
    before = generation_manifest("gpt2", EvalSettings(), torch.float32, "hub:gpt2", {})
    paths.manifest.write_text(json.dumps(before))
    assert check_claim(paths, before)
    after = generation_manifest("gpt2", EvalSettings(max_new_tokens=7), torch.float32, "hub:gpt2", {})
    with pytest.raises(MtaError) as caught:
        check_claim(paths, after)
    message = str(caught.value)
    assert "made with other settings (max_new_tokens:" in message and "-> 7" in message
    assert "Write to another -o" in message and "delete that directory to regenerate them" in message


# --- a non-finite step (a guarantee beside the refusals) -----------------------------------


def fake_trainer(tmp_path: Path, poison: bool) -> SimpleNamespace:
    """What ``Trainer.step`` reads: a model whose optimizer step leaves NaN weights when ``poison``."""
    model = torch.nn.Linear(2, 2)

    def optimizer_step() -> None:
        if poison:
            with torch.no_grad():
                model.weight[0, 0] = float("nan")

    fake = SimpleNamespace(asam=None, micro_batches=lambda step: [])
    fake.run = SimpleNamespace(
        device="cpu",
        output_dir=tmp_path,
        engine=SimpleNamespace(
            module=model, step=optimizer_step, optimizer=SimpleNamespace(), get_global_grad_norm=lambda: None
        ),
        schedule=SimpleNamespace(accumulation=1),
        flops=SimpleNamespace(take=lambda: 0.0),
    )
    fake.window = lambda step: ([], {})
    fake.run_window = lambda window, step, options=None: ({}, len(list(window)))
    fake.stop_unless_finite_weights = lambda step: Trainer.stop_unless_finite_weights(fake, step)
    return fake


def test_a_non_finite_step_stops_before_the_step_returns(tmp_path):
    assert Trainer.step(fake_trainer(tmp_path, poison=False), 4)["tokens"] == 0
    with pytest.raises(NonFiniteWeights, match=r"step 5 left non-finite weights .* saved nothing of that step"):
        Trainer.step(fake_trainer(tmp_path, poison=True), 4)  # train() saves only after step() returns
    batch = SimpleNamespace(row_ids=["3", "4"])
    for bad in (float("nan"), float("inf")):
        losses = {"total": torch.tensor(bad), "base": torch.tensor(1.0)}
        with pytest.raises(NonFiniteLoss, match=r"non-finite loss at step 5 .*rows \['3', '4'\]; the run stopped"):
            Trainer.stop_unless_finite_loss(fake_trainer(tmp_path, poison=False), losses, 4, batch)
    Trainer.stop_unless_finite_loss(fake_trainer(tmp_path, poison=False), {"total": torch.tensor(1.0)}, 4, batch)
