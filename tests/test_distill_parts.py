"""The pieces of `mta distill` around the loop: the truncated teacher, the DeepSpeed config, the
schedule, and the command itself on the shipped tiny recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from conftest import EXAMPLES, subprocess_env
from mta.models.tiny import build_tiny_model
from mta.training.config.loading import load_recipe
from mta.training.engine import deepspeed_config, lr_multiplier
from mta.training.teacher import FrozenTeacher

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("layers", [[1, 2], [0, 4], [3], [2, 4]])
def test_truncated_teacher_returns_what_the_full_model_does(tiny_tokenizer_dir, tmp_path_factory, model_type, layers):
    directory = build_tiny_model(
        tiny_tokenizer_dir, tmp_path_factory.getbasetemp() / f"teacher-{model_type}", model_type=model_type
    )
    full = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    teacher = FrozenTeacher(AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager"), layers, False)
    ids = torch.randint(0, 500, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    expected = full(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    out = teacher(ids, mask)
    assert out.logits is None and sorted(out.hidden_states) == layers
    for layer in layers:
        torch.testing.assert_close(out.hidden_states[layer], expected[layer], rtol=0, atol=1e-6)
    # The blocks above the deepest aligned layer are gone, not just skipped.
    kept_blocks = sum(
        1 for name, _ in teacher.named_modules() if name.count(".") == 3 and name.split(".")[-1].isdigit()
    )
    assert kept_blocks == max(layers)
    assert not any(p.requires_grad for p in teacher.parameters())


def test_teacher_with_a_logit_loss_runs_whole(tiny_model_dir):
    teacher = FrozenTeacher(AutoModelForCausalLM.from_pretrained(tiny_model_dir), [2], need_logits=True)
    out = teacher(torch.randint(0, 500, (1, 5)), torch.ones(1, 5, dtype=torch.long))
    assert out.logits.shape == (1, 5, 512) and list(out.hidden_states) == [2]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_fdd_keeps_the_teachers_head_and_norm_and_its_lens_reads_the_layers(
    tiny_tokenizer_dir, tmp_path_factory, model_type
):
    from mta.training.logit_lens import LogitLens

    directory = build_tiny_model(
        tiny_tokenizer_dir, tmp_path_factory.getbasetemp() / f"teacher-{model_type}", model_type=model_type
    )
    full = AutoModelForCausalLM.from_pretrained(directory).eval()
    model = AutoModelForCausalLM.from_pretrained(directory)
    lens = LogitLens(model, final_norm=True, num_layers=4)
    # Without a logit loss the teacher would be cut after layer 2; the lens keeps it whole, and
    # computes no logits the loss does not read.
    teacher = FrozenTeacher(model, [1, 2], need_logits=False, lens=lens)
    ids = torch.randint(0, 500, (2, 6))
    out = teacher(ids, torch.ones_like(ids))
    assert not teacher.truncated and out.lens is lens and out.logits is None
    expected = full(ids, output_hidden_states=True)
    norm = full.model.norm if model_type == "llama" else full.transformer.ln_f
    with torch.no_grad():
        for layer, state in zip([1, 2], lens.states(out.hidden_states, [1, 2]), strict=True):
            torch.testing.assert_close(lens(state), full.lm_head(norm(expected.hidden_states[layer])))
        # The last layer's entry is already normed: the lens gives the model's own logits.
        (last,) = lens.states(expected.hidden_states, [4])
        torch.testing.assert_close(lens(last), expected.logits)


@pytest.mark.parametrize("zero3", [False, True])
def test_a_layers_lens_at_some_vocabulary_rows_gathers_them_before_the_product(
    tiny_tokenizer_dir, tmp_path_factory, zero3, monkeypatch
):
    from mta.training import logit_lens
    from mta.training.logit_lens import LogitLens, is_zero3_partitioned

    directory = build_tiny_model(tiny_tokenizer_dir, tmp_path_factory.getbasetemp() / "lens-rows")
    model = AutoModelForCausalLM.from_pretrained(directory)
    head, norm = model.lm_head, model.model.norm
    calls = []
    head.register_forward_hook(lambda *_: calls.append("head"))
    assert not is_zero3_partitioned(head.weight)
    if zero3:  # as if DeepSpeed ZeRO-3 partitioned the head (it marks such parameters with ds_id)
        monkeypatch.setattr(logit_lens, "is_zero3_partitioned", lambda parameter: True)
    lens = LogitLens(model, final_norm=True, num_layers=4).for_layer(2)
    rows = torch.tensor([7, 0, 311, 7, 42])
    hidden = torch.randn(3, head.in_features, requires_grad=True)
    got = lens(hidden, rows)
    got_grads = torch.autograd.grad((got * torch.arange(5.0)).sum(), [hidden, head.weight])
    expected = head(norm(hidden))[:, rows]  # the whole head, then the columns: a second way
    want_grads = torch.autograd.grad((expected * torch.arange(5.0)).sum(), [hidden, head.weight])
    torch.testing.assert_close(got, expected)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)
    # Gathered: the head module never runs; under ZeRO-3 it must (its hooks gather the shard).
    assert calls.count("head") == (1 if zero3 else 0) + 1
    torch.testing.assert_close(lens(hidden), head(norm(hidden)))


def _tiny(*overrides):
    return load_recipe(REPO / "recipes" / "tiny.yaml", list(overrides))


def test_deepspeed_config_keeps_the_global_batch_and_passes_extras_through():
    recipe = _tiny(
        "train.batch_size=16",
        "train.micro_batch_size=2",
        "train.zero_stage=3",
        "train.precision=bf16",
        "deepspeed.zero_optimization.overlap_comm=true",
        "deepspeed.communication_data_type=fp32",
    )
    for world_size, accumulation in ((1, 8), (2, 4), (8, 1)):
        config = deepspeed_config(recipe.train, recipe.deepspeed, world_size)
        assert config["gradient_accumulation_steps"] == accumulation
        assert config["train_micro_batch_size_per_gpu"] * accumulation * world_size == config["train_batch_size"] == 16
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert config["communication_data_type"] == "fp32"
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}


def test_schedules():
    assert lr_multiplier(0, 10, 0, "cosine") == 1.0
    assert lr_multiplier(5, 10, 0, "cosine") == pytest.approx(0.5)
    assert lr_multiplier(10, 10, 0, "cosine") == pytest.approx(0.0)
    assert lr_multiplier(3, 10, 0, "linear") == pytest.approx(0.7)
    assert lr_multiplier(7, 10, 0, "constant") == 1.0
    assert [lr_multiplier(s, 10, 3, "constant") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(3 + 7 / 2, 10, 3, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))


def test_dry_run_and_bad_overrides_from_the_command_line():
    from mta_cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["distill", "--recipe", str(REPO / "recipes" / "tiny.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["distill", "--recipe", str(REPO / "recipes" / "tiny.yaml"), "train.lrr=1"])
    assert result.exit_code != 0 and "train.lrr" in str(result.exception)


@pytest.mark.slow
def test_tiny_recipe_runs_from_nothing_through_the_command(tmp_path):
    """The shipped recipe builds its tokenizer and models, annotates its JSONL and trains."""
    import subprocess
    import sys

    env = subprocess_env()
    out = tmp_path / "tiny"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mta_cli.main",
            "distill",
            "--recipe",
            str(REPO / "recipes" / "tiny.yaml"),
            f"output_dir={out}",
            "train.max_steps=4",
            "train.eval_interval=4",
            "train.save_interval=2",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "global batch 8 = 4 per device × 2 accumulation × 1 process" in " ".join(result.stderr.split())
    for built in (
        "models/tokenizer-512-*/tokenizer.json",
        "models/teacher-*/config.json",
        "models/student-*/config.json",
        "data/train/.mta/manifest.json",
        "final/model.safetensors",
        "checkpoints/step-2/trainer_state.json",
        "checkpoints/step-4/trainer_state.json",
    ):
        assert len(list(out.glob(built))) == 1, built
    saved = yaml.safe_load((out / "final" / "recipe.yaml").read_text())
    assert saved["train"]["max_steps"] == 4 and saved["output_dir"] == str(out)
    AutoModelForCausalLM.from_pretrained(out / "final")


@pytest.mark.parametrize(
    ("weights", "terms", "projectors", "teacher_logits"),
    [
        ({}, {"base", "dsa", "hra"}, True, True),
        ({"hra_weight": 0}, {"base", "dsa"}, False, True),
        ({"dsa_weight": 0}, {"base", "hra"}, True, True),
        ({"base_weight": 0}, {"dsa", "hra"}, True, False),
        ({"dsa_weight": 0, "hra_weight": 0}, {"base"}, False, True),
    ],
)
def test_a_term_with_weight_zero_is_neither_built_nor_computed(weights, terms, projectors, teacher_logits):
    from mta.training.config.layers import auto_layer_map
    from mta.training.config.schema import LossSpec
    from mta.training.objective import DistillationObjective

    spec = LossSpec(base="fkl", **weights)
    pairs = auto_layer_map(4, 4) if spec.trajectory_terms else []
    objective = DistillationObjective(
        spec, pairs, student_hidden_size=8, teacher_hidden_size=12, same_tokenizer=True, vocab_size=50
    )
    built = objective.trajectory is not None and objective.trajectory.projectors is not None
    assert built == projectors
    assert objective.needs_teacher_logits == teacher_logits
    assert set(spec.trajectory_terms) == terms - {"base"}
    assert (objective.base is not None) == ("base" in terms)


def test_a_changed_tiny_description_builds_a_new_model_and_keeps_the_old(tmp_path):
    from mta.training.model_loading import model_source

    recipe = _tiny(f"output_dir={tmp_path / 'run'}")
    model, tokenizer = model_source(recipe.teacher, recipe, "teacher")
    before = {path.name: path.read_bytes() for path in Path(model).iterdir()}
    wider = _tiny(f"output_dir={tmp_path / 'run'}", "teacher.tiny.hidden_size=48")
    other_model, same_tokenizer = model_source(wider.teacher, wider, "teacher")
    assert other_model != model and same_tokenizer == tokenizer
    assert AutoModelForCausalLM.from_pretrained(other_model).config.hidden_size == 48
    assert AutoModelForCausalLM.from_pretrained(model).config.hidden_size == 64
    assert {path.name: path.read_bytes() for path in Path(model).iterdir()} == before
    # The same description finds the model it built; another corpus trains another tokenizer.
    assert model_source(recipe.teacher, recipe, "teacher") == (model, tokenizer)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(Path(EXAMPLES).read_text(encoding="utf-8").replace("the", "a"), encoding="utf-8")
    recorpus = _tiny(f"output_dir={tmp_path / 'run'}", f"teacher.tiny.tokenizer_corpus={corpus}")
    assert model_source(recorpus.teacher, recorpus, "teacher")[1] != tokenizer
