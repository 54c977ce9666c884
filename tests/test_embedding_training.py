"""task: embedding (TALAS) through `mta distill`: the tiny recipe embeds its rows with the teacher at
first use, trains (SimCSE + TAMD + LASD under ASAM), resumes bit-identically, exports a directory
that sentence-transformers and AutoModel load; the objective's composition and padding; the
schema's task checks; the dry run of the shipped embedding recipes, offline."""

from __future__ import annotations

import math
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mta.embedding.recipe import EmbeddingLossSpec
from mta.errors import MtaError
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
TINY_EMBED = RECIPES / "tiny-embed.yaml"
TALAS = RECIPES / "talas-minilm.yaml"
TEXTS = ["The council approved new river bicycle lanes.", "Water the plant when the soil is dry.", "short"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The shipped tiny-embed recipe, 12 steps with checkpoints at 6 and 12."""
    from mta.training.trainer import run_distillation

    out = tmp_path_factory.mktemp("tiny-embed") / "run"
    overrides = [f"output_dir={out}"]
    final = run_distillation(load_recipe(TINY_EMBED, overrides))
    return {"out": out, "final": final, "overrides": overrides, "weights": load_file(str(final / "model.safetensors"))}


def test_the_tiny_recipe_embeds_its_rows_once_and_trains_every_term(trained):
    out = trained["out"]
    from mta.embedding import read_teacher_embeddings

    stored = read_teacher_embeddings(out / "embeddings" / "train")
    assert len(stored) == 36 and stored.dimension == 64  # the teacher's width, not the student's 32
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    dev = [r for r in records if r["split"] == "dev"]
    assert [r["step"] for r in train] == [4, 8, 12] and [r["step"] for r in dev] == [0, 6, 12]
    assert all(r["grad_norm"] > 0 and math.isfinite(r["grad_norm"]) for r in train)  # DeepSpeed's (ZeRO-1)
    for record in records:
        assert {"loss/simcse", "loss/tamd", "loss/lasd"} <= set(record) and math.isfinite(record["loss"])
        expected = 0.001 * record["loss/simcse"] + 0.75 * record["loss/tamd"] + 1.0 * record["loss/lasd"]
        assert record["loss"] == pytest.approx(expected, rel=1e-6)
    assert dev[-1]["loss/tamd"] < 0.5 * dev[0]["loss/tamd"]  # the top layers learned the teacher's directions
    # The student started from its built weights and moved; the TAMD projections are not exported.
    start = load_file(str(next((out / "models").glob("student-*")) / "model.safetensors"))
    assert start.keys() == trained["weights"].keys()
    moved = [k for k in start if not torch.equal(start[k], trained["weights"][k])]
    assert moved and not any("pooler" in k for k in moved)  # the unused BERT pooler stays as loaded


def test_final_loads_with_sentence_transformers_and_automodel_giving_mta_s_pooling(trained):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from mta.embedding.pooling import cls_attention_pool

    final = trained["final"]
    for name in (
        "modules.json",
        "config_sentence_transformers.json",
        "sentence_bert_config.json",
        "1_Pooling/config.json",
        "cls_attention_pooling.py",
        "README.md",
        "checksums.sha256",
    ):
        assert (final / name).is_file(), name
    with pytest.raises(ValueError, match="trust_remote_code"):  # the pooling module is the model's own code
        SentenceTransformer(str(final), device="cpu")
    model = SentenceTransformer(str(final), device="cpu", trust_remote_code=True)
    encoded = model.encode(TEXTS, convert_to_tensor=True)
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    encoder = AutoModel.from_pretrained(str(final)).eval()
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        expected = cls_attention_pool(encoder(**batch).last_hidden_state, batch["attention_mask"])
    torch.testing.assert_close(encoded.cpu(), expected, rtol=1e-5, atol=1e-6)
    assert model.get_embedding_dimension() == 32 and model.max_seq_length == 128
    # A checkpoint is the same kind of directory.
    checkpoint = trained["out"] / "checkpoints" / "step-12"
    assert (checkpoint / "modules.json").is_file() and (checkpoint / "cls_attention_pooling.py").is_file()


def test_a_resumed_run_ends_with_the_uninterrupted_weights(trained):
    """Stopped after step 6 (its checkpoint kept, later outputs removed) and resumed with ASAM on:
    the same weights, bit for bit."""
    from mta.training.trainer import run_distillation

    out = trained["out"].parent / "resumed"
    shutil.copytree(trained["out"], out, ignore=shutil.ignore_patterns("final", "step-12"))
    resumed = run_distillation(load_recipe(TINY_EMBED, [f"output_dir={out}"]), resume="auto")
    for name, tensor in load_file(str(resumed / "model.safetensors")).items():
        torch.testing.assert_close(tensor, trained["weights"][name], rtol=0, atol=0, msg=name)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"] == [4, 8, 12]


def test_an_mta_embed_directory_trains_without_any_teacher(trained, tmp_path):
    """data.train names an `mta embed` output: read as it is, teacher: null, nothing re-embedded."""
    from mta.training.trainer import run_distillation

    stored = trained["out"] / "embeddings" / "train"
    out = tmp_path / "run"
    recipe = load_recipe(
        TINY_EMBED,
        [
            f"output_dir={out}",
            "teacher=null",
            f"data.train={stored}",
            "data.dev=null",
            "train.max_steps=2",
            "train.asam=null",
            "loss.simcse_weight=0",
            "loss.lasd_weight=0",
            "loss.tamd_layers=1",
        ],
    )
    final = run_distillation(recipe)
    assert (final / "model.safetensors").is_file() and not (out / "embeddings").exists()
    records = read_metrics(out / "metrics.jsonl")
    assert {key for key in records[-1] if key.startswith("loss/")} == {"loss/tamd"}  # cosine on the last layer


def test_rows_without_a_teacher_are_refused_naming_the_fix(tmp_path):
    from mta.training.trainer import run_distillation

    recipe = load_recipe(TINY_EMBED, [f"output_dir={tmp_path / 'run'}", "teacher=null"])
    with pytest.raises(MtaError, match=r"data.train: .*holds rows, and the recipe names no teacher.*mta embed"):
        run_distillation(recipe)


# ---------------------------------------------------------------- the objective


def _objective(**loss):
    from mta.embedding.objective import EmbeddingObjective

    torch.manual_seed(0)
    return EmbeddingObjective(
        EmbeddingLossSpec(**loss), num_layers=3, student_dim=6, teacher_dim=5, pooling="cls_attention"
    ).double()


def test_the_objective_is_the_weighted_terms_of_the_right_layers_and_ignores_padding():
    from mta.embedding.pooling import pool
    from mta.losses.talas import lasd_loss, simcse_loss

    objective = _objective()
    g = torch.Generator().manual_seed(1)
    hidden = tuple(torch.randn(4, 7, 6, generator=g, dtype=torch.float64) for _ in range(4))  # embeddings + 3 layers
    second = torch.randn(4, 7, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in (7, 3, 5, 1)])
    teacher = torch.randn(4, 5, generator=g, dtype=torch.float64)
    losses = objective(hidden, mask, teacher, second)
    pooled = torch.stack([pool(h, mask, "cls_attention") for h in hidden[1:]])
    assert losses["tamd"].item() == pytest.approx(
        objective.anchor(pooled[1:], teacher).item(), rel=1e-12
    )  # layers 2, 3
    assert losses["lasd"].item() == pytest.approx(lasd_loss(pooled).item(), rel=1e-12)  # layers 1-3, not 0
    assert losses["simcse"].item() == pytest.approx(
        simcse_loss(pooled[-1], pool(second, mask, "cls_attention"), 0.1).item(), rel=1e-12
    )
    assert losses["total"].item() == pytest.approx(
        0.001 * losses["simcse"].item() + 0.75 * losses["tamd"].item() + losses["lasd"].item(), rel=1e-12
    )
    # More padding, with garbage in it: the same losses.
    padded = tuple(torch.cat([h, 1e3 * torch.randn(4, 2, 6, generator=g, dtype=torch.float64)], 1) for h in hidden)
    wider = torch.cat([mask, torch.zeros(4, 2, dtype=mask.dtype)], 1)
    again = objective(padded, wider, teacher, torch.cat([second, torch.randn(4, 2, 6, dtype=torch.float64)], 1))
    for name, value in losses.items():
        assert again[name].item() == pytest.approx(value.item(), rel=1e-12), name


def test_terms_at_weight_zero_are_not_built_and_k_past_the_depth_is_refused():
    objective = _objective(simcse_weight=0, lasd_weight=0, tamd_layers=1)
    assert not objective.needs_second_pass and list(objective.pooled_layers) == [3]
    assert len(objective.anchor.projections) == 1
    assert _objective(tamd_weight=0).anchor is None
    with pytest.raises(MtaError, match="loss.tamd_layers=4 anchors more layers than the student has \\(3\\)"):
        _objective(tamd_layers=4)


# ---------------------------------------------------------------- the schema


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _line(text: str, needle: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if needle in line)


def test_llm_keys_in_an_embedding_recipe_are_refused_with_their_lines(tmp_path):
    text = TINY_EMBED.read_text(encoding="utf-8")
    text = text.replace("  tamd_layers: 2", "  tamd_layers: 2\n  dsa_weight: 2.0") + "off_policy:\n  mode: adaptive\n"
    with pytest.raises(MtaError) as caught:
        load_recipe(_write(tmp_path, text))
    message = str(caught.value)
    assert (
        f"line {_line(text, 'dsa_weight')}: loss.dsa_weight: unknown key in a task: embedding recipe: "
        "dsa_weight is a key of task: llm recipes"
    ) in message
    assert f"line {_line(text, 'off_policy:')}: off_policy: unknown key in a task: embedding recipe" in message
    # The shared train: section: the keys only LLM distillation reads.
    text = TINY_EMBED.read_text(encoding="utf-8").replace(
        "  max_steps: 12", "  max_steps: 12\n  num_sample_generations: 4"
    )
    with pytest.raises(MtaError) as caught:
        load_recipe(_write(tmp_path, text))
    assert (
        f"line {_line(text, 'num_sample_generations')}: train.num_sample_generations: num_sample_generations "
        "is a key of task: llm recipes"
    ) in str(caught.value)
    assert load_recipe(TINY_EMBED, ["train.num_sample_generations=2"]).train.num_sample_generations == 2  # the default


def test_embedding_keys_in_an_llm_recipe_are_refused_and_a_task_must_be_known(tmp_path):
    text = (
        (RECIPES / "tiny.yaml").read_text(encoding="utf-8").replace("  base: srkl", "  base: srkl\n  tamd_weight: 0.75")
    )
    with pytest.raises(MtaError) as caught:
        load_recipe(_write(tmp_path, text))
    assert (
        f"line {_line(text, 'tamd_weight')}: loss.tamd_weight: unknown key in a task: llm recipe: tamd_weight "
        "is a key of task: embedding recipes"
    ) in str(caught.value)
    with pytest.raises(MtaError) as caught:
        load_recipe(TINY_EMBED, ["task=embeddings"])
    assert str(caught.value).splitlines()[1:] == [  # that alone: the rest is not checked against a wrong schema
        "  task: 'embeddings' is not allowed; use one of 'llm' or 'embedding' (llm: distil a causal LM (this "
        "schema); embedding: a sentence-embedding encoder, TALAS (EmbeddingRecipe)) (from override 'task=embeddings')"
    ]
    with pytest.raises(MtaError, match="student.pooling: 'last' is not allowed"):
        load_recipe(TINY_EMBED, ["student.pooling=last"])
    assert load_recipe(RECIPES / "tiny.yaml").task == "llm"


def test_the_recipe_s_pooling_names_are_the_encoder_s():
    import typing

    from mta.embedding.export import STOCK_POOLINGS
    from mta.embedding.pooling import AUTO, POOLINGS
    from mta.embedding.recipe import StudentEncoderSpec, TeacherEncoderSpec

    names = {
        field: set(typing.get_args(spec.model_fields["pooling"].annotation))
        for field, spec in (("teacher", TeacherEncoderSpec), ("student", StudentEncoderSpec))
    }
    assert names["teacher"] == {AUTO, *POOLINGS}  # what mta embed builds with
    assert names["student"] <= set(POOLINGS) and names["student"] == {*STOCK_POOLINGS, "cls_attention"}  # exportable


def test_the_author_s_setting_is_the_talas_recipe():
    recipe = load_recipe(TALAS)
    assert recipe.task == "embedding"
    assert recipe.student.path.startswith("nreimers/MiniLMv2-L6-H384") and recipe.student.pooling == "cls_attention"
    assert (recipe.teacher.path, recipe.teacher.pooling, recipe.teacher.dtype) == (
        "Qwen/Qwen3-Embedding-0.6B",
        "last",
        "fp16",
    )
    loss, train = recipe.loss, recipe.train
    assert (loss.simcse_weight, loss.tamd_weight, loss.lasd_weight, loss.tamd_layers) == (0.001, 0.75, 1.0, 2)
    assert (loss.simcse_temperature, loss.lasd_detach, loss.lasd_reduction) == (0.1, False, "mean")
    assert (train.epochs, train.lr, train.batch_size, train.micro_batch_size) == (5, 2e-5, 32, 32)
    assert (train.weight_decay, train.projector_lr, recipe.data.max_length, recipe.seed) == (0.01, 1e-4, 256, 42)
    assert (train.asam.rho, train.asam.eta, train.asam.scope) == (0.05, 0.0, "all")


# ---------------------------------------------------------------- --dry-run


@pytest.mark.parametrize("path", [TINY_EMBED, TALAS], ids=lambda path: path.name)
def test_the_dry_run_plans_the_embedding_recipes_offline(path, monkeypatch):
    from rich.console import Console
    from transformers import AutoConfig, AutoModel, BertConfig

    from mta.training.dry_run import plan_run
    from mta_cli.dry_run_tables import render_plan

    attempts = []
    monkeypatch.setattr(
        socket.socket, "connect", lambda *a, **k: attempts.append(a) or (_ for _ in ()).throw(OSError())
    )
    recipe = load_recipe(path)
    plan = plan_run(recipe)
    spec = recipe.student
    if spec.config is not None:
        config = AutoConfig.from_pretrained(RECIPES / spec.config, local_files_only=True)
        teacher_width = AutoConfig.from_pretrained(RECIPES / recipe.teacher.config, local_files_only=True).hidden_size
    else:  # what build_tiny_encoder builds
        t = spec.tiny
        config = BertConfig(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            num_hidden_layers=t.num_layers,
            num_attention_heads=t.num_heads,
            intermediate_size=4 * t.hidden_size,
        )
        teacher_width = recipe.teacher.tiny.hidden_size
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert (plan.student.parameters, plan.student.architecture, plan.student.num_layers) == (
        count,
        "BertModel",
        config.num_hidden_layers,
    )
    assert plan.teacher is None and plan.layers == []  # the teacher is data here
    assert plan.projector_parameters == recipe.loss.tamd_layers * config.hidden_size * teacher_width
    trainable = count + plan.projector_parameters
    weight, optimizer = (2, 12) if recipe.train.precision == "bf16" else (4, 8)
    assert (plan.memory.student_weights, plan.memory.optimizer_states) == (weight * trainable, optimizer * trainable)
    console = Console(record=True, width=200)
    console.print(render_plan(plan))
    text = console.export_text()
    assert f"{count:,}" in text and "TAMD projection parameters" in text
    assert any("TAMD anchors student layers" in note for note in plan.notes)
    assert not attempts, "the dry run tried to open network connections"
