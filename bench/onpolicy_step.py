"""Benchmark: an on-policy training step (`off_policy.mode: always`), and what MTA's spans of
generated text cost in it.

Every step samples the student's responses to a micro batch's prompts and trains on them, with
the pieces `mta distill` uses: `mta.training.off_policy.micro_batches.OffPolicyBatches` (generation with
`mta.generation`, spans with `mta.data.online_spans`), `DistillationModel`, `FrozenTeacher` and
the optimizer of `mta.training.engine`. Four variants, the same prompts and seeds:

    base_generation   generation, then the base loss (srkl) alone: no spans needed
    mta_online        + 2·DSA + 0.2·HRA, spans parsed in a worker process while the teacher
                      forward runs, asked for before the student's (what `mta distill` does)
    mta_sync          the same, spans parsed in the training process right after generation,
                      as the published code does at every step
    mta_given         the same, spans ready at once (parsed beforehand for the same texts): the
                      floor the other two are compared with

Every completion has exactly `--new-tokens` tokens (stop tokens held back, `min_new_tokens`),
and the learning rate is 0 — the optimizer still does all its work — so the student stays the
model that generated the texts the given spans were parsed for, and every variant generates the
same. Variants are interleaved over rounds (the order rotates), each reports median seconds per
step and the part after generation (the step minus the time inside the generator); ratios are
medians of per-round ratios. Wall clock: the worker's parsing runs on another core, which a CPU
clock of the training process would not see. On a CPU the models run on one torch thread.

    python bench/onpolicy_step.py            # CPU, a few minutes -> bench/results/onpolicy_step.json
    python bench/onpolicy_step.py --quick    # under 3 minutes
    bench/distill_step_gpu.sh --onpolicy     # one GPU -> bench/results/onpolicy_step_gpu.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from distill_step import PRESETS, TRAIN, Sizes, TrainingStep, small_tokenizer, synchronize, tiny_llama, write_rows
from interleaving import interleaved_rounds, paired_ratio
from machine import created, describe_machine
from mta.data.annotate import AnnotateSettings, annotate_file
from mta.data.annotations import read_annotations
from mta.data.online_spans import PendingSpans, SpanParser
from mta.files import atomic_write_json
from mta.models.tokenizers import load_tokenizer
from mta.training.batching import AnnotatedExamples, micro_batch_order
from mta.training.config.layers import resolve_layer_map
from mta.training.config.schema import LossSpec, Recipe
from mta.training.objective import DistillationModel, DistillationObjective
from mta.training.off_policy.micro_batches import OffPolicyBatches
from mta.training.teacher import FrozenTeacher
from paths import portable

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"ratio_online_vs_given": 1.05, "ratio_online_vs_given_after_generation": 1.15}
SPAN_WORKERS = 1


class GivenSpans:
    """A span parser whose answers are ready at once: each batch of rows parsed beforehand (on
    first sight, in the warm-up round) by a synchronous parser."""

    def __init__(self, parser: SpanParser):
        self.parser = parser
        self.cache: dict[tuple, object] = {}
        self.misses = 0

    def submit(self, rows) -> PendingSpans:
        key = tuple((row.id, row.generated_ids.tobytes()) for row in rows)
        if key not in self.cache:
            self.misses += 1
            self.cache[key] = self.parser.parse(rows)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(self.cache[key])
        return PendingSpans([future], 1.0)


@dataclass
class Variant:
    name: str
    step: OnPolicyStep
    whole: list[float] = field(default_factory=list)  # mean wall s/step, one value per round
    after_generation: list[float] = field(default_factory=list)


class OnPolicyStep(TrainingStep):
    """One step: the student generates for micro batch ``index``'s prompts, then the training
    step of ``distill_step.TrainingStep`` runs on what it generated, its spans asked for after
    the teacher forward as ``Trainer.run_window`` asks."""

    def __init__(self, sampled: OffPolicyBatches, rows: list[np.ndarray], gold, *args):
        super().__init__(*args)
        self.sampled, self.rows, self.gold = sampled, rows, gold
        for group in self.optimizer.param_groups:  # every update is computed and scaled by 0
            group["lr"] = 0.0
        self.generation_s = 0.0

    def __call__(self, index: int) -> None:
        before = self.sampled.window["generation_s"]
        batch, source = self.sampled.batch(index, 0, self.rows[index], self.gold[index])
        assert source == "generated"
        batch = batch.to(self.device)
        with self.mixed():
            teacher_out = self.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
            batch = self.sampled.with_spans(batch)
            losses = self.model(batch, teacher_out)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), TRAIN.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sampled.settle()  # the trainer settles before the next micro batch
        self.generation_s += self.sampled.window["generation_s"] - before


def recipe_for(sizes: Sizes, new_tokens: int) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "bench",
            "output_dir": "unused",
            "teacher": {"path": "t"},
            "student": {"path": "s"},
            "data": {
                "train": "unused",
                "dev": None,
                "max_length": sizes.max_prompt_length + new_tokens,
                "max_prompt_length": sizes.max_prompt_length,
            },
            "train": {"max_steps": 1, "batch_size": sizes.micro_batch, "micro_batch_size": sizes.micro_batch},
            "off_policy": {"mode": "always", "max_new_tokens": new_tokens},
        }
    )


def build_variants(tokenizer_dir: Path, table, sizes: Sizes, count: int, new_tokens: int, parsers, device, autocast):
    tokenizer = load_tokenizer(tokenizer_dir)
    rows_of_model = len(tokenizer)
    teacher_model = tiny_llama(rows_of_model, sizes.teacher_layers, sizes.teacher_hidden, sizes.heads, 1).to(device)
    student_model = tiny_llama(rows_of_model, sizes.student_layers, sizes.student_hidden, sizes.heads, 2)
    pairs = resolve_layer_map("auto", sizes.student_layers, sizes.teacher_layers)
    examples = AnnotatedExamples(table, student_pad_id=tokenizer.pad_token_id, teacher_pad_id=tokenizer.pad_token_id)
    order = micro_batch_order(examples.student_lengths, sizes.micro_batch, seed=0, epoch=0)[:count]
    gold = [examples.batch(rows) for rows in order]
    recipe = recipe_for(sizes, new_tokens)

    def variant(name: str, spec: LossSpec, parser) -> Variant:
        objective = DistillationObjective(
            spec,
            pairs,
            student_hidden_size=sizes.student_hidden,
            teacher_hidden_size=sizes.teacher_hidden,
            same_tokenizer=True,
            vocab_size=rows_of_model,
        )
        model = DistillationModel(copy.deepcopy(student_model), objective).to(device)
        granularities = tuple(sorted({pair.granularity for pair in pairs})) if spec.trajectory_terms else ()
        sampled = OffPolicyBatches(
            recipe,
            table,
            model=model.student,
            tokenizer=tokenizer,
            pad_ids={"student": tokenizer.pad_token_id, "teacher": tokenizer.pad_token_id},
            with_teacher=True,
            granularities=granularities,
            parser=parser,
            total_steps=count,
        )
        sampled.params = replace(sampled.params, min_new_tokens=new_tokens)  # every variant generates the same
        teacher = FrozenTeacher(teacher_model, objective.teacher_layers, need_logits=True)
        return Variant(
            name, OnPolicyStep(sampled, order, gold, model, teacher, {}, lambda index: None, device, autocast)
        )

    base = LossSpec(base="srkl", dsa_weight=0.0, hra_weight=0.0)
    mta = LossSpec(base="srkl", dsa_weight=2.0, hra_weight=0.2)
    return [
        variant("base_generation", base, parsers["given"]),
        variant("mta_online", mta, parsers["online"]),
        variant("mta_sync", mta, parsers["sync"]),
        variant("mta_given", mta, parsers["given"]),
    ], [pair.model_dump() for pair in pairs]


def run_round(variant: Variant, count: int, device: torch.device) -> tuple[float, float]:
    """Mean wall seconds per step over micro batches 0..count-1: whole, and after generation."""
    step = variant.step
    step.generation_s = 0.0
    synchronize(device)
    started = time.perf_counter()
    for index in range(count):
        step(index)
    synchronize(device)
    whole = (time.perf_counter() - started) / count
    return whole, whole - step.generation_s / count


def measure(variants: list[Variant], count: int, rounds: int, device) -> None:
    def one_round(variant: Variant) -> None:
        whole, after = run_round(variant, count, device)
        variant.whole.append(whole)
        variant.after_generation.append(after)

    interleaved_rounds(
        variants,
        rounds,
        one_round,
        warm_up=lambda variant: run_round(variant, count, device),  # allocator, spaCy, the given spans
        describe=lambda v: f"{v.name} {v.whole[-1]:.3f}s ({v.after_generation[-1]:.3f}s after gen)",
    )


def summarise(variants: list[Variant]) -> dict:
    by_name = {v.name: v for v in variants}
    out: dict = {"clock": "wall"}
    for part in ("whole", "after_generation"):
        suffix = "" if part == "whole" else "_after_generation"
        series = {name: getattr(v, part) for name, v in by_name.items()}
        out[f"seconds_per_step_median{suffix}"] = {name: statistics.median(values) for name, values in series.items()}
        out[f"seconds_per_step_rounds{suffix}"] = series
        out[f"ratio_online_vs_given{suffix}"] = paired_ratio(series["mta_online"], series["mta_given"])
        out[f"ratio_sync_vs_given{suffix}"] = paired_ratio(series["mta_sync"], series["mta_given"])
        out[f"ratio_online_vs_base{suffix}"] = paired_ratio(series["mta_online"], series["base_generation"])
        out[f"ratio_sync_vs_online{suffix}"] = paired_ratio(series["mta_sync"], series["mta_online"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (at least 5)")
    parser.add_argument("--batches", type=int, default=6, help="steps (micro batches) per variant per round")
    parser.add_argument("--quick", action="store_true", help="5 rounds of 2 steps: under 3 minutes on 2 cores")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens every completion has")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model sizes (distill_step.py's)")
    parser.add_argument("--autocast", default=None, choices=["bf16"], help="mixed precision (GPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--work-dir", type=Path, default=None, help="tokenizer and artefact (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "onpolicy_step.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batches = 5, 2
    if args.rounds < 5:
        parser.error("--rounds must be at least 5 (the machine's noise is about ±15 %)")
    device = torch.device(args.device)
    sizes = PRESETS[args.preset]
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="mta-bench-") as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        rows, rows_source = write_rows(work, 2 * args.batches * sizes.micro_batch)
        tokenizer_dir = small_tokenizer(work, sizes.small_vocab)
        settings = AnnotateSettings(
            teacher=str(tokenizer_dir),
            student=str(tokenizer_dir),
            max_length=sizes.max_length,
            max_prompt_length=sizes.max_prompt_length,
            on_error="skip",
            workers=1,
        )
        table = read_annotations(annotate_file(rows, work / "annotations", settings)).table
        # Started before any model exists: the worker is forked from a small process.
        with SpanParser(settings, workers=SPAN_WORKERS) as online, SpanParser(settings, workers=0) as sync:
            parsers = {"online": online, "sync": sync, "given": GivenSpans(sync)}
            variants, layer_map = build_variants(
                tokenizer_dir, table, sizes, args.batches, args.new_tokens, parsers, device, autocast
            )
            measure(variants, args.batches, args.rounds, device)
            misses = parsers["given"].misses
        results = summarise(variants)
    # Each micro batch parsed once for the given variants (their first, warm-up round): more
    # would mean the variants did not generate the same texts.
    if misses != args.batches:
        raise SystemExit(f"the given spans were parsed {misses} times for {args.batches} batches: generations differ")
    for key in ("ratio_online_vs_given", "ratio_sync_vs_given", "ratio_online_vs_base"):
        print(f"  {key}: {results[key]:.3f} whole, {results[key + '_after_generation']:.3f} after generation")

    payload = {
        "benchmark": "bench/onpolicy_step.py",
        "created": created(),
        "machine": describe_machine(device, span_workers=SPAN_WORKERS),
        "setup": {
            "rows": portable(rows_source),
            "rounds": args.rounds,
            "steps_per_round": args.batches,
            "new_tokens_per_completion": args.new_tokens,
            "step": "student generates (keyed sampling, T 1, stop tokens held back), teacher forward, student "
            "forward, losses, backward, clip 1.0, AdamW at lr 0 (no DeepSpeed)",
            "preset": args.preset,
            "autocast": args.autocast,
            "base_loss": "srkl (skew 0.1)",
            "mta_weights": {"dsa": 2.0, "hra": 0.2},
            "layer_map": layer_map,
            **asdict(sizes),
        },
        "targets": {f"{key}_at_most": value for key, value in TARGETS.items()},
        **results,
        "target_met": {key: results[key] <= value for key, value in TARGETS.items()},
    }
    atomic_write_json(args.output, payload)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
