"""Benchmark: the paper's GPT-2 1.5B -> 120M step on a GPU, each base alone and with MTA.

The models are the shipped recipes' architectures (``teacher.config`` / ``student.config`` of
``gpt2``, ``gpt2-fdd``, ``gpt2-distillm2``) with random weights, the teacher frozen in bf16 and
the student trained the way ``mta distill`` trains it: the recipe's loss (``DistillationObjective``)
inside DeepSpeed ZeRO-1 with bf16 and fp32 master weights (``mta.training.engine.initialize``).
The micro batch is the recipes' (8 rows of 256 tokens, 128 of them prompt) with synthetic ids
and spans (words of 1-3 tokens tiling each response, phrases of 4-8), so the loss does the work
a real batch gives it. Parts, each its own flag and time budget:

    distillm    srkl (skew 0.1) vs srkl + MTA        (recipe gpt2; off-policy sampling not timed)
                + MTA from a teacher cache (k = 64, compact; rebuilt each step: `mta teacher`)
    distillm2   DistiLLM-2's loss vs + MTA on pairs  (recipe gpt2-distillm2)
    fdd         FDD vs FDD + MTA                     (recipe gpt2-fdd)
    logits      the whole logits vs the fused head + loss (loss.fused_head, issue 52) at
                bench/logit_memory.py's shapes: a Qwen2.5-0.5B-headed student (hidden 896,
                vocabulary 151,936, 2 layers) and a 1,536-wide 2-layer teacher, 8 × 512 tokens
                (prompt 128), srkl and fkl; peak memory is the number to read

For every variant: median step seconds, tokens/s, model FLOP/s and model-FLOPs utilisation
(``mta.training.lifecycle.utilisation``, the numbers ``metrics.jsonl`` logs: 6·N·tokens for the
student, 2·N·tokens for the teacher forward, against the device's dense bf16 peak), and peak
memory. Variants of a part are interleaved, rounds until the part's budget is spent (at least
``MIN_ROUNDS``).

    python bench/paper_shapes.py                     # one GPU, all parts, ~6 min
    python bench/paper_shapes.py --parts fdd --budget-s 120
    python bench/paper_shapes.py --smoke             # tiny shapes on this CPU (the test suite)

Writes bench/results/paper_shapes_gpu.json (``--output`` to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from interleaving import interleaved_rounds
from logit_memory import FULL, QUICK, model_configs
from machine import created, describe_machine
from mta.distributed import local_device
from mta.files import atomic_write_json
from mta.losses.fused_head import TopKTeacher
from mta.losses.span_masks import SpanBatch
from mta.losses.teacher_topk import teacher_logits_from_top_k, top_k_log_probs
from mta.training import engine as engines
from mta.training.batching import TokenBatch, TrainBatch
from mta.training.config.catalog import SHIPPED_DIR
from mta.training.config.layers import resolve_fdd_layers, resolve_layer_map
from mta.training.config.loading import load_recipe
from mta.training.lifecycle.utilisation import StepFlops, device_peak_flops
from mta.training.logit_lens import LogitLens
from mta.training.objective import DistillationModel, DistillationObjective
from mta.training.teacher import FrozenTeacher, TeacherOutput

REPO = Path(__file__).resolve().parents[1]
PARTS = {"distillm": "gpt2", "distillm2": "gpt2-distillm2", "fdd": "gpt2-fdd", "logits": "qwen"}
MIN_ROUNDS = 3
# --smoke keeps the recipes' depths (their layer maps name those layers) at tiny widths.
SMOKE_SHAPES = {"teacher": dict(n_embd=32, n_head=2), "student": dict(n_embd=16, n_head=2)}
SMOKE_VOCAB = 512


@dataclass
class Variant:
    name: str
    step: Step
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int = 0


def model_config(recipe, role: str, smoke: bool):
    spec = getattr(recipe, role)
    config_path = recipe.resolve(spec.config, f"{role}.config")
    values = json.loads(config_path.read_text(encoding="utf-8"))
    if smoke:
        values.update(SMOKE_SHAPES[role], vocab_size=SMOKE_VOCAB, n_positions=512, bos_token_id=0, eos_token_id=0)
    return AutoConfig.for_model(**values)


def synthetic_batch(rows: int, length: int, prompt: int, vocab: int, seed: int, paired: bool) -> TrainBatch:
    """Random ids, every token real; words of 1-3 tokens tile each response, phrases of 4-8."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    labels = ids.clone()
    labels[:, :prompt] = -100
    tokens = TokenBatch(ids, torch.ones_like(ids), labels)

    def tiling(low: int, high: int) -> SpanBatch:
        widths = torch.randint(low, high + 1, (rows, length), generator=generator)
        ends = prompt + widths.cumsum(dim=1)
        starts = ends - widths
        mask = ends <= length
        starts, ends = starts * mask, ends * mask
        return SpanBatch(starts, ends, starts, ends, mask)

    spans = {"word": tiling(1, 3), "phrase": tiling(4, 8)}
    chosen = torch.arange(rows) % 2 == 0 if paired else None
    return TrainBatch([str(i) for i in range(rows)], tokens, tokens, spans, chosen)


