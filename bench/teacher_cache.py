"""Benchmark: training from `mta teacher`'s cache against the online teacher, on the demo's pair.

The pair is `make demo`'s: SmolLM2-135M-Instruct (30 layers) teaching its 10-layer prune, on
Dolly train rows annotated with the demo recipe (recipes/smollm2-demo.yaml: skew reverse KL +
2·DSA + 0.2·HRA, 192 tokens, micro batch 8).

1. **Accuracy of the stored logits**, per base loss (fkl, rkl, skl, srkl, jsd, tvd, distillm2 with
   the micro batch's rows alternately chosen and rejected) and per storage: top-k at
   ``TOP_KS`` (the tail rule) and sampled (``teacher_cache.logits: sampled``) at N in
   ``SAMPLES`` draws beyond a head of ``HEADS`` tokens, each over ``--draws`` seeds; the teacher's
   log-probabilities rounded to fp16 as ``storage: compact`` stores them. Against the online
   teacher's full logits on the first micro batches: the loss's relative error (per draw, and the
   bias: the mean over draws), the gradient's cosine with respect to the student's logits (fp64),
   their spread over draws, and the logits' bytes per response position on disk (ids packed in
   16 bits; a sampled position's bytes counted from its distinct draws). The recipe's base at
   ``KS`` is kept as before (``top_k``, ``top_k_fkl``).
2. **Accuracy of the stored states** (fp16, bf16, int8_token, int8_channel): DSA's and HRA's loss
   values with the teacher's hidden states rounded as stored, against the unrounded ones, and the
   states' bytes per token; on disk, the built cache's against a cache of fp16 states, as written
   (zstd) and uncompressed (as ``teacher_cache_version`` 3 first wrote it).
3. **Step time and a short training comparison**: two runs built as `mta distill` builds them
   (``build_run``), one online and one with ``teacher_cache.dir`` (the defaults, or
   ``--cache-logits/--cache-top-k/--cache-samples/--cache-states``; built here by
   ``run_teacher_stage``), trained step by step interleaved (the order rotates every round), each
   step a whole `Trainer.step`: the cache's reads are inside it. Medians of the per-round ratios;
   ``ratio_cached_vs_online_step`` is the fixed-data one (``off_policy.mode: off``, the DistiLLM-2
   rows' case, the teacher never loaded). After the same steps both students' dev loss (every
   term, the online teacher's) on held-out Dolly dev rows, for ``--seeds`` training seeds (data
   order, the projectors' init; the timed pair is the recipe's seed, the others 1, 2, ...): the
   cached − online difference against the online runs' spread over seeds. With DistiLLM's adaptive
   sampling a share g of the micro batches is generated and runs the teacher online either way: the JSON
   derives the adaptive ratio at g from the measured gold step times and a measured
   ``off_policy.mode: always`` step (every micro batch generated),
   ``(g·T_gen + (1−g)·T_cached) / (g·T_gen + (1−g)·T_online)``, at the generated share
   ``--generated-share`` (default 0.5).

4. **A storage not built, `--head-states`** (its own JSON): the teacher's logits rebuilt from its
   final hidden state (after the final norm), stored as fp16 or ``int8_token``, through its own
   head kept once, per base loss against the online teacher's logits (loss error, gradient cosine
   in fp64) on the same micro batches as 1, with the state's bytes a response position.

    python bench/teacher_cache.py            # CPU, ~40 min -> bench/results/teacher_cache.json
    python bench/teacher_cache.py --head-states   # part 4 alone, ~5 min -> teacher_cache_head_states.json
    python bench/teacher_cache.py --quick    # a tiny setting: checks that it runs (no figures to keep)

Both runs read whole logits (``loss.fused_head=false``: the accuracy part compares the online
teacher's logits) and train in the same precision (``--precision``, default the demo's ``auto``) on one
torch thread. Needs ``MTA_DATA_DIR`` with dolly/train.jsonl and dolly/dev.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from transformers import AutoConfig

from interleaving import interleaved_rounds, paired_ratio
from machine import created, describe_machine
from mta.data.annotate import AnnotateSettings, annotate_file
from mta.data.annotations import read_annotations
from mta.demo.pipeline import DEMO_RECIPE, copy_dolly_rows
from mta.evaluation.datasets import default_data_dir
from mta.files import atomic_write_json
from mta.generation.sampling import keyed_uniforms
from mta.losses.fused_head import OutputHead
from mta.losses.kd import build_base_loss
from mta.losses.teacher_sampled import SampledTeacher, draw_tail_samples
from mta.losses.teacher_topk import LOG_FLOOR, teacher_logits_from_top_k, top_k_log_probs
from mta.models.pruning import init_student
from mta.models.smollm2 import convert_smollm2
from mta.reporting import SilentReporter
from mta.training.config.loading import load_recipe
from mta.training.config.schema import TeacherCacheSpec
from mta.training.teacher import TeacherOutput
from mta.training.teacher_cache.compact import SCALE_BYTES, dequantize_states, id_bits, quantize_states, state_bytes
from mta.training.teacher_cache.content import estimate_bytes, stored_per_token, teacher_reads
from mta.training.teacher_cache.read import read_cache_manifest
from mta.training.teacher_cache.teacher import run_teacher_stage, stored_bytes
from mta.training.trainer import Trainer, build_run

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "teacher_cache.json"
HEAD_OUT = REPO / "bench" / "results" / "teacher_cache_head_states.json"
PAIR = "SmolLM2-135M-Instruct (30 layers) -> its 10-layer prune, recipes/smollm2-demo.yaml"
KS = (8, 32, 64, 256, 1024, 4096)
DEFAULT_K = TeacherCacheSpec().head  # the top-k default
BASES = ("fkl", "rkl", "skl", "srkl", "jsd", "tvd", "distillm2")
TOP_KS = (64, 256, 1024)
SAMPLES = (8, 16, 32, 64)
HEADS = (0, 32)
STATES = ("fp16", "bf16", "int8_token", "int8_channel")
HEAD_STATES = ("fp16", "int8_token")


def cosine64(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two gradients, in fp64 (fp32 rounding reports cosines above 1)."""
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


