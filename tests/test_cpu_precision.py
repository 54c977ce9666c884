"""bf16 on the CPU: `auto` follows the processor (faked both ways), fp16 is refused, the tiny recipe
trains in bf16 (autocast over fp32 weights) and resumes bit for bit, `mta evaluate --dtype bf16`
scores bf16 weights, and the utilisation figures match a hand count."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import mta.dtypes
from fixtures.evaluate import FAST, run_cli
from fixtures.perplexity import loop_sums
from mta.dtypes import bf16_flags, cpu_has_native_bf16, resolve_dtype
from mta.errors import MtaError
from mta.training import engine as engines
from mta.training.config.loading import load_recipe
from mta.training.config.schema import TrainSpec
from mta.training.lifecycle import utilisation
from mta.training.lifecycle.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
CPU = torch.device("cpu")


def fake_processor(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(mta.dtypes, "cpu_has_native_bf16", lambda: native)


# ------------------------------------------------------------------------------------ auto


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_follows_the_processor(monkeypatch, native, expected):
    fake_processor(monkeypatch, native)
    assert resolve_dtype("auto", CPU) == expected
    assert resolve_dtype("fp32", CPU) == torch.float32 and resolve_dtype("bf16", CPU) == torch.bfloat16
    precision = engines.resolve_training_precision(TrainSpec(precision="auto", max_steps=1), CPU)
    assert precision.name == ("bf16" if native else "fp32")
    assert precision.autocast == native and precision.deepspeed == "fp32"
    assert "train.precision=auto" in precision.describe()
    assert precision.frozen_dtype == (torch.bfloat16 if native else None)


def test_mta_cpu_bf16_overrides_the_processor(monkeypatch):
    monkeypatch.setenv("MTA_CPU_BF16", "1")
    assert cpu_has_native_bf16() and resolve_dtype("auto", CPU) == torch.bfloat16
    assert "MTA_CPU_BF16=1" in mta.dtypes.auto_reason(CPU)
    monkeypatch.setenv("MTA_CPU_BF16", "0")
    assert not cpu_has_native_bf16() and resolve_dtype("auto", CPU) == torch.float32
    monkeypatch.setenv("MTA_CPU_BF16", "yes")
    with pytest.raises(MtaError, match="MTA_CPU_BF16='yes'"):
        cpu_has_native_bf16()


def test_the_bf16_flags_of_x86_and_arm_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\nbugs\t\t: spectre\n"
    old_x86 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
    assert bf16_flags(x86) == ("avx512_bf16",)
    assert bf16_flags(old_x86) == ()
    assert bf16_flags(arm) == ("bf16",)


def test_fp16_on_a_cpu_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(MtaError, match=r"train.precision=fp16 needs a GPU.*train.precision=bf16"):
        engines.resolve_training_precision(TrainSpec(precision="fp16", max_steps=1), CPU)
    from mta.training.trainer import run_distillation

    recipe = load_recipe(TINY, [f"output_dir={tmp_path / 'run'}", "train.precision=fp16"])
    with pytest.raises(MtaError, match="train.precision=fp16 needs a GPU"):
        run_distillation(recipe)
    assert not (tmp_path / "run" / "models").exists()  # refused before any model was built


def test_a_16_bit_student_needs_a_precision_that_keeps_master_weights(tmp_path):
    with pytest.raises(MtaError, match="student.dtype=bf16 cannot train with train.precision=auto"):
        load_recipe(TINY, ["student.dtype=bf16", "train.precision=auto"])


# ------------------------------------------------------------------------------------ training


def test_the_tiny_recipe_trains_in_bf16_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """train.precision=auto on a (faked) bf16 processor: autocast over fp32 weights; the run
    stopped after step 2 and resumed gives exactly the weights of the run that went through."""
    from mta.training.trainer import run_distillation

    fake_processor(monkeypatch, True)
    out = tmp_path / "run"
    overrides = [
        f"output_dir={out}",
        "train.precision=auto",
        "train.max_steps=4",
        "train.save_interval=2",
        "train.eval_interval=2",
        "train.log_interval=1",
        "train.num_sample_generations=1",
        "train.sample_max_new_tokens=3",
    ]
    recipe = load_recipe(TINY, overrides)
    seen = []
    real_autocast = torch.autocast

    def counting_autocast(*args, **kwargs):
        seen.append((args[0] if args else kwargs.get("device_type"), kwargs.get("dtype"), kwargs.get("enabled", True)))
        return real_autocast(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", counting_autocast)
    final = run_distillation(recipe)
    monkeypatch.setattr(torch, "autocast", real_autocast)
    assert ("cpu", torch.bfloat16, True) in seen  # the forwards ran under bf16 autocast
    weights = load_file(str(final / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}  # fp32 master weights exported

    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert [r["step"] for r in records if r["split"] == "dev"] == [0, 2, 4]

    # Flops per token: (6·N_student + 2·N_teacher) with one tokenizer, N counted by hand from the
    # saved weights, less the untied input embeddings (a lookup), and the recipe's HRA projectors
    # (32 -> 64, layers auto: 3 pairs).
    def matmul_count(model_dir: Path) -> int:
        tensors = load_file(str(model_dir / "model.safetensors"))
        assert not json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"]
        return sum(t.numel() for t in tensors.values()) - tensors["model.embed_tokens.weight"].numel()

    student_n = matmul_count(final)
    teacher_n = matmul_count(next((out / "models").glob("teacher-*")))
    projectors = 3 * (32 * 64 + 64)
    for record in train:
        assert record["mfu"] is None  # a CPU: no table peak
        per_token = record["flops_per_s"] / record["tokens_per_s"]
        assert per_token == pytest.approx(6 * (student_n + projectors) + 2 * teacher_n, rel=1e-9)

    # Stopped after step 2 (its checkpoint kept, later outputs removed), resumed: the same weights.
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-4")
    resumed = run_distillation(load_recipe(TINY, overrides), resume="auto")
    for name, tensor in load_file(str(resumed / "model.safetensors")).items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------ evaluate


def test_evaluate_with_dtype_bf16_scores_bf16_weights(tmp_path, data_dir, tiny_model_dir):  # noqa: F811
    out = tmp_path / "eval"
    run_cli(
        [
            str(tiny_model_dir),
            "-o",
            str(out),
            "--data-dir",
            str(data_dir),
            "--benchmarks",
            "dolly",
            "--perplexity",
            "dolly-dev",
            "--dtype",
            "bf16",
            "--device",
            "cpu",
            *FAST,
        ]
    )
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["dtype"] == "bfloat16"
    run = next(iter(results["checkpoints"].values()))
    from mta.evaluation.datasets import load_rows
    from mta.models.tokenizers import load_tokenizer

    rows, _ = load_rows(data_dir / "dolly" / "dev.jsonl")
    tokenizer = load_tokenizer(tiny_model_dir)
    expected = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
        total, count, _, _ = loop_sums(model, tokenizer, rows, 48, 6)
        expected[dtype] = math.exp(total / count)
    got = run["perplexity"]["perplexity"]
    # The bf16 model's perplexity (batching moves its last bits), not the fp32 one's.
    assert abs(got - expected[torch.bfloat16]) < abs(got - expected[torch.float32])
    assert got == pytest.approx(expected[torch.bfloat16], rel=2e-3)


def test_generate_with_dtype_bf16_samples_with_bf16_weights(tmp_path, tiny_model_dir, monkeypatch):
    import mta.pairs.generate
    from conftest import EXAMPLES
    from mta.pairs.generate import PairSettings, generate_pairs

    real, used = mta.pairs.generate.loaded_checkpoint, []

    @contextlib.contextmanager
    def recording(checkpoint, device, dtype):
        with real(checkpoint, device, dtype) as (model, tokenizer):
            used.append(next(model.parameters()).dtype)
            yield model, tokenizer

    monkeypatch.setattr(mta.pairs.generate, "loaded_checkpoint", recording)
    settings = PairSettings(limit=3, dtype="bf16", device="cpu", max_new_tokens=4, max_prompt_length=40, batch_size=3)
    out = generate_pairs(tiny_model_dir, tiny_model_dir, EXAMPLES, tmp_path / "pairs.jsonl", settings).path
    assert used == [torch.bfloat16, torch.bfloat16]  # teacher and student
    assert len(out.read_text().splitlines()) == 3


# ------------------------------------------------------------------------------------ utilisation


def _llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def test_model_flops_against_a_hand_count():
    # One block: q and o 16x16, k and v 16x8 (one key-value head of 8), gate, up, down 16x24,
    # two norms of 16; then the final norm; the embedding 100x16 (+ an untied head 100x16).
    block = 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 24 + 2 * 16
    body = 2 * block + 16
    embedding = 100 * 16
    tied, untied = _llama(True), _llama(False)
    assert sum(p.numel() for p in tied.parameters()) == body + embedding  # the hand count is right
    assert utilisation.matmul_parameters(tied) == body + embedding  # the embedding is the head
    assert utilisation.matmul_parameters(untied) == body + embedding  # lookup left out, head kept
    assert utilisation.matmul_parameters(tied, runs_head=False) == body
    assert utilisation.matmul_parameters(untied, runs_head=False) == body

    class Frozen(torch.nn.Module):  # what StepFlops reads of a FrozenTeacher
        def __init__(self, model, need_logits):
            super().__init__()
            self.model, self.need_logits = model, need_logits

    projector = torch.nn.Linear(16, 32)
    trained = torch.nn.ModuleDict({"student": untied, "projector": projector})
    flops = utilisation.StepFlops(trained, untied, Frozen(_llama(True), need_logits=False))
    n = body + embedding + 16 * 32 + 32
    assert flops.of(10, 7) == 6 * n * 10 + 2 * body * 7
    # LoRA-like: frozen base weights have no weight gradient (4·N + 2·N_trainable per token).
    for parameter in untied.parameters():
        parameter.requires_grad_(False)
    flops = utilisation.StepFlops(trained, untied)
    assert flops.of(10) == (4 * n + 2 * (16 * 32 + 32)) * 10


def test_the_peak_table_and_mfu():
    assert utilisation.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert utilisation.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert utilisation.peak_bf16_tflops("NVIDIA H200") == 989.0
    assert utilisation.peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert utilisation.peak_bf16_tflops("NVIDIA L40S") == 362.0
    assert utilisation.peak_bf16_tflops("NVIDIA L4") == 121.0
    assert utilisation.peak_bf16_tflops("NVIDIA A10") == 125.0
    assert utilisation.peak_bf16_tflops("NVIDIA GeForce RTX 4090") == 165.0
    assert utilisation.peak_bf16_tflops("NVIDIA A10G") is None  # not A10's figure
    assert utilisation.peak_bf16_tflops("Tesla V100-SXM2-16GB") is None
    assert utilisation.device_peak_flops(CPU) is None
    assert utilisation.mfu(3e14, 1e15, world_size=2) == pytest.approx(0.15)
    assert utilisation.mfu(3e14, None) is None