class Step:
    """One optimizer step of a recipe's objective in a DeepSpeed ZeRO-1 engine, as Trainer.step."""

    def __init__(self, recipe, teacher_model, student_config, batch: TrainBatch, device, dtype, cached=False):
        student = AutoModelForCausalLM.from_config(student_config).to(device)
        s_layers, t_layers = student_config.num_hidden_layers, teacher_model.config.num_hidden_layers
        loss = recipe.loss
        pairs = resolve_layer_map(loss.layers, s_layers, t_layers) if loss.trajectory_terms else []
        fdd_pairs = resolve_fdd_layers(loss.fdd_layers, s_layers, t_layers) if loss.fdd_weight else []
        torch.manual_seed(recipe.seed)
        objective = DistillationObjective(
            loss,
            pairs,
            student_hidden_size=student_config.hidden_size,
            teacher_hidden_size=teacher_model.config.hidden_size,
            same_tokenizer=True,
            vocab_size=student_config.vocab_size,
            fdd_pairs=fdd_pairs,
        )
        model = DistillationModel(student, objective, fdd_final_norm=loss.fdd_final_norm)
        train = recipe.train.model_copy(
            update={
                "batch_size": batch.student.input_ids.shape[0],
                "micro_batch_size": batch.student.input_ids.shape[0],
                "precision": "bf16" if dtype == torch.bfloat16 else "fp32",
                "zero_stage": 1,
            }
        )
        self.engine = engines.initialize(model, model.projector_parameters(), train, {}, 10_000, 1)
        lens = (
            LogitLens(teacher_model, final_norm=loss.fdd_final_norm or objective.fdd is None, num_layers=t_layers)
            if objective.fdd is not None
            else None
        )
        self.fused = objective.fused_head
        self.teacher = FrozenTeacher(
            teacher_model, objective.teacher_layers, objective.needs_teacher_logits, lens, fused=self.fused
        )
        self.batch = batch.to(device)
        self.student_parameters = sum(p.numel() for p in student.parameters())
        self.flops = StepFlops(model, student, None if cached else self.teacher).of(
            batch.num_tokens, int(batch.teacher.attention_mask.sum())
        )
        self.stored = self.store(loss.temperature, student_config.vocab_size) if cached else None

    @torch.no_grad()
    def store(self, temperature: float, vocab: int) -> dict:
        """What `mta teacher` stores of this batch (k = 64, compact), held on the host: the cached
        variant rebuilds the teacher's output from it at every step (the disk read is not timed)."""
        side = self.batch.teacher
        out = self.teacher(side.input_ids, side.attention_mask)
        stored = {"hidden": {layer: h.to("cpu", torch.float16) for layer, h in out.hidden_states.items()}}
        if out.logits is not None or out.side is not None:
            row, position = (side.labels[:, 1:] != -100).nonzero(as_tuple=True)
            logits = (
                out.logits[row, position]
                if out.logits is not None
                else out.side.select(row, position).chunk_logits(0, len(row), vocab)
            )
            ids, log_probs, tail = top_k_log_probs(logits, 64, temperature=temperature, vocab_size=vocab)
            stored.update(row=row.cpu(), position=position.cpu(), ids=ids.int().cpu(), log_probs=log_probs.half().cpu())
            stored.update(tail=tail.cpu(), temperature=temperature, vocab=vocab, shape=side.input_ids.shape)
        return stored

    def rebuilt(self) -> TeacherOutput:
        stored, device = self.stored, self.batch.student.input_ids.device
        assert stored is not None, "rebuilt() is the cached variant's teacher"
        hidden = {layer: h.to(device).float() for layer, h in stored["hidden"].items()}
        logits = None
        if "ids" in stored and self.fused:  # the top k itself: the fused loss rebuilds p̃ a chunk at a time
            row, position = stored["row"].to(device), stored["position"].to(device)
            k = stored["ids"].shape[1]
            ids = torch.zeros(*stored["shape"], k, dtype=torch.long, device=device)
            log_probs = torch.full((*stored["shape"], k), -1.0e4, device=device)
            tail = torch.full(tuple(stored["shape"]), -1.0e4, device=device)
            ids[row, position] = stored["ids"].to(device).long()
            log_probs[row, position] = stored["log_probs"].to(device).float()
            tail[row, position] = stored["tail"].to(device)
            side = TopKTeacher(ids, log_probs, tail, stored["vocab"], stored["temperature"])
            return TeacherOutput(hidden, None, side=side)
        if "ids" in stored:
            logits = torch.zeros(*stored["shape"], stored["vocab"], device=device)
            logits[stored["row"].to(device), stored["position"].to(device)] = teacher_logits_from_top_k(
                stored["ids"].to(device),
                stored["log_probs"].to(device).float(),
                stored["tail"].to(device),
                stored["vocab"],
                stored["temperature"],
            )
        return TeacherOutput(hidden, logits)

    def __call__(self) -> None:
        side = self.batch.teacher
        teacher = self.rebuilt() if self.stored is not None else self.teacher(side.input_ids, side.attention_mask)
        losses = self.engine(self.batch, teacher)
        self.engine.backward(losses["total"])
        self.engine.step()