def accuracy(recipe, run, batches: int, base: str | None = None) -> dict:
    """Per k: the base loss's (``base``, default the recipe's) relative error and the gradients'
    cosine (fp64) against the online teacher, the tail rule's teacher rounded to fp16."""
    loss = build_base_loss(
        base or recipe.loss.base,
        temperature=recipe.loss.temperature,
        skew_alpha=recipe.loss.skew_alpha,
        vocab_size=len(run.tokenizer),
    )
    vocab = len(run.tokenizer)
    found: dict[int, dict[str, list[float]]] = {k: {"rel": [], "cos": []} for k in KS}
    for teacher, logits, labels, _ in first_batches(run, batches):
        reference, reference_grad = value_and_grad(loss, logits, teacher, labels)
        row, position = (labels != -100).nonzero(as_tuple=True)
        for k in KS:
            ids, log_probs, tail = top_k_log_probs(
                teacher[row, position], k, temperature=recipe.loss.temperature, vocab_size=vocab
            )
            rebuilt = torch.zeros_like(teacher[..., :vocab])
            rebuilt[row, position] = teacher_logits_from_top_k(
                ids, log_probs.half().float(), tail, vocab, recipe.loss.temperature
            )
            value, grad = value_and_grad(loss, logits, rebuilt, labels)
            found[k]["rel"].append(abs(value - reference) / abs(reference))
            found[k]["cos"].append(cosine64(grad, reference_grad))
    return {
        k: {"loss_rel_error": statistics.fmean(v["rel"]), "grad_cos": statistics.fmean(v["cos"])}
        for k, v in found.items()
    }


