"""`--dry-run` planning: offline meta-device models, parameter counts, batch and memory estimate."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest
from rich.console import Console
from transformers import AutoModelForCausalLM

from mta.errors import MtaError
from mta.models.tiny import build_tiny_model
from mta.training.dry_run import (
    estimate_memory,
    parameter_count,
    plan_model,
    plan_run,
)
from mta.training.recipe import ModelSpec, TinyModel, load_recipe

from conftest import MINIMAL_RECIPE
from mta_cli.dry_run_tables import render_plan

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "src" / "mta" / "recipes").glob("*.yaml"))



@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Planning must work offline: any connection attempt fails the test.

    Attempts are recorded, not only refused: the hub client turns a refused connection into an
    OSError that the code under test may handle.
    """
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield
    assert not attempts, f"planning tried to open network connections: {attempts}"


def write_recipe(tmp_path: Path, teacher: str, student: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(MINIMAL_RECIPE.format(teacher=teacher, student=student), encoding="utf-8")
    return path


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.name)
def test_dry_run_plans_every_recipe_offline(path):
    recipe = load_recipe(path)
    plan = plan_run(recipe, world_size=1)
    assert plan.student.parameters > 0
    assert plan.global_batch == recipe.train.batch_size
    assert plan.micro_batch_size * plan.accumulation_steps == recipe.train.batch_size
    for pair in plan.layers:
        assert 0 <= pair.student <= plan.student.num_layers
        assert 0 <= pair.teacher <= plan.teacher.num_layers
    if recipe.teacher is not None and recipe.loss.layers != "auto":
        assert plan.layers == recipe.loss.layers
    text = _rendered(plan)
    assert plan.student.architecture in text and f"{recipe.train.batch_size} =" in text


# Published sizes of the hub checkpoints (tied embeddings counted once).
PUBLISHED_PARAMETERS = {
    "gpt2.yaml": (1_557_611_200, 124_439_808),
    "opt.yaml": (6_658_473_984, 1_315_758_080),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_paper_configs_give_the_published_parameter_counts(name):
    plan = plan_run(load_recipe(REPO / "src" / "mta" / "recipes" / name))
    assert (plan.teacher.parameters, plan.student.parameters) == PUBLISHED_PARAMETERS[name]


def test_qwen_configs_keep_the_padded_embedding_rows():
    plan = plan_run(load_recipe(REPO / "src" / "mta" / "recipes" / "qwen.yaml"))
    assert plan.teacher.vocab_rows == plan.student.vocab_rows == 151_936  # 151,646 real tokens
    assert (plan.teacher.num_layers, plan.student.num_layers) == (24, 24)
    assert (plan.teacher.hidden_size, plan.student.hidden_size) == (2048, 1024)
    # 0.5B ties its output layer to the embeddings, 1.8B does not.
    assert 450e6 < plan.student.parameters < 470e6
    assert 1.8e9 < plan.teacher.parameters < 1.85e9


def test_cross_tokenizer_plan_projects_spans_between_widths():
    plan = plan_run(load_recipe(REPO / "src" / "mta" / "recipes" / "cross-tokenizer.yaml"), world_size=2)
    assert [(p.student, p.teacher, p.granularity) for p in plan.layers] == [
        (6, 12, "word"), (9, 18, "phrase"), (12, 24, "phrase")
    ]
    assert plan.projector_parameters == 3 * (768 * 2048 + 2048)
    assert (plan.accumulation_steps, plan.global_batch) == (1, 16)


def test_parameter_count_equals_a_real_model(tiny_model_dir, tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, str(tiny_model_dir), str(tiny_model_dir)))
    planned = plan_model(recipe.student, recipe, "student")
    real = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert planned.parameters == sum(p.numel() for p in real.parameters())
    assert planned.parameters == parameter_count(real)
    assert planned.num_layers == real.config.num_hidden_layers
    assert planned.config_source == str(tiny_model_dir)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2"])
def test_tiny_spec_plans_the_model_build_tiny_model_builds(
    model_type, tiny_tokenizer_dir, tmp_path
):
    tiny = TinyModel(model_type=model_type, num_layers=3, hidden_size=16, num_heads=2,
                     tokenizer_corpus="examples/tiny.jsonl", vocab_size=512)
    recipe = load_recipe(write_recipe(tmp_path, "unused", "unused"))
    planned = plan_model(ModelSpec(path=str(tmp_path / "absent"), tiny=tiny), recipe, "student")
    built = build_tiny_model(tiny_tokenizer_dir, tmp_path / model_type, model_type=model_type,
                             num_layers=3, hidden_size=16, num_heads=2)
    real = AutoModelForCausalLM.from_pretrained(built)
    assert planned.parameters == sum(p.numel() for p in real.parameters())
    assert planned.vocab_rows == real.get_input_embeddings().num_embeddings == 512


