"""Benchmark: a step's memory with the whole logits vs the fused head + loss (issue 52).

One forward + backward (no optimizer step) of a student with Qwen2.5-0.5B's head shape (hidden
896, vocabulary 151,936, tied embeddings, two decoder layers so it fits this CPU) against a frozen
teacher with hidden 1,536, two decoder layers and the same vocabulary, both fp32, on a micro batch
of 8 × 512 tokens (prompt 128, response 384), through the training objective
(``mta.training.objective.DistillationModel``, the base loss alone), for the base losses srkl and
fkl and two paths:

    materialized   loss.fused_head=false: both models return their whole [batch, seq, vocab]
                   logits and the chunked loss keeps a [tokens, vocab] gradient
    fused          loss.fused_head=true: both models return their final hidden states; the heads
                   are applied to loss.chunk_size (128) response positions at a time
                   (mta.losses.fused_head)

Each measurement is its own process (``--child``): it builds the models and the batch, reads its
resident set size (``VmRSS``), runs a first step (the student's gradients are allocated and kept,
zeroed, as a training run keeps them), resets the peak (``/proc/self/clear_refs``), runs a step and
reads the peak (``VmHWM``): the step's memory is the peak minus the resident size after imports
and loading (the gradients included), the whole peak is reported too. That step and one more are
timed (CPU time of the process, one torch thread; wall time too); the step time is their median.
Variants are interleaved (the order rotating every round; the JSON is written after each round);
the JSON has per-variant medians and, per loss,
``peak_ratio_fused_vs_materialized`` (whole peaks), ``step_memory_ratio_fused_vs_materialized``,
``time_ratio_fused_vs_materialized`` and ``dry_run_estimate_error``: the dry run's estimate of
the same components (``mta.training.dry_run.estimate_memory``: the student's gradients and the
activations with the logits, without the optimizer states the bench does not hold) against the
measured step memory, ``|estimate − measured| / measured``. The top-level keys are the worst
over the losses. Targets on this CPU: peak ratio ≤ 0.35, time ratio ≤ 1.05, estimate error ≤ 0.15.

    python bench/logit_memory.py               # a quiet machine, ~24 GiB: bench/results/logit_memory.json
    python bench/logit_memory.py --quick       # tiny shapes, one round: checks it runs end to end

``--quick`` writes to the temporary directory unless ``--output`` is given (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOSSES = ("srkl", "fkl")
PATHS = ("materialized", "fused")
CHUNK = 128


@dataclass(frozen=True)
class Shapes:
    """The models' and the micro batch's shapes."""

    vocab: int
    student_hidden: int
    student_heads: int
    student_kv_heads: int
    student_intermediate: int
    teacher_hidden: int
    teacher_heads: int
    teacher_kv_heads: int
    teacher_intermediate: int
    layers: int
    rows: int
    length: int
    prompt: int


# Qwen2.5-0.5B's head (and block) shape for the student, Qwen2.5-1.5B's for the teacher.
FULL = Shapes(151_936, 896, 14, 2, 4_864, 1_536, 12, 2, 8_960, 2, 8, 512, 128)
QUICK = Shapes(4_096, 64, 4, 2, 128, 96, 4, 2, 192, 2, 2, 64, 16)


def model_configs(shapes: Shapes):
    """``(student, teacher)`` Qwen2 configs with tied embeddings (as Qwen2.5-0.5B / 1.5B)."""
    from transformers import AutoConfig

    def config(hidden: int, heads: int, kv_heads: int, intermediate: int):
        return AutoConfig.for_model(
            "qwen2",
            vocab_size=shapes.vocab,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=intermediate,
            num_hidden_layers=shapes.layers,
            max_position_embeddings=max(shapes.length, 1024),
            tie_word_embeddings=True,
        )

    student = config(shapes.student_hidden, shapes.student_heads, shapes.student_kv_heads, shapes.student_intermediate)
    teacher = config(shapes.teacher_hidden, shapes.teacher_heads, shapes.teacher_kv_heads, shapes.teacher_intermediate)
    return student, teacher


def _status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def child(loss: str, path: str, shapes: Shapes) -> dict:
    """One variant in this process: memory of one step, then the time of two more."""
    import torch
    from transformers import AutoModelForCausalLM

    from mta.losses.span_masks import SpanBatch
    from mta.training.batching import TokenBatch, TrainBatch
    from mta.training.config.schema import LossSpec
    from mta.training.objective import DistillationModel, DistillationObjective
    from mta.training.teacher import FrozenTeacher

    torch.set_num_threads(1)
    fused = path == "fused"
    student_config, teacher_config = model_configs(shapes)
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_config(student_config).float()
    teacher_model = AutoModelForCausalLM.from_config(teacher_config).float()
    spec = LossSpec(base=loss, dsa_weight=0, hra_weight=0, chunk_size=CHUNK, fused_head=fused)
    objective = DistillationObjective(
        spec, [], student_hidden_size=shapes.student_hidden, teacher_hidden_size=None,
        same_tokenizer=True, vocab_size=shapes.vocab,
    )  # fmt: skip
    model = DistillationModel(student, objective).train()
    teacher = FrozenTeacher(teacher_model, [], objective.needs_teacher_logits, fused=fused)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shapes.vocab, (shapes.rows, shapes.length), generator=generator)
    labels = ids.clone()
    labels[:, : shapes.prompt] = -100
    tokens = TokenBatch(ids, torch.ones_like(ids), labels)
    empty = torch.zeros(shapes.rows, 0, dtype=torch.long)
    batch = TrainBatch([str(i) for i in range(shapes.rows)], tokens, tokens, {"none": SpanBatch(*[empty] * 5)})

    def step() -> None:
        out = teacher(ids, tokens.attention_mask)
        losses = model(batch, out)
        losses["total"].backward()
        del out, losses
        model.zero_grad(set_to_none=False)  # kept, as a run keeps them (accumulation, DeepSpeed)

    loaded = _status("VmRSS")
    step()  # the gradients are allocated
    seconds, cpu_seconds, peak = [], [], 0
    for index in range(2):
        if index == 0:
            Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - wall)
        cpu_seconds.append(time.process_time() - cpu)
        if index == 0:
            peak = _status("VmHWM")
    return {
        "loss": loss,
        "path": path,
        "rss_after_load": loaded,
        "peak_rss": peak,
        "step_bytes": peak - loaded,
        "step_seconds": statistics.median(seconds),
        "step_cpu_seconds": statistics.median(cpu_seconds),
        "dry_run_estimate": dry_run_estimate(student, teacher_model, shapes, fused),
    }


def dry_run_estimate(student, teacher, shapes: Shapes, fused: bool) -> int:
    """What ``estimate_memory`` counts of this step: the student's gradients and the activations
    (with the logits), fp32, one device, no ZeRO."""
    from mta.training.config.schema import ModelSpec
    from mta.training.dry_run import ModelPlan, estimate_memory, plan_from_config

    def plan(model, role: str) -> ModelPlan:  # as the dry run plans a model from its config
        return plan_from_config(ModelSpec(path=role, dtype="fp32"), role, model.config, "bench")

    estimate = estimate_memory(
        plan(student, "student"),
        plan(teacher, "teacher"),
        trainable_extra=0,
        aligned_teacher_layers=0,
        precision="fp32",
        zero_stage=0,
        teacher_zero3=False,
        world_size=1,
        micro_batch_size=shapes.rows,
        sequence_length=shapes.length,
        logit_chunk=CHUNK if fused else None,
    )
    return estimate.student_gradients + estimate.activations


CHUNK_LOSSES = ("ce", "fkl", "rkl", "skl", "srkl", "jsd", "tvd")


def chunk_child(loss: str, shapes: Shapes) -> dict:
    """The fp32 ``[chunk, vocab]`` buffers one fused chunk holds at once for ``loss``: the peak of
    two chunks of the fused head (``mta.losses.fused_head``) over the student's head, less the
    head's fp32 gradient, in buffers (what ``FUSED_FP32_BUFFERS`` in the dry run counts)."""
    import torch

    from mta.losses.fused_head import HeadTeacher, OutputHead, fused_head_loss
    from mta.losses.kd import build_base_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab, tokens = shapes.vocab, 2 * CHUNK
    weight = torch.nn.Parameter(torch.randn(vocab, shapes.student_hidden) * 0.02)
    hidden = torch.randn(tokens, shapes.student_hidden, requires_grad=True)
    teacher = HeadTeacher(
        torch.randn(tokens, shapes.teacher_hidden), OutputHead(torch.randn(vocab, shapes.teacher_hidden) * 0.02)
    )
    base = build_base_loss(loss)
    targets = torch.randint(0, vocab, (tokens,))
    loaded = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    fused_head_loss(
        base.token_loss, hidden, OutputHead(weight), None if loss == "ce" else teacher, targets,
        vocab_size=vocab, chunk_size=CHUNK, token_loss_and_grad=base.token_loss_and_grad,
    )  # fmt: skip
    buffer = CHUNK * vocab * 4
    return {"loss": loss, "buffers": (_status("VmHWM") - loaded - weight.numel() * 4) / buffer}