def first_batches(run, batches: int, final_states: bool = False):
    """``(teacher logits, student logits, labels, final)`` of the first micro batches, shifted
    (position t predicts t + 1), fp32, no gradient; ``final``: with ``final_states`` the teacher's
    last hidden states (after the final norm, the model's dtype), else None."""
    trainer = Trainer(run, SilentReporter())
    student = run.engine.module.student
    for step in range(batches):
        for batch in trainer.micro_batches(step):
            batch = batch.to(run.device)
            ids, mask = batch.teacher.input_ids, batch.teacher.attention_mask
            with torch.no_grad():
                if final_states:
                    out = run.teacher.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                    teacher, final = out.logits.float(), out.hidden_states[-1][:, :-1]
                else:
                    teacher, final = run.teacher(ids, mask).logits.float(), None
                logits = student(input_ids=batch.student.input_ids, attention_mask=batch.student.attention_mask).logits
            yield teacher[:, :-1], logits[:, :-1].float(), batch.student.labels[:, 1:], final


def value_and_grad(loss, logits: torch.Tensor, teacher, labels: torch.Tensor, **pairs) -> tuple[float, torch.Tensor]:
    leaf = logits.detach().clone().requires_grad_(True)
    value = loss(leaf, teacher, labels, **pairs)
    (grad,) = torch.autograd.grad(value, leaf)
    return value.item(), grad


def rounded(samples, storage_dtype=torch.float16):
    """The draws as ``storage: compact`` stores them: log-probabilities rounded to fp16."""
    return dataclasses.replace(
        samples,
        head_log_probs=samples.head_log_probs.to(storage_dtype).float(),
        log_probs=samples.log_probs.to(storage_dtype).float(),
    )


def laid_out(entries: SampledTeacher, shape: tuple[int, int], row, position) -> SampledTeacher:
    """``[n, m]`` entries at the batch's ``[batch, seq, m]`` positions (weight 0 elsewhere)."""
    m = entries.ids.shape[1]
    ids = torch.zeros(*shape, m, dtype=torch.long)
    log_probs = torch.full((*shape, m), LOG_FLOOR)
    weights = torch.zeros(*shape, m)
    ids[row, position], log_probs[row, position], weights[row, position] = (
        entries.ids,
        entries.log_probs,
        entries.weights,
    )
    rest, log_mean = torch.full((2, *shape), LOG_FLOOR)
    rest[row, position], log_mean[row, position] = entries.rest, entries.rest_log_mean
    return SampledTeacher(ids, log_probs, weights, entries.vocab_size, rest, log_mean)