def test_model_without_an_offline_config_names_the_key_to_add(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, "no-such-org/teacher", "no-such-org/student"))
    with pytest.raises(MtaError) as caught:
        plan_run(recipe)
    assert "student.path='no-such-org/student'" in str(caught.value)
    assert "student.config: configs/<model>.json" in str(caught.value)


def test_config_is_found_in_the_hugging_face_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--some-org--student" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text(
        (REPO / "src" / "mta" / "recipes" / "configs" / "gpt2.json").read_text(encoding="utf-8")
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    recipe = load_recipe(write_recipe(tmp_path, "unused", "some-org/student"))
    planned = plan_model(recipe.student, recipe, "student")
    assert planned.parameters == 124_439_808
    assert planned.config_source == "Hugging Face cache (some-org/student)"


def test_missing_config_file_is_named(tmp_path):
    recipe = load_recipe(
        REPO / "src" / "mta" / "recipes" / "gpt2.yaml", ["student.config=configs/gpt2-small.json"]
    )
    with pytest.raises(MtaError, match="student.config='configs/gpt2-small.json' does not exist"):
        plan_run(recipe)


def test_layer_pair_past_the_teacher_depth_fails_the_dry_run():
    recipe = load_recipe(REPO / "src" / "mta" / "recipes" / "gpt2.yaml", ["loss.layers.2.1=49"])
    with pytest.raises(MtaError, match=r"loss.layers\[2\]: teacher layer 49 does not exist"):
        plan_run(recipe)


def test_global_batch_stays_fixed_across_world_sizes(tmp_path):
    tiny = "\n  tiny: {tokenizer_corpus: corpus.jsonl, num_layers: 2}"
    recipe = load_recipe(
        write_recipe(tmp_path, "t" + tiny, "s" + tiny),
        ["train.batch_size=16", "train.micro_batch_size=2"],
    )
    for world_size, accumulation in ((1, 8), (2, 4), (4, 2), (8, 1)):
        plan = plan_run(recipe, world_size=world_size)
        assert (plan.accumulation_steps, plan.global_batch) == (accumulation, 16)
    with pytest.raises(MtaError, match="cannot be split"):
        plan_run(recipe, world_size=3)


def test_missing_data_is_a_note_not_an_error(monkeypatch):
    monkeypatch.delenv("MTA_DATA_DIR", raising=False)
    plan = plan_run(load_recipe(REPO / "src" / "mta" / "recipes" / "gpt2.yaml"))
    assert plan.notes == [
        "data.train and data.dev use $MTA_DATA_DIR, which is not set: export MTA_DATA_DIR=... "
        "before training"
    ]


def test_missing_data_file_is_a_note(tmp_path, monkeypatch):
    monkeypatch.setenv("MTA_DATA_DIR", str(tmp_path))
    plan = plan_run(load_recipe(REPO / "src" / "mta" / "recipes" / "gpt2.yaml"))
    assert plan.notes == [
        f"data.train: {tmp_path}/dolly/train.jsonl does not exist yet",
        f"data.dev: {tmp_path}/dolly/dev.jsonl does not exist yet",
    ]


# --- memory estimate ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_plan():
    recipe = load_recipe(REPO / "src" / "mta" / "recipes" / "gpt2.yaml", ["train.micro_batch_size=2"])
    return plan_run(recipe, world_size=8)


def memory(plan, **changes):
    settings = dict(
        trainable_extra=plan.projector_parameters,
        aligned_teacher_layers=3,
        precision="bf16",
        zero_stage=1,
        teacher_zero3=False,
        world_size=8,
        micro_batch_size=8,
        sequence_length=256,
    )
    settings.update(changes)
    return estimate_memory(plan.student, plan.teacher, **settings)


def test_each_zero_stage_needs_less_memory_than_the_one_before(gpt2_plan):
    totals = [memory(gpt2_plan, zero_stage=stage).total for stage in (0, 1, 2, 3)]
    assert totals[0] > totals[1] > totals[2] > totals[3]
    # On one device there is nothing to partition.
    single = {memory(gpt2_plan, zero_stage=stage, world_size=1).total for stage in (0, 1, 2, 3)}
    assert len(single) == 1