def run_variant(variant: Variant, device) -> None:
    synchronise = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronise()
    start = time.perf_counter()
    variant.step()
    synchronise()
    variant.seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        variant.peak_bytes = max(variant.peak_bytes, torch.cuda.max_memory_allocated())


def measure_part(name: str, recipe_name: str, args, device, dtype) -> dict:
    started = time.perf_counter()
    recipe = load_recipe(SHIPPED_DIR / f"{recipe_name}.yaml", ["off_policy.mode=off"] if recipe_name == "gpt2" else [])
    teacher_config, student_config = (model_config(recipe, role, args.smoke) for role in ("teacher", "student"))
    torch.manual_seed(0)
    teacher_model = AutoModelForCausalLM.from_config(teacher_config).to(device=device, dtype=dtype)
    data = recipe.data
    rows = 2 if args.smoke else recipe.train.micro_batch_size
    length = 64 if args.smoke else data.max_length
    prompt = 32 if args.smoke else data.max_prompt_length
    batch = synthetic_batch(
        rows, length, prompt, student_config.vocab_size, seed=1, paired=recipe.loss.base == "distillm2"
    )
    base_recipe = recipe.model_copy(
        update={"loss": recipe.loss.model_copy(update={"dsa_weight": 0.0, "hra_weight": 0.0})}
    )
    variants = [
        Variant(name, Step(base_recipe, teacher_model, student_config, batch, device, dtype)),
        Variant(f"{name}_mta", Step(recipe, teacher_model, student_config, batch, device, dtype)),
    ]
    if not recipe.loss.fdd_weight:  # FDD needs the online teacher (docs/teacher-cache.md)
        cached = Step(recipe, teacher_model, student_config, batch, device, dtype, cached=True)
        variants.append(Variant(f"{name}_mta_cached", cached))
    # MIN_ROUNDS interleaved rounds, then more (the order alternating) until the budget is spent.
    interleaved_rounds(
        variants,
        MIN_ROUNDS,
        lambda v: run_variant(v, device),
        warm_up=lambda v: (v.step(), v.step()),
        describe=lambda v: f"{v.name} {v.seconds[-1]:.3f}s",
    )
    rounds = MIN_ROUNDS
    while time.perf_counter() - started < args.budget_s and rounds < args.max_rounds:
        for variant in variants[rounds % 2 :] + variants[: rounds % 2]:
            run_variant(variant, device)
        rounds += 1
    tokens = batch.num_tokens
    peak = device_peak_flops(device)
    out = {
        "recipe": recipe_name,
        "rounds": rounds,
        "tokens_per_step": tokens,
        "seconds_spent": time.perf_counter() - started,
        "student_parameters": variants[0].step.student_parameters,
        "teacher_parameters": sum(p.numel() for p in teacher_model.parameters()),
        "device_peak_flops_per_s": peak,
        "variants": {},
    }
    for variant in variants:
        median = statistics.median(variant.seconds)
        flops_per_s = variant.step.flops / median
        out["variants"][variant.name] = {
            "model_flops_per_step": variant.step.flops,
            "seconds_per_step_median": median,
            "seconds_per_step": variant.seconds,
            "tokens_per_s": tokens / median,
            "model_flops_per_s": flops_per_s,
            "mfu": flops_per_s / peak if peak else None,
            "peak_memory_gib": variant.peak_bytes / 2**30 if device.type == "cuda" else None,
        }
    out["ratio_mta_to_base"] = (
        out["variants"][f"{name}_mta"]["seconds_per_step_median"] / out["variants"][name]["seconds_per_step_median"]
    )
    if f"{name}_mta_cached" in out["variants"]:
        out["ratio_mta_cached_to_mta"] = (
            out["variants"][f"{name}_mta_cached"]["seconds_per_step_median"]
            / out["variants"][f"{name}_mta"]["seconds_per_step_median"]
        )
    for variant in variants:
        variant.step.engine.destroy()
    return out


