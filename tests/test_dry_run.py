"""`--dry-run` planning: offline meta-device models, parameter counts, batch and memory estimate."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from conftest import MINIMAL_RECIPE
from mta.distributed import local_device
from mta.dtypes import resolve_precision
from mta.errors import MtaError
from mta.models.tiny import build_tiny_model
from mta.training.config.loading import load_recipe
from mta.training.config.schema import ModelSpec, TinyModel
from mta.training.dry_run import (
    estimate_memory,
    parameter_count,
    plan_model,
    plan_run,
)
from mta_cli.dry_run_tables import render_plan

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


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


def independent_model(spec, recipe_path: Path):
    """The recipe's model built here on the meta device from its config (the shipped recipes name
    a config file beside them or describe a tiny model), not through mta.training.dry_run."""
    import torch
    from transformers import AutoConfig

    if spec.config is not None:
        config = AutoConfig.from_pretrained(recipe_path.parent / spec.config, local_files_only=True)
    else:
        from mta.models.tiny import tiny_config  # what build_tiny_model builds

        t = spec.tiny
        config = tiny_config(
            t.model_type, t.vocab_size, num_layers=t.num_layers, hidden_size=t.hidden_size, num_heads=t.num_heads
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Unique tensors: a tied output layer is the embedding matrix again, counted once.
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    return config, model, sum(unique.values())


def documented_auto_map(student_layers: int, teacher_layers: int) -> list[tuple[int, int, str]]:
    """docs/method.md §4, written out again: s = max(1, L_S // 4); L_S - 2s word, L_S - s and L_S
    phrase; teacher round(l·L_T/L_S) with halves up (exact: Fraction); layers below 0 dropped."""
    import math
    from fractions import Fraction

    s = max(1, student_layers // 4)
    picks = [(student_layers - 2 * s, "word"), (student_layers - s, "phrase"), (student_layers, "phrase")]
    return [
        (layer, math.floor(Fraction(layer * teacher_layers, student_layers) + Fraction(1, 2)), granularity)
        for layer, granularity in picks
        if layer >= 0
    ]


def printed_bytes(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 // 10 else f"{count / 2**20:.1f} MiB"


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.name)
def test_dry_run_plans_every_recipe_offline(path):
    """What the dry run prints for each shipped recipe, against the recipe and models built here."""
    recipe = load_recipe(path)
    if recipe.task == "embedding":  # an encoder and no teacher model: test_embedding_training.py
        pytest.skip(
            "task: embedding recipes: test_embedding_training.py::test_the_dry_run_plans_the_embedding_recipes_offline"
        )
    plan = plan_run(recipe, world_size=1)
    text = _rendered(plan)
    assert plan.student.architecture in text and f"{recipe.train.batch_size} =" in text

    built = {}
    for role in ("student", "teacher"):
        spec, planned = getattr(recipe, role), getattr(plan, role)
        if spec is None:
            assert planned is None
            continue
        config, model, count = built[role] = independent_model(spec, path)
        assert planned.parameters == count
        assert (planned.architecture, planned.num_layers, planned.hidden_size, planned.vocab_rows) == (
            type(model).__name__,
            config.num_hidden_layers,
            config.hidden_size,
            model.get_input_embeddings().num_embeddings,
        )
        assert f"{count:,}" in text and planned.name in text

    # The layer map: the recipe's explicit list, or the documented auto rule on the two depths.
    pairs = [(p.student, p.teacher, p.granularity) for p in plan.layers]
    if recipe.teacher is None or not recipe.loss.trajectory_terms:
        assert pairs == []
    elif recipe.loss.layers == "auto":
        student_layers, teacher_layers = (built[r][0].num_hidden_layers for r in ("student", "teacher"))
        assert pairs == documented_auto_map(student_layers, teacher_layers)
    else:
        assert pairs == [(p.student, p.teacher, p.granularity) for p in recipe.loss.layers]
    rows = [line.split() for line in text.splitlines()]
    for student, teacher, granularity in pairs:
        assert ["│", str(student), "│", str(teacher), "│", granularity, "│"] in rows

    # HRA: one Linear(d_S, d_T) with bias per pair; the model-state bytes of the ZeRO paper
    # (2 + 2 + 12 bytes per trainable parameter mixed, 4 + 4 + 8 fp32; one device partitions
    # nothing), the teacher's weights at its dtype's width.
    d_s = built["student"][0].hidden_size
    d_t = built["teacher"][0].hidden_size if "teacher" in built else 0
    projectors = len(pairs) * (d_s * d_t + d_t) if "hra" in recipe.loss.trajectory_terms else 0
    if recipe.loss.sra_weight:  # SRA: one Linear(d_S, d_T) per span pair (`last`: one)
        projectors += (d_s * d_t + d_t) * (1 if recipe.loss.sra_layers == "last" else len(recipe.loss.sra_layers))
        assert any(note.startswith("SRA: ") for note in plan.notes)
    assert plan.projector_parameters == projectors
    # A LoRA student (OPT): r x (in + out) per adapted linear layer train, the base stays frozen
    # (its weights kept, no gradients or optimizer states).
    adapters = lora_adapters(built["student"][1], recipe.student.lora) if recipe.student.lora else None
    assert plan.student.trainable_parameters == adapters
    trainable = (built["student"][2] if adapters is None else adapters) + projectors
    held = trainable + (0 if adapters is None else built["student"][2])
    precision = resolve_precision(recipe.train.precision, local_device())  # auto: as on this machine
    weight, optimizer = (2, 12) if precision in ("bf16", "fp16") else (4, 8)
    assert (plan.memory.student_weights, plan.memory.student_gradients, plan.memory.optimizer_states) == (
        weight * held,
        weight * trainable,
        optimizer * trainable,
    )
    teacher_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[recipe.teacher.dtype] if recipe.teacher else 0
    assert plan.memory.teacher_weights == (built["teacher"][2] * teacher_bytes if "teacher" in built else 0)
    assert printed_bytes(plan.memory.total) in text


def lora_adapters(model, spec) -> int:
    """LoRA's trainable parameters on ``model``, counted without peft: r x (in + out) for each
    linear layer whose last name part the recipe lists."""
    assert isinstance(spec.target_modules, list), "the shipped LoRA recipe names its modules"
    return sum(
        spec.r * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in spec.target_modules
    )


# Published sizes of the hub checkpoints (tied embeddings counted once).
PUBLISHED_PARAMETERS = {
    "gpt2.yaml": (1_557_611_200, 124_439_808),
    "opt.yaml": (6_658_473_984, 1_315_758_080),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_paper_configs_give_the_published_parameter_counts(name):
    plan = plan_run(load_recipe(REPO / "recipes" / name))
    assert (plan.teacher.parameters, plan.student.parameters) == PUBLISHED_PARAMETERS[name]


def test_qwen_configs_keep_the_padded_embedding_rows():
    plan = plan_run(load_recipe(REPO / "recipes" / "qwen.yaml"))
    assert plan.teacher.vocab_rows == plan.student.vocab_rows == 151_936  # 151,646 real tokens
    assert (plan.teacher.num_layers, plan.student.num_layers) == (24, 24)
    assert (plan.teacher.hidden_size, plan.student.hidden_size) == (2048, 1024)
    # 0.5B ties its output layer to the embeddings, 1.8B does not.
    assert 450e6 < plan.student.parameters < 470e6
    assert 1.8e9 < plan.teacher.parameters < 1.85e9


def test_cross_tokenizer_plan_projects_spans_between_widths():
    plan = plan_run(load_recipe(REPO / "recipes" / "cross-tokenizer.yaml"), world_size=2)
    assert [(p.student, p.teacher, p.granularity) for p in plan.layers] == [
        (6, 12, "word"),
        (9, 18, "phrase"),
        (12, 24, "phrase"),
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
def test_tiny_spec_plans_the_model_build_tiny_model_builds(model_type, tiny_tokenizer_dir, tmp_path):
    tiny = TinyModel(
        model_type=model_type,
        num_layers=3,
        hidden_size=16,
        num_heads=2,
        tokenizer_corpus="examples/tiny.jsonl",
        vocab_size=512,
    )
    recipe = load_recipe(write_recipe(tmp_path, "unused", "unused"))
    planned = plan_model(ModelSpec(path=str(tmp_path / "absent"), tiny=tiny), recipe, "student")
    built = build_tiny_model(
        tiny_tokenizer_dir, tmp_path / model_type, model_type=model_type, num_layers=3, hidden_size=16, num_heads=2
    )
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
    (snapshot / "config.json").write_text((REPO / "recipes" / "configs" / "gpt2.json").read_text(encoding="utf-8"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    recipe = load_recipe(write_recipe(tmp_path, "unused", "some-org/student"))
    planned = plan_model(recipe.student, recipe, "student")
    assert planned.parameters == 124_439_808
    assert planned.config_source == "Hugging Face cache (some-org/student)"


def test_missing_config_file_is_named(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml", ["student.config=configs/gpt2-small.json"])
    with pytest.raises(MtaError, match="student.config='configs/gpt2-small.json' does not exist"):
        plan_run(recipe)


def test_layer_pair_past_the_teacher_depth_fails_the_dry_run():
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml", ["loss.layers.2.1=49"])
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
    plan = plan_run(load_recipe(REPO / "recipes" / "gpt2.yaml"))
    assert plan.notes == [
        "data.train and data.dev use $MTA_DATA_DIR, which is not set: export MTA_DATA_DIR=... before training"
    ]


def test_missing_data_file_is_a_note(tmp_path, monkeypatch):
    monkeypatch.setenv("MTA_DATA_DIR", str(tmp_path))
    plan = plan_run(load_recipe(REPO / "recipes" / "gpt2.yaml"))
    assert plan.notes == [
        f"data.train: {tmp_path}/dolly/train.jsonl does not exist yet",
        f"data.dev: {tmp_path}/dolly/dev.jsonl does not exist yet",
    ]


# --- memory estimate ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_plan():
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml", ["train.micro_batch_size=2"])
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
        2 * trainable,
        2 * trainable,
        12 * trainable,
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


def test_the_printed_memory_plan_is_the_documented_formula(gpt2_plan):
    """gpt2.yaml on 8 devices, micro batch 2, ZeRO-1, bf16: every term recomputed from counts
    made here with estimate_memory's documented formula, and printed as such."""
    path = REPO / "recipes" / "gpt2.yaml"
    recipe = load_recipe(path)
    student_config, student_model, student_count = independent_model(recipe.student, path)
    teacher_config, teacher_model, teacher_count = independent_model(recipe.teacher, path)
    h, layers = student_config.hidden_size, student_config.num_hidden_layers
    d_t, world, micro, seq = teacher_config.hidden_size, 8, 2, recipe.data.max_length
    projectors = 3 * (h * d_t + d_t)  # three aligned pairs, each Linear(768, 1600) with bias
    trainable = student_count + projectors
    tokens = micro * seq
    v_s = student_model.get_input_embeddings().num_embeddings
    v_t = teacher_model.get_input_embeddings().num_embeddings
    expected = {
        "student weights": 2 * trainable,  # bf16, not partitioned at ZeRO-1
        "student gradients": 2 * trainable,
        "optimizer states": 12 * trainable // world,  # fp32 master, momentum, variance, partitioned
        "teacher weights": 2 * teacher_count,  # bf16 teacher, not partitioned
        # Per block and token, in bf16: 9 hidden-wide tensors, keys and values (2h: GPT-2 has no
        # grouped heads), the MLP's two of width 4h (GPT-2's is not gated), no attention scores
        # (SDPA); the embeddings and final norm 2h. The fused base loss's logits (loss.fused_head,
        # chunks of loss.chunk_size = 128 positions): 4 fp32 buffers and the student's bf16 chunk,
        # the head's gradient summed in fp32, the teacher's bf16 chunk; the teacher's hidden
        # states of its 3 aligned layers plus one.
        "activations (rough)": int(
            tokens * ((9 * h + 2 * h + 2 * 4 * h) * 2 * layers + 2 * h * 2)
            + 128 * v_s * (4 * 4 + 2)
            + v_s * h * 4
            + 128 * v_t * 2
            + tokens * d_t * 2 * (3 + 1)
        ),
    }
    # The materialised path (loss.fused_head=false): the whole logits, 16-bit + an fp32 copy with
    # gradients, and the teacher's bf16 logits.
    whole = plan_run(load_recipe(path, ["train.micro_batch_size=2", "loss.fused_head=false"]), world_size=8).memory
    assert whole.logit_chunk is None and whole.logits == tokens * v_s * (2 + 4) * 2 + tokens * v_t * 2
    assert whole.activations - whole.logits == gpt2_plan.memory.activations - gpt2_plan.memory.logits
    assert gpt2_plan.memory.logit_chunk == 128
    estimate = gpt2_plan.memory
    assert (
        estimate.student_weights,
        estimate.student_gradients,
        estimate.optimizer_states,
        estimate.teacher_weights,
        estimate.activations,
    ) == tuple(expected.values())
    total = sum(expected.values())
    assert estimate.total == total
    lines = _rendered(gpt2_plan).splitlines()
    for label, count in [*expected.items(), ("total", total)]:
        (line,) = [line for line in lines if line.startswith(f"│ {label} ")]
        assert line.split("│")[2].strip() == printed_bytes(count)
    (line,) = [line for line in lines if "of which logits (chunks of 128 positions)" in line]
    assert line.split("│")[2].strip() == printed_bytes(gpt2_plan.memory.logits)


def test_activations_grow_with_the_micro_batch(gpt2_plan):
    assert memory(gpt2_plan, micro_batch_size=16).activations > memory(gpt2_plan).activations


def test_recipe_zero3_plan_is_smaller_than_zero1():
    recipe = REPO / "recipes" / "opt.yaml"
    zero1 = plan_run(load_recipe(recipe, ["train.micro_batch_size=2"]), world_size=8)
    zero3 = plan_run(
        load_recipe(recipe, ["train.micro_batch_size=2", "train.zero_stage=3", "train.teacher_zero3=true"]),
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
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml", ["loss.dsa_weight=0", "loss.hra_weight=0"])
    plan = plan_run(recipe)
    assert plan.layers == [] and plan.projector_parameters == 0
    assert plan.teacher is not None and plan.memory.teacher_weights > 0


def test_dsa_without_hra_aligns_layers_but_plans_no_projector():
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml", ["loss.hra_weight=0"])
    with_hra = plan_run(load_recipe(REPO / "recipes" / "gpt2.yaml"))
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
        app, ["distill", "--recipe", str(REPO / "recipes" / "opt.yaml"), "--dry-run", "train.zero_stage=3"]
    )
    assert result.exit_code == 0, result.output
    assert "6,658,473,984 (6,658.5M)" in result.output
    assert "16 = 8 per device × 1 accumulation × 2 devices" in result.output
    assert "estimated memory per device (ZeRO-3, 2 devices;" in result.output


def test_activations_count_gated_mlps_grouped_keys_and_eager_attention_scores():
    """qwen.yaml's student (a gated MLP; keys and values as its config groups them) per block and token, counted here
    from its config; SRA's last-token-attention centre switches to eager attention, whose softmax
    scores (heads × sequence per token and block, in bf16) the plan then adds."""
    path = REPO / "recipes" / "qwen.yaml"
    config, _, _ = independent_model(load_recipe(path).student, path)
    h, i, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    kv = config.num_key_value_heads
    student = plan_run(load_recipe(path)).student
    assert (
        student.gated_mlp and student.activation_elements_per_token(256, False) == 9 * h + 2 * h * kv // heads + 4 * i
    )
    assert (
        student.activation_elements_per_token(256, True) - student.activation_elements_per_token(256, False)
        == heads * 256
    )

    sra = REPO / "recipes" / "cross-tokenizer-sra.yaml"
    eager = plan_run(load_recipe(sra))
    sdpa = plan_run(load_recipe(sra, ["loss.sra_centre=importance"]))
    tokens, seq = eager.micro_batch_size * load_recipe(sra).data.max_length, load_recipe(sra).data.max_length
    scores = tokens * eager.student.num_heads * seq * eager.student.num_layers * 2
    assert eager.memory.activations - sdpa.memory.activations == scores