def test_model_state_bytes_follow_the_zero_paper(gpt2_plan):
    trainable = gpt2_plan.student.parameters + gpt2_plan.projector_parameters
    mixed = memory(gpt2_plan, zero_stage=0, world_size=1)
    # Mixed precision: 2 (weights) + 2 (gradients) + 12 (fp32 master, momentum, variance).
    assert (mixed.student_weights, mixed.student_gradients, mixed.optimizer_states) == (
        2 * trainable, 2 * trainable, 12 * trainable
    )
    fp32 = memory(gpt2_plan, zero_stage=0, world_size=1, precision="fp32")
    assert fp32.student_weights + fp32.student_gradients + fp32.optimizer_states == 16 * trainable
    stage3 = memory(gpt2_plan, zero_stage=3, world_size=8)
    assert stage3.optimizer_states == 12 * trainable // 8
    assert stage3.student_weights == 2 * trainable // 8
    # The bf16 teacher: two bytes a parameter, split only when it is partitioned too.
    assert mixed.teacher_weights == 2 * gpt2_plan.teacher.parameters
    split = memory(gpt2_plan, teacher_zero3=True)
    assert split.teacher_weights == 2 * gpt2_plan.teacher.parameters // 8


def test_activations_grow_with_the_micro_batch(gpt2_plan):
    assert memory(gpt2_plan, micro_batch_size=16).activations > memory(gpt2_plan).activations


def test_recipe_zero3_plan_is_smaller_than_zero1():
    recipe = REPO / "src" / "mta" / "recipes" / "opt.yaml"
    zero1 = plan_run(load_recipe(recipe, ["train.micro_batch_size=2"]), world_size=8)
    zero3 = plan_run(
        load_recipe(
            recipe, ["train.micro_batch_size=2", "train.zero_stage=3", "train.teacher_zero3=true"]
        ),
        world_size=8,
    )
    assert zero3.memory.total < zero1.memory.total
    assert dataclasses.replace(zero3.memory, teacher_weights=0).total < zero1.memory.total


def _rendered(plan) -> str:
    console = Console(record=True, width=200)
    console.print(render_plan(plan))
    return console.export_text()


def test_rendered_plan_shows_counts_layers_batch_and_memory(gpt2_plan):
    text = _rendered(gpt2_plan)
    assert "1,557,611,200 (1,557.6M)" in text and "124,439,808 (124.4M)" in text
    assert "MiniLLM/teacher-gpt2-1.5B" in text
    assert "16 = 2 per device × 1 accumulation × 8 devices" in text
    assert "estimated memory per device (ZeRO-1, 8 devices;" in text
    rows = [line.split() for line in text.splitlines()]
    assert ["│", "9", "│", "36", "│", "phrase", "│"] in rows


def test_without_alignment_no_layers_and_no_projectors_are_planned():
    recipe = load_recipe(
        REPO / "src" / "mta" / "recipes" / "gpt2.yaml", ["loss.dsa_weight=0", "loss.hra_weight=0"]
    )
    plan = plan_run(recipe)
    assert plan.layers == [] and plan.projector_parameters == 0
    assert plan.teacher is not None and plan.memory.teacher_weights > 0


def test_dsa_without_hra_aligns_layers_but_plans_no_projector():
    recipe = load_recipe(REPO / "src" / "mta" / "recipes" / "gpt2.yaml", ["loss.hra_weight=0"])
    with_hra = plan_run(load_recipe(REPO / "src" / "mta" / "recipes" / "gpt2.yaml"))
    plan = plan_run(recipe)
    assert plan.layers == with_hra.layers and len(plan.layers) == 3
    assert plan.projector_parameters == 0 < with_hra.projector_parameters
    assert plan.memory.optimizer_states < with_hra.memory.optimizer_states


def test_cli_dry_run_prints_the_plan_and_exits(monkeypatch):
    from typer.testing import CliRunner

    from mta_cli.main import app

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("COLUMNS", "160")
    result = CliRunner().invoke(
        app, ["distill", "--recipe", str(REPO / "src" / "mta" / "recipes" / "opt.yaml"), "--dry-run",
              "train.zero_stage=3"]
    )
    assert result.exit_code == 0, result.output
    assert "6,658,473,984 (6,658.5M)" in result.output
    assert "16 = 8 per device × 1 accumulation × 2 devices" in result.output
    assert "estimated memory per device (ZeRO-3, 2 devices;" in result.output