def logits_accuracy(recipe, run, batches: int, draws: int, samples=SAMPLES, heads=HEADS, top_ks=TOP_KS) -> dict:
    """Per base loss and storage: loss relative error (per draw; and the bias of the mean over
    draws), gradient cosine (fp64), their spread over draws, and logits bytes per response
    position (module docstring, 1)."""
    vocab, tau = len(run.tokenizer), recipe.loss.temperature
    bits = id_bits(vocab)
    losses = {
        base: build_base_loss(
            base, temperature=tau, skew_alpha=recipe.loss.skew_alpha, jsd_beta=recipe.loss.jsd_beta, vocab_size=vocab
        )
        for base in BASES
    }
    storages = [f"top_k={k}" for k in top_ks] + [f"sampled N={n} head={h}" for h in heads for n in samples]
    found = {
        base: {name: {"rel": [], "bias": [], "cos": [], "cos_spread": [], "rel_spread": []} for name in storages}
        for base in BASES
    }
    position_bytes: dict[str, list[float]] = {name: [] for name in storages}
    for teacher, logits, labels, _ in first_batches(run, batches):
        row, position = (labels != -100).nonzero(as_tuple=True)
        chosen = torch.arange(labels.shape[0]) % 2 == 0
        at = teacher[row, position]
        variants: dict[str, list] = {}
        for k in top_ks:
            ids, log_probs, tail = top_k_log_probs(at, k, temperature=tau, vocab_size=vocab)
            variants[f"top_k={k}"] = [(ids, log_probs.half().float(), tail)]  # rebuilt when read: memory
            position_bytes[f"top_k={k}"].append(k * (bits / 8 + 2) + 8)
        for h in heads:
            for n in samples:
                name = f"sampled N={n} head={h}"
                variants[name] = []
                for seed in range(draws):
                    uniforms = keyed_uniforms(seed, "bench", [0], [row.numel()], n)
                    drawn = rounded(draw_tail_samples(at, uniforms, top_k=h, temperature=tau, vocab_size=vocab))
                    entries = SampledTeacher.from_samples(drawn, vocab)
                    variants[name].append(laid_out(entries, tuple(labels.shape), row, position))
                    distinct = drawn.distinct.float().mean().item()
                    position_bytes[name].append(h * (bits / 8 + 2) + 8 + 1 + distinct * (bits / 8 + 1 + 2))
        for base, loss in losses.items():
            pairs = {"chosen": chosen} if base == "distillm2" else {}
            reference, reference_grad = value_and_grad(loss, logits, teacher[..., :vocab], labels, **pairs)
            for name, teachers in variants.items():
                values, cosines = [], []
                for cached in teachers:
                    if isinstance(cached, tuple):  # top-k: the tail rule's logits
                        rebuilt = torch.zeros_like(teacher[..., :vocab])
                        rebuilt[row, position] = teacher_logits_from_top_k(*cached, vocab, tau)
                        cached = rebuilt
                    value, grad = value_and_grad(loss, logits, cached, labels, **pairs)
                    del cached
                    values.append(value)
                    cosines.append(cosine64(grad, reference_grad))
                relative = [abs(v - reference) / abs(reference) for v in values]
                record = found[base][name]
                record["rel"].append(statistics.fmean(relative))
                record["bias"].append((statistics.fmean(values) - reference) / abs(reference))
                record["cos"].append(statistics.fmean(cosines))
                record["cos_spread"].append(statistics.pstdev(cosines))
                record["rel_spread"].append(statistics.pstdev([(v - reference) / abs(reference) for v in values]))
        print(f"  logits: micro batch of {labels.shape[0]} rows, {row.numel()} response positions done", flush=True)
    return {
        base: {
            name: {
                "loss_rel_error": statistics.fmean(r["rel"]),
                "loss_rel_bias_over_draws": statistics.fmean(r["bias"]),
                "loss_rel_spread_over_draws": statistics.fmean(r["rel_spread"]),
                "grad_cos": statistics.fmean(r["cos"]),
                "grad_cos_spread_over_draws": statistics.fmean(r["cos_spread"]),
                "logits_bytes_per_response_position": statistics.fmean(position_bytes[name]),
            }
            for name, r in per_storage.items()
        }
        for base, per_storage in found.items()
    }


def head_states_accuracy(recipe, run, batches: int) -> dict:
    """Per base loss, the teacher's logits rebuilt from its final hidden state (after the final
    norm: Hugging Face's last ``hidden_states`` entry) stored as fp16 or ``int8_token``, through the
    teacher's own head (:class:`OutputHead`, kept once): the loss's relative error and the
    gradient's cosine (fp64) against the online teacher's logits, and the state's bytes a response
    position (module docstring, 4). A storage not built: this measures whether it would pay."""
    vocab, tau = len(run.tokenizer), recipe.loss.temperature
    model = run.teacher.model
    head = OutputHead.of(model)
    losses = {
        base: build_base_loss(
            base, temperature=tau, skew_alpha=recipe.loss.skew_alpha, jsd_beta=recipe.loss.jsd_beta, vocab_size=vocab
        )
        for base in BASES
    }
    found = {base: {mode: {"rel": [], "cos": []} for mode in HEAD_STATES} for base in BASES}
    for teacher, logits, labels, final in first_batches(run, batches, final_states=True):
        teacher = teacher[..., :vocab]
        chosen = torch.arange(labels.shape[0]) % 2 == 0
        row, position = (labels != -100).nonzero(as_tuple=True)
        at = final[row, position].float()  # [n, d]
        stored = {
            "fp16": at.half().float(),
            "int8_token": dequantize_states(*quantize_states(at[None], "int8_token"), "int8_token")[0],
        }
        rebuilt = {}
        for mode, states in stored.items():
            rebuilt[mode] = teacher.clone()
            rebuilt[mode][row, position] = head.logits(states, vocab).float()
        for base, loss in losses.items():
            pairs = {"chosen": chosen} if base == "distillm2" else {}
            reference, reference_grad = value_and_grad(loss, logits, teacher, labels, **pairs)
            for mode, cached in rebuilt.items():
                value, grad = value_and_grad(loss, logits, cached, labels, **pairs)
                found[base][mode]["rel"].append(abs(value - reference) / abs(reference))
                found[base][mode]["cos"].append(cosine64(grad, reference_grad))
        print(f"  head states: micro batch of {labels.shape[0]} rows done", flush=True)
    hidden = int(model.config.hidden_size)
    position_bytes = {"fp16": 2 * hidden, "int8_token": hidden + SCALE_BYTES}
    return {
        base: {
            mode: {
                "loss_rel_error": statistics.fmean(r["rel"]),
                "grad_cos": statistics.fmean(r["cos"]),
                "bytes_per_response_position": position_bytes[mode],
            }
            for mode, r in per_mode.items()
        }
        for base, per_mode in found.items()
    }


