"""Benchmark: training from `mta teacher`'s cache against the online teacher, on the demo's pair.

The pair is `make demo`'s: SmolLM2-135M-Instruct (30 layers) teaching its 10-layer prune, on
Dolly train rows annotated with the demo recipe (recipes/smollm2-demo.yaml: skew reverse KL +
2·DSA + 0.2·HRA, 192 tokens, micro batch 8).

1. **Accuracy of the top k** (k in 8 ... 4096; the vocabulary has 49,152 tokens): on the
   first micro batches, the base loss and its gradient with respect to the student's logits from
   the teacher rebuilt by the tail rule (its log-probabilities rounded to fp16 as
   `teacher_cache.storage: compact` stores them) against the online teacher's full logits:
   relative error of the loss, cosine of the gradients; and the bytes per row of each cache. The
   recipe's base (skew reverse KL) and, for contrast, forward KL (``top_k_fkl``).
2. **Step time**: two runs built as `mta distill` builds them (``build_run``), one online and one
   with ``teacher_cache.dir`` (the default k, compact; built here by ``run_teacher_stage``), trained step
   by step interleaved (the order rotates every round), each step a whole `Trainer.step`: the
   cache's reads are inside it. Medians of the per-round ratios; ``ratio_cached_vs_online_step``
   is the fixed-data one (``generation.mode: off``, the DistiLLM-2 rows' case, the teacher never
   loaded). With DistiLLM's adaptive sampling a share g of the micro batches is generated and
   runs the teacher online either way: the JSON derives the adaptive ratio at g from the measured
   gold step times and a measured ``generation.mode: always`` step (every micro batch generated),
   ``(g·T_gen + (1−g)·T_cached) / (g·T_gen + (1−g)·T_online)``, at the generated share
   ``--generated-share`` (default 0.5: DistiLLM's threshold rises towards 1 over training and its
   decreasing schedule spends about half of it on fresh generations).

    python bench/teacher_cache.py            # CPU, ~10 min -> bench/results/teacher_cache.json
    python bench/teacher_cache.py --quick    # fewer rows and rounds

Both runs train in the same precision (``--precision``, default the demo's ``auto``) on one
torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import torch
from transformers import AutoConfig

from interleaving import interleaved_rounds, paired_ratio
from machine import created, describe_machine
from mta.data.annotate import AnnotateSettings, annotate_file
from mta.data.annotations import read_annotations
from mta.demo.pipeline import DEMO_RECIPE, copy_dolly_rows
from mta.evaluation.datasets import default_data_dir
from mta.files import atomic_write_json
from mta.losses.kd import build_base_loss
from mta.losses.teacher_topk import teacher_logits_from_top_k, top_k_log_probs
from mta.models.pruning import init_student
from mta.models.smollm2 import convert_smollm2
from mta.reporting import SilentReporter
from mta.training.config.loading import load_recipe
from mta.training.config.schema import TeacherCacheSpec
from mta.training.teacher_cache.build import run_teacher_stage
from mta.training.teacher_cache.content import estimate_bytes, teacher_reads
from mta.training.trainer import Trainer, build_run

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "teacher_cache.json"
KS = (8, 32, 64, 256, 1024, 4096)
DEFAULT_K = TeacherCacheSpec().top_k  # the timed cache's k


def accuracy(recipe, run, batches: int, base: str | None = None) -> dict:
    """Per k: the base loss's (``base``, default the recipe's) relative error and the gradients'
    cosine against the online teacher."""
    loss = build_base_loss(
        base or recipe.loss.base,
        temperature=recipe.loss.temperature,
        skew_alpha=recipe.loss.skew_alpha,
        vocab_size=len(run.tokenizer),
    )
    vocab = len(run.tokenizer)
    found: dict[int, dict[str, list[float]]] = {k: {"rel": [], "cos": []} for k in KS}
    trainer = Trainer(run, SilentReporter())
    student = run.engine.module.student
    for step in range(batches):
        for batch in trainer.micro_batches(step):
            batch = batch.to(run.device)
            with torch.no_grad():
                teacher = run.teacher(batch.teacher.input_ids, batch.teacher.attention_mask).logits.float()
                logits = student(input_ids=batch.student.input_ids, attention_mask=batch.student.attention_mask).logits
            labels = batch.student.labels[:, 1:]
            online_logits = logits[:, :-1].float().detach().requires_grad_(True)
            reference = loss(online_logits, teacher[:, :-1], labels)
            (reference_grad,) = torch.autograd.grad(reference, online_logits)
            row, position = (labels != -100).nonzero(as_tuple=True)
            for k in KS:
                ids, log_probs, tail = top_k_log_probs(
                    teacher[:, :-1][row, position], k, temperature=recipe.loss.temperature, vocab_size=vocab
                )
                rebuilt = torch.zeros_like(teacher[:, :-1, :vocab])
                rebuilt[row, position] = teacher_logits_from_top_k(
                    ids, log_probs.half().float(), tail, vocab, recipe.loss.temperature
                )
                cached_logits = logits[:, :-1].float().detach().requires_grad_(True)
                value = loss(cached_logits, rebuilt, labels)
                (grad,) = torch.autograd.grad(value, cached_logits)
                found[k]["rel"].append(abs(value.item() - reference.item()) / abs(reference.item()))
                found[k]["cos"].append(
                    torch.nn.functional.cosine_similarity(grad.flatten(), reference_grad.flatten(), dim=0).item()
                )
    return {
        k: {"loss_rel_error": statistics.fmean(v["rel"]), "grad_cos": statistics.fmean(v["cos"])}
        for k, v in found.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 rows, 3 rounds")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--generated-share", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows, rounds = (32, 3) if args.quick else (96, args.rounds)
    work = Path(tempfile.mkdtemp(prefix="mta-bench-teacher-cache-"))
    teacher = convert_smollm2()
    student = work / "student-init"
    init_student(teacher, student, num_layers=10, force=True)
    copy_dolly_rows(
        default_data_dir() / "dolly" / "train.jsonl", work / "train.jsonl", rows, sample=True, demo="the bench"
    )
    base = [f"teacher.path={teacher}", f"student.path={student}", f"train.precision={args.precision}", "data.dev=null"]
    base += ["train.num_sample_generations=0", "train.save_interval=100000", "train.log_interval=100000"]
    recipe = load_recipe(DEMO_RECIPE, base + [f"data.train={work / 'train.jsonl'}", f"output_dir={work / 'annotate'}"])
    annotate_file(work / "train.jsonl", work / "annotations", AnnotateSettings.from_recipe(recipe, workers=1))
    base += [f"data.train={work / 'annotations'}", "train.max_steps=1000"]
    cache = work / "teacher"
    started = time.perf_counter()
    run_teacher_stage(load_recipe(DEMO_RECIPE, base + [f"output_dir={work / 'stage'}", f"teacher_cache.dir={cache}"]))
    stage_seconds = time.perf_counter() - started

    def built(name: str, *extra: str):
        recipe = load_recipe(DEMO_RECIPE, base + [f"output_dir={work / name}", *extra])
        return recipe, build_run(recipe, SilentReporter())

    recipe, online = built("online")
    precision = online.precision.name
    print(f"accuracy of the top k against the online teacher ({precision})", flush=True)
    topk = accuracy(recipe, online, 2 if args.quick else 4)
    topk_fkl = accuracy(recipe, online, 2 if args.quick else 4, base="fkl")  # how much the tail matters
    _, cached = built("cached", f"teacher_cache.dir={cache}")
    assert cached.teacher is None, "generation off: the cached run loads no teacher"
    variants = {"online": Trainer(online, SilentReporter()), "cached": Trainer(cached, SilentReporter())}
    times: dict[str, list[float]] = {name: [] for name in variants}
    steps = dict.fromkeys(variants, 0)

    def measure(name: str, record: bool = True) -> None:
        started = time.perf_counter()
        variants[name].step(steps[name])
        if record:
            times[name].append(time.perf_counter() - started)
        steps[name] += 1

    print("step time, generation off: online vs cached", flush=True)
    interleaved_rounds(
        list(variants),
        rounds,
        measure,
        warm_up=lambda name: measure(name, record=False),
        describe=lambda name: f"{name} {times[name][-1]:.2f} s",
    )
    online.close()
    cached.close()
    _, always = built("always", "generation.mode=always", f"generation.max_new_tokens={64}")
    generated = Trainer(always, SilentReporter())
    generated.step(0)
    generated_times = []
    for step in range(1, 1 + max(2, rounds // 2)):
        started = time.perf_counter()
        generated.step(step)
        generated_times.append(time.perf_counter() - started)
    always.close()

    t_online, t_cached = statistics.median(times["online"]), statistics.median(times["cached"])
    t_gen, share = statistics.median(generated_times), args.generated_share
    config = AutoConfig.from_pretrained(teacher)
    reads = teacher_reads(recipe, 10, config.num_hidden_layers)
    annotations = read_annotations(work / "annotations").table
    tokens = int(pc.sum(pc.list_value_length(annotations.column("teacher_input_ids"))).as_py())
    responses = tokens - int(pc.sum(annotations.column("teacher_prompt_len")).as_py())
    sizes = {
        k: estimate_bytes(
            reads,
            top_k=k,
            storage="compact",
            hidden_size=config.hidden_size,
            tokens=tokens,
            responses=responses,
            rows=annotations.num_rows,
        )
        for k in KS
    }
    stored = sum(path.stat().st_size for path in (cache / "train").glob("part-*.parquet"))
    result = {
        "created": created(),
        "machine": describe_machine(online.device, precision=precision),
        "pair": "SmolLM2-135M-Instruct (30 layers) -> its 10-layer prune, recipes/smollm2-demo.yaml",
        "rows": annotations.num_rows,
        "rounds": rounds,
        "top_k": {
            str(k): {
                **topk[k],
                "bytes_per_row": sizes[k].per_row,
                "logits_bytes_per_row": sizes[k].logits / sizes[k].rows,
            }
            for k in KS
        },
        "top_k_fkl": {str(k): topk_fkl[k] for k in KS},
        "loss_rel_error_k64": topk[64]["loss_rel_error"],
        "grad_cos_k64": topk[64]["grad_cos"],
        "bytes_per_row_k64": sizes[64].per_row,
        "default_top_k": DEFAULT_K,
        "loss_rel_error_default_k": topk[DEFAULT_K]["loss_rel_error"],
        "grad_cos_default_k": topk[DEFAULT_K]["grad_cos"],
        "bytes_per_row_default_k": sizes[DEFAULT_K].per_row,
        "bytes_per_row_on_disk": stored / annotations.num_rows,
        "step_seconds": {"online": times["online"], "cached": times["cached"], "generated": generated_times},
        "ratio_cached_vs_online_step": paired_ratio(times["cached"], times["online"]),
        "generated_share": share,
        "ratio_cached_vs_online_step_adaptive": (share * t_gen + (1 - share) * t_cached)
        / (share * t_gen + (1 - share) * t_online),
        "teacher_stage_seconds": stage_seconds,
        "teacher_stage_rows_per_s": annotations.num_rows / stage_seconds,
    }
    atomic_write_json(args.out, result)
    print(
        f"cached / online step: {result['ratio_cached_vs_online_step']:.2f} (generation off), "
        f"{result['ratio_cached_vs_online_step_adaptive']:.2f} (adaptive at {share:.0%} generated); "
        f"k={DEFAULT_K}: loss rel. error {result['loss_rel_error_default_k']:.2e}, gradient cosine "
        f"{result['grad_cos_default_k']:.4f}, {result['bytes_per_row_default_k'] / 1e6:.2f} MB a row -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