def run_child(loss: str, path: str, quick: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "cli"), env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--child", f"{loss}:{path}"] + (["--quick"] if quick else [])
    if path == "chunk":
        command[2:4] = ["--chunk-child", loss]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{loss}/{path} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarise(runs: dict[tuple[str, str], list[dict]]) -> dict:
    """Per loss and path the medians over rounds; per loss the ratios; the worst over losses."""
    per_loss = {}
    for loss in LOSSES:
        medians = {}
        for path in PATHS:
            samples = runs[(loss, path)]
            medians[path] = {
                key: statistics.median(sample[key] for sample in samples)
                for key in ("rss_after_load", "peak_rss", "step_bytes", "step_seconds", "step_cpu_seconds")
            }
            medians[path]["dry_run_estimate"] = samples[0]["dry_run_estimate"]
            medians[path]["dry_run_estimate_error"] = abs(
                samples[0]["dry_run_estimate"] - medians[path]["step_bytes"]
            ) / max(medians[path]["step_bytes"], 1)
        fused, whole = medians["fused"], medians["materialized"]
        per_loss[loss] = {
            "variants": medians,
            "peak_ratio_fused_vs_materialized": fused["peak_rss"] / whole["peak_rss"],
            "step_memory_ratio_fused_vs_materialized": fused["step_bytes"] / whole["step_bytes"],
            "time_ratio_fused_vs_materialized": fused["step_cpu_seconds"] / whole["step_cpu_seconds"],
            "wall_time_ratio_fused_vs_materialized": fused["step_seconds"] / whole["step_seconds"],
            "dry_run_estimate_error": fused["dry_run_estimate_error"],
        }
    worst = {
        key: max(per_loss[loss][key] for loss in LOSSES)
        for key in ("peak_ratio_fused_vs_materialized", "time_ratio_fused_vs_materialized", "dry_run_estimate_error")
    }
    return {**worst, "losses": per_loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round (checks the script runs)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3; --quick: 1)")
    parser.add_argument("--output", type=Path, default=None, help="default bench/results/logit_memory.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = QUICK if args.quick else FULL
    if args.chunk_child is not None:
        print(json.dumps(chunk_child(args.chunk_child, shapes)))
        return
    if args.child is not None:
        loss, path = args.child.split(":")
        print(json.dumps(child(loss, path, shapes)))
        return

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import created, describe_machine
    from mta.files import atomic_write_json

    rounds = 1 if args.quick else args.rounds
    output = args.output or (
        Path(tempfile.gettempdir()) / "logit_memory_quick.json"
        if args.quick
        else REPO / "bench" / "results" / "logit_memory.json"
    )
    measured = ("srkl",) if args.quick else CHUNK_LOSSES  # --quick: that it runs
    chunk_buffers = {loss: run_child(loss, "chunk", args.quick)["buffers"] for loss in measured}
    variants = [(loss, path) for loss in LOSSES for path in PATHS]
    runs: dict[tuple[str, str], list[dict]] = {variant: [] for variant in variants}
    for index in range(rounds):  # interleaved: the order rotates every round
        shift = index % len(variants)
        for loss, path in variants[shift:] + variants[:shift]:
            sample = run_child(loss, path, args.quick)
            runs[(loss, path)].append(sample)
            print(
                f"  round {index + 1}/{rounds} {loss}/{path}: step {sample['step_bytes'] / 2**30:.2f} GiB, "
                f"peak {sample['peak_rss'] / 2**30:.2f} GiB, {sample['step_cpu_seconds']:.2f} s",
                flush=True,
            )
        payload = {  # written after every round: an interrupted run keeps the rounds it finished
            "benchmark": "bench/logit_memory.py",
            "created": created(),
            "machine": describe_machine(torch.device("cpu")),
            "setup": {
                "quick": args.quick,
                "shapes": shapes.__dict__,
                "dtype": "float32",
                "chunk_size": CHUNK,
                "rounds": index + 1,
                "step": "teacher forward + student forward + base loss + backward, no optimizer step",
                "time": "process CPU time, one torch thread (wall time in wall_time_ratio_*)",
                "targets": {"peak_ratio": 0.35, "time_ratio": 1.05, "dry_run_estimate_error": 0.15},
            },
            **summarise(runs),
            "chunk_buffers": chunk_buffers,
        }
        atomic_write_json(output, payload)
        print(json.dumps({key: payload[key] for key in list(payload)[4:7]}, indent=1))
    print(f"wrote {output.name if not args.quick else output}")


if __name__ == "__main__":
    main()