def quantized(hidden: dict[int, torch.Tensor], mask: torch.Tensor, mode: str) -> dict[int, torch.Tensor]:
    """The teacher's states as ``mode`` stores them (each row over its real tokens)."""
    if mode in ("fp16", "bf16"):
        dtype = torch.float16 if mode == "fp16" else torch.bfloat16
        return {layer: states.to(dtype).float() for layer, states in hidden.items()}
    layers = sorted(hidden)
    stacked = torch.stack([hidden[layer].float() for layer in layers])  # [layers, batch, seq, d]
    out = torch.zeros_like(stacked)
    for r in range(stacked.shape[1]):
        n = int(mask[r].sum())
        values, scales = quantize_states(stacked[:, r, :n], mode)
        out[:, r, :n] = dequantize_states(values, scales, mode)
    return {layer: out[i] for i, layer in enumerate(layers)}


def states_accuracy(run, batches: int, hidden_size: int) -> dict:
    """Per states storage: DSA's and HRA's relative error against the unrounded states, and the
    states' bytes per token (module docstring, 2)."""
    trainer = Trainer(run, SilentReporter())
    found: dict[str, dict[str, list[float]]] = {mode: {"dsa": [], "hra": []} for mode in STATES}
    tokens = rows = layers = 0
    for step in range(batches):
        for batch in trainer.micro_batches(step):
            batch = trainer.with_spans(batch.to(run.device))
            with torch.no_grad():
                online = run.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
                layers = len(online.hidden_states)
                exact = run.engine.module(
                    batch, TeacherOutput({k: v.float() for k, v in online.hidden_states.items()}, online.logits)
                )
                for mode in STATES:
                    hidden = quantized(online.hidden_states, batch.teacher.attention_mask, mode)
                    got = run.engine.module(batch, TeacherOutput(hidden, online.logits))
                    for term in ("dsa", "hra"):
                        if term in exact:
                            found[mode][term].append(
                                abs(got[term].item() - exact[term].item()) / abs(exact[term].item())
                            )
            tokens += int(batch.teacher.attention_mask.sum())
            rows += len(batch.row_ids)
    result = {}
    for mode, terms in found.items():
        storage_mode = "storage" if mode in ("fp16", "bf16") else mode
        bytes_ = state_bytes(
            storage_mode, value_bytes=2, layers=layers, tokens=tokens, hidden_size=hidden_size, rows=rows
        )
        result[mode] = {
            **{f"{term}_rel_error": statistics.fmean(v) for term, v in terms.items() if v},
            **{f"{term}_rel_error_max": max(v) for term, v in terms.items() if v},
            "states_bytes_per_token": bytes_ / max(tokens, 1),
        }
    return result