def measure_logits_part(args, device, dtype) -> dict:
    """The whole logits vs the fused head + loss, srkl and fkl, interleaved: seconds and peak memory."""
    shapes = QUICK if args.smoke else FULL
    student_config, teacher_config = model_configs(shapes)
    torch.manual_seed(0)
    teacher_model = AutoModelForCausalLM.from_config(teacher_config).to(device=device, dtype=dtype)
    batch = synthetic_batch(shapes.rows, shapes.length, shapes.prompt, shapes.vocab, seed=1, paired=False)
    recipe = load_recipe(SHIPPED_DIR / "qwen.yaml", ["off_policy.mode=off"])
    variants = []
    for base in ("srkl", "fkl"):
        for fused in (False, True):
            loss = recipe.loss.model_copy(
                update={"base": base, "dsa_weight": 0.0, "hra_weight": 0.0, "fused_head": fused}
            )
            step = Step(recipe.model_copy(update={"loss": loss}), teacher_model, student_config, batch, device, dtype)
            variants.append(Variant(f"{base}_{'fused' if fused else 'materialized'}", step))
    interleaved_rounds(
        variants,
        MIN_ROUNDS,
        lambda v: run_variant(v, device),
        warm_up=lambda v: v.step(),
        describe=lambda v: f"{v.name} {v.seconds[-1]:.3f}s",
    )
    out: dict = {"shapes": shapes.__dict__, "rounds": MIN_ROUNDS, "variants": {}}
    for variant in variants:
        out["variants"][variant.name] = {
            "seconds_per_step_median": statistics.median(variant.seconds),
            "seconds_per_step": variant.seconds,
            "peak_memory_gib": variant.peak_bytes / 2**30 if device.type == "cuda" else None,
        }
        variant.step.engine.destroy()
    for base in ("srkl", "fkl"):
        fused, whole = out["variants"][f"{base}_fused"], out["variants"][f"{base}_materialized"]
        out[f"{base}_time_ratio_fused_vs_materialized"] = (
            fused["seconds_per_step_median"] / whole["seconds_per_step_median"]
        )
        if device.type == "cuda":
            out[f"{base}_peak_ratio_fused_vs_materialized"] = fused["peak_memory_gib"] / whole["peak_memory_gib"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=120.0, help="seconds per part (at least 3 rounds run)")
    parser.add_argument("--max-rounds", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, fp32 (checks the script runs)")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "paper_shapes_gpu.json")
    args = parser.parse_args()
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    engines.init_distributed()
    device = torch.device("cpu") if args.smoke else local_device()
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    results = {}
    for part in parts:
        print(f"{part}: recipe {PARTS[part]}", flush=True)
        if part == "logits":
            results[part] = measure_logits_part(args, device, dtype)
            continue
        results[part] = measure_part(part, PARTS[part], args, device, dtype)
        print(f"  {part}: MTA / base {results[part]['ratio_mta_to_base']:.3f}", flush=True)
    payload = {
        "benchmark": "bench/paper_shapes.py",
        "created": created(),
        "machine": describe_machine(device),
        "setup": {
            "smoke": args.smoke,
            "dtype": str(dtype).removeprefix("torch."),
            "zero_stage": 1,
            "budget_s_per_part": args.budget_s,
            "weights": "random, from the recipes' configs",
        },
        "results": results,
    }
    atomic_write_json(args.output, payload)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
