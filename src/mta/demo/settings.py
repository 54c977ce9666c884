"""What the demo runs, at its two sizes (``--quick`` and full), and how long that takes."""

from __future__ import annotations

from dataclasses import dataclass, field

from mta.distributed import local_device
from mta.dtypes import resolve_precision

# Seconds per unit, measured with `make demo-quick` on the 2-core development machine (fp32),
# for the estimate printed at the start; in bf16 training and sampling take 1 / BF16_SPEEDUP of
# them (bench/cpu_precision.py).
SECONDS_PER_SFT_STEP = 5.0  # 10-layer student, batch 8 x <=192 tokens, forward + backward
SECONDS_PER_KD_STEP_EXTRA = 5.0  # + the 30-layer teacher's forward and the 49k-vocabulary loss
SECONDS_PER_GENERATED_TOKEN = 0.024  # per row and new token, batch 16, loading and perplexity included
FIXED_SECONDS = 120  # pruning, annotation, model loading (conversion: once, ~2 min more)
BF16_SPEEDUP = 1.8  # training x1.75-1.95, sampling x1.75-2.1 (bench/cpu_precision.py)


@dataclass(frozen=True)
class Variant:
    """One of the three students: its directory name, its label in the tables (also a directory
    name under eval/), the recipe overrides that make it and what it is, for the report."""

    name: str
    label: str
    overrides: tuple[str, ...]
    description: str


VARIANTS = (
    Variant(
        "sft",
        "sft",
        ("teacher=null", "loss.base=ce", "loss.dsa_weight=0", "loss.hra_weight=0"),
        "cross-entropy on the reference responses, no teacher",
    ),
    Variant(
        "kd",
        "srkl",
        ("loss.dsa_weight=0", "loss.hra_weight=0"),
        "DistiLLM's skew reverse KL (alpha 0.1) to the teacher",
    ),
    Variant("mta", "srkl+mta", (), "skew reverse KL + 2 x DSA + 0.2 x HRA, auto layers"),
)


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run. ``full()`` is ``make demo``, ``quick()`` is ``make demo-quick``.

    The training settings (batch, lengths, learning rates) are the demo recipe's,
    ``smollm2-demo.yaml``; these are the sizes the demo chooses on top of it.
    """

    name: str
    student_layers: int = 10
    train_steps: int = 32
    dev_rows: int = 32  # dev loss during training (at step 0 and at the end of each run)
    # Tokens of each dev sample generation (train.sample_max_new_tokens); None: the recipe's (32).
    dev_sample_tokens: int | None = None
    eval_limits: dict[str, int] = field(default_factory=dict)
    max_new_tokens: int = 40
    seeds: tuple[int, ...] = (10, 20)
    perplexity_rows: int = 200
    eval_batch_size: int = 16
    # train.precision and evaluate's dtype: auto is bf16 where the processor has bf16
    # instructions (mta.dtypes), fp32 elsewhere; the results say which it was.
    precision: str = "auto"

    @classmethod
    def full(cls) -> DemoSettings:
        return cls(
            name="full",
            eval_limits={"dolly": 32, "self-inst": 16, "vicuna": 16, "sinst": 16},
            max_new_tokens=40,
        )

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(
            name="quick",
            train_steps=4,
            # A 4-step run spent as long on its two dev passes (27 rows, both models, 2 samples of
            # 32 tokens) as on its steps (cProfile of `mta demo --quick`, issue 50): a few rows do.
            dev_rows=8,
            dev_sample_tokens=16,
            eval_limits={"dolly": 8, "self-inst": 8, "vicuna": 8, "sinst": 8},
            max_new_tokens=24,
            seeds=(10,),
            perplexity_rows=50,
        )

    def estimated_seconds(self) -> float:
        steps = self.train_steps * len(VARIANTS)
        training = steps * SECONDS_PER_SFT_STEP + self.train_steps * 2 * SECONDS_PER_KD_STEP_EXTRA
        rows = sum(self.eval_limits.values()) * len(self.seeds)
        models = len(VARIANTS) + 2
        generation = models * rows * self.max_new_tokens * SECONDS_PER_GENERATED_TOKEN
        speedup = BF16_SPEEDUP if self.resolved_precision() == "bf16" else 1.0
        return FIXED_SECONDS + (training + generation) / speedup

    def resolved_precision(self) -> str:
        """``fp32`` / ``bf16``: what ``precision`` means on this machine."""
        return resolve_precision(self.precision, local_device())