def dev_loss(run, online_run, batches) -> dict[str, float]:
    """Every loss term of ``run``'s student on ``batches`` with the online teacher, mean over rows."""
    sums: dict[str, float] = {}
    count = 0
    run.engine.eval()
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(run.device)
            out = online_run.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
            with run.precision.context():
                for name, value in run.engine(batch, out).items():
                    sums[name] = sums.get(name, 0.0) + value.item() * len(batch.row_ids)
            count += len(batch.row_ids)
    run.engine.train()
    return {name: value / max(count, 1) for name, value in sums.items()}


def states_bytes_on_disk(cache: Path, states: str, build, work: Path) -> dict[str, float]:
    """The train cache's states bytes per teacher token on disk: as built (``states``), and, to
    compare, a cache of the same rows with fp16 states (``build``: the stage with extra keys),
    as written (zstd) and as ``teacher_cache_version`` 3 wrote it before (uncompressed)."""

    fp16 = cache if states == "storage" else work / "teacher-fp16-states"
    if states != "storage":
        build(f"teacher_cache.dir={fp16}", "teacher_cache.states=storage")
    manifest = read_cache_manifest(fp16 / "train", "bench: ")
    found = {states: stored_per_token(read_cache_manifest(cache / "train", "bench: "))["states"]}
    if states != "storage":
        found["storage"] = stored_per_token(manifest)["states"]
    part = next((fp16 / "train").glob("part-*.parquet"))
    uncompressed = work / "uncompressed.parquet"
    pq.write_table(pq.read_table(part), uncompressed, row_group_size=1, compression="none")
    found["storage, uncompressed (before)"] = stored_bytes(uncompressed)["states"] / manifest["tokens"]["teacher"]
    return found


def compared_training(by_seed: dict[int, tuple[dict, dict]], steps: int, dev_rows: int) -> dict:
    """Per seed the dev losses of the online and the cached run, the cached − online difference
    of the total (mean over seeds), and the online total's spread over seeds (the run's noise)."""
    online = [pair[0]["total"] for pair in by_seed.values()]
    differences = [pair[1]["total"] - pair[0]["total"] for pair in by_seed.values()]
    return {
        "steps": steps,
        "dev_rows": dev_rows,
        "seeds": list(by_seed),
        "dev_loss_online": [pair[0] for pair in by_seed.values()],
        "dev_loss_cached": [pair[1] for pair in by_seed.values()],
        "total_difference_per_seed": differences,
        "total_difference_mean": statistics.fmean(differences),
        "total_difference_stdev": statistics.stdev(differences) if len(differences) > 1 else 0.0,
        "online_total_stdev": statistics.stdev(online) if len(online) > 1 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny setting that checks the bench runs")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--draws", type=int, default=8, help="seeds per sampled storage")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--generated-share", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, default=4, help="training seeds of the dev-loss comparison")
    spec = TeacherCacheSpec()
    parser.add_argument("--cache-logits", default=spec.logits, choices=("top_k", "sampled"))
    parser.add_argument("--cache-top-k", type=int, default=None)
    parser.add_argument("--cache-samples", type=int, default=spec.samples)
    parser.add_argument("--cache-states", default=spec.states)
    parser.add_argument(
        "--out", type=Path, default=None, help=f"default {OUT.name} ({HEAD_OUT.name} with --head-states)"
    )
    parser.add_argument(
        "--head-states", action="store_true", help="only part 4, the logits from the final hidden state and the head"
    )
    args = parser.parse_args(argv)
    args.out = args.out or (HEAD_OUT if args.head_states else OUT)
    torch.set_num_threads(1)
    rows, dev_rows, rounds, draws = (12, 8, 2, 2) if args.quick else (96, 32, args.rounds, args.draws)
    seeds = 2 if args.quick else args.seeds
    batches = 1 if args.quick else 4
    work = Path(tempfile.mkdtemp(prefix="mta-bench-teacher-cache-"))
    teacher = convert_smollm2()
    student = work / "student-init"
    init_student(teacher, student, num_layers=10, force=True)
    data = default_data_dir() / "dolly"
    copy_dolly_rows(data / "train.jsonl", work / "train.jsonl", rows, sample=True, demo="the bench")
    copy_dolly_rows(data / "dev.jsonl", work / "dev.jsonl", dev_rows, sample=False, demo="the bench")
    base = [f"teacher.path={teacher}", f"student.path={student}", f"train.precision={args.precision}"]
    base += ["train.num_sample_generations=0", "train.save_interval=100000", "train.log_interval=100000"]
    # Whole logits (not the fused head): the accuracy part compares the teacher's logits themselves.
    base += ["train.eval_interval=100000", "loss.fused_head=false"]
    recipe = load_recipe(DEMO_RECIPE, base + [f"data.train={work / 'train.jsonl'}", f"output_dir={work / 'annotate'}"])
    for split in ("train", "dev"):
        annotate_file(
            work / f"{split}.jsonl", work / f"annotations-{split}", AnnotateSettings.from_recipe(recipe, workers=1)
        )
    base += [f"data.train={work / 'annotations-train'}", f"data.dev={work / 'annotations-dev'}", "train.max_steps=1000"]
    cache_keys = [f"teacher_cache.logits={args.cache_logits}", f"teacher_cache.samples={args.cache_samples}"]
    cache_keys += [f"teacher_cache.states={args.cache_states}"]
    cache_keys += [f"teacher_cache.top_k={args.cache_top_k}"] if args.cache_top_k is not None else []
    cache = work / "teacher"
    if not args.head_states:
        started = time.perf_counter()
        run_teacher_stage(
            load_recipe(DEMO_RECIPE, base + cache_keys + [f"output_dir={work / 'stage'}", f"teacher_cache.dir={cache}"])
        )
        stage_seconds = time.perf_counter() - started
        states_on_disk = states_bytes_on_disk(
            cache,
            args.cache_states,
            lambda *keys: run_teacher_stage(
                load_recipe(DEMO_RECIPE, base + cache_keys + [*keys, f"output_dir={work / 'stage'}"])
            ),
            work,
        )

    def built(name: str, *extra: str):
        recipe = load_recipe(DEMO_RECIPE, base + [f"output_dir={work / name}", *extra])
        return recipe, build_run(recipe, SilentReporter())

    recipe, online = built("online")
    precision = online.precision.name
    if args.head_states:
        print(f"logits from the final hidden state and the head ({precision})", flush=True)
        found = {
            "created": created(),
            "machine": describe_machine(online.device, precision=precision),
            "pair": PAIR,
            "quick": args.quick,
            "steps": batches,  # their micro batches: the accuracy part's
            "head_states": head_states_accuracy(recipe, online, batches),
        }
        atomic_write_json(args.out, found)
        srkl = found["head_states"]["srkl"]
        print("; ".join(f"srkl {m}: {r['loss_rel_error']:.4%}, {r['grad_cos']:.5f}" for m, r in srkl.items()))
        return 0
    config = AutoConfig.from_pretrained(teacher)
    print(f"accuracy of the stored logits against the online teacher ({precision})", flush=True)
    topk = accuracy(recipe, online, batches)
    topk_fkl = accuracy(recipe, online, batches, base="fkl")  # how much the tail matters
    logits = logits_accuracy(recipe, online, batches, draws)
    print("accuracy of the stored states", flush=True)
    states = states_accuracy(online, batches, config.hidden_size)
    from_cache = (f"teacher_cache.dir={cache}", *cache_keys)
    _, cached = built("cached", *from_cache)
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

    dev_batches = [
        online.dev.batch(list(range(i, min(i + recipe.train.micro_batch_size, len(online.dev)))))
        for i in range(0, len(online.dev), recipe.train.micro_batch_size)
    ]
    print("step time, generation off: online vs cached", flush=True)
    interleaved_rounds(
        list(variants),
        rounds,
        measure,
        warm_up=lambda name: measure(name, record=False),
        describe=lambda name: f"{name} {times[name][-1]:.2f} s",
    )
    by_seed = {recipe.seed: (dev_loss(online, online, dev_batches), dev_loss(cached, online, dev_batches))}
    dev_rows_held = len(online.dev)
    online.close()
    cached.close()
    for seed in range(1, seeds):  # the run's own noise: data order and the projectors' init
        print(f"training comparison, seed {seed}", flush=True)
        pair = {
            name: built(f"{name}-{seed}", f"seed={seed}", *extra)[1]
            for name, extra in (("online", ()), ("cached", from_cache))
        }
        for run in pair.values():
            trainer = Trainer(run, SilentReporter())
            for step in range(steps["online"]):
                trainer.step(step)
        by_seed[seed] = tuple(dev_loss(pair[name], pair["online"], dev_batches) for name in ("online", "cached"))
        for run in pair.values():
            run.close()
    training = compared_training(by_seed, steps["online"], dev_rows_held)
    _, always = built("always", "off_policy.mode=always", f"off_policy.max_new_tokens={64}")
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
    reads = teacher_reads(recipe, 10, config.num_hidden_layers)
    annotations = read_annotations(work / "annotations-train").table
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
            vocab_size=config.vocab_size,
        )
        for k in KS
    }
    manifest = read_cache_manifest(cache / "train", "bench: ")
    stored = sum(path.stat().st_size for path in (cache / "train").glob("part-*.parquet"))
    result = {
        "created": created(),
        "machine": describe_machine(online.device, precision=precision),
        "pair": PAIR,
        "quick": args.quick,
        "rows": annotations.num_rows,
        "responses_per_row": responses / annotations.num_rows,
        "tokens_per_row": tokens / annotations.num_rows,
        "rounds": rounds,
        "draws": draws,
        "top_k": {
            str(k): {
                **topk[k],
                "bytes_per_row": sizes[k].per_row,
                "logits_bytes_per_row": sizes[k].logits / sizes[k].rows,
            }
            for k in KS
        },
        "top_k_fkl": {str(k): topk_fkl[k] for k in KS},
        "logits": logits,
        "states": states,
        "cache": {
            "settings": {key.split("=")[0]: key.split("=")[1] for key in cache_keys},
            "manifest_bytes_per_token": stored_per_token(manifest),
            "bytes_per_row_on_disk": stored / annotations.num_rows,
            "states_bytes_per_token_on_disk": states_on_disk,
        },
        "training": training,
        "default_top_k": DEFAULT_K,
        "loss_rel_error_default_k": topk[DEFAULT_K]["loss_rel_error"],
        "grad_cos_default_k": topk[DEFAULT_K]["grad_cos"],
        "bytes_per_row_default_k": sizes[DEFAULT_K].per_row,
        "step_seconds": {"online": times["online"], "cached": times["cached"], "generated": generated_times},
        "ratio_cached_vs_online_step": paired_ratio(times["cached"], times["online"]),
        "generated_share": share,
        "ratio_cached_vs_online_step_adaptive": (share * t_gen + (1 - share) * t_cached)
        / (share * t_gen + (1 - share) * t_online),
        "teacher_stage_seconds": stage_seconds,
        "teacher_stage_rows_per_s": manifest["rows"]["written"] / stage_seconds,
    }
    atomic_write_json(args.out, result)
    srkl = logits["srkl"]
    print(
        f"cached / online step: {result['ratio_cached_vs_online_step']:.2f} (generation off); "
        + "; ".join(
            f"srkl {name}: loss rel. error {r['loss_rel_error']:.2%}, gradient cosine {r['grad_cos']:.4f}, "
            f"{r['logits_bytes_per_response_position']:.0f} B a position"
            for name, r in srkl.items()
        )
        + f"; dev loss after {training['steps']} steps, cached - online: {training['total_difference_mean']:+.4f} "
        f"(online's spread over {seeds} seeds {training['online_total_stdev']:.4f}) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
