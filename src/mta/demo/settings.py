"""What the demo runs, at its two sizes (``--quick`` and full), and how long that takes."""

from __future__ import annotations

from dataclasses import dataclass, field

from mta.distributed import local_device
from mta.dtypes import resolve_precision

# Seconds per unit for the estimate printed at the start, fitted to the stage times
# (results.json's stage_seconds) of one `mta demo` and one `mta demo --quick` on the shared 2-core
# development machine (bf16, torch on the idle cores; issue 50; the load of each run: README, Two
# commands): each stage = its fixed cost + its units, two sizes giving both. Without bf16,
# training and sampling take BF16_SPEEDUP times them (bench/cpu_precision.py).
FIXED_SECONDS = 13  # start-up, pruning, sampling and annotating Dolly, the report
SECONDS_PER_RUN = 10.2  # each student run: models, DeepSpeed, dev passes at start and end, final/ and best/
SECONDS_PER_SFT_ROW = 0.37  # a training row (steps x batch) of the 10-layer student, <=192 tokens
SECONDS_PER_KD_ROW_EXTRA = 0.16  # + the 30-layer teacher's forward and the 49k-vocabulary loss
SECONDS_PER_EVALUATED_MODEL = 3.1  # loading, fingerprint, perplexity's fixed part
SECONDS_PER_GENERATED_TOKEN = 0.0065  # per row and new token, its prompt and perplexity rows included
SECONDS_PER_INSPECTED_STUDENT = 6.3  # its CKA accumulators and matrices
SECONDS_PER_INSPECTED_ROW = 0.70  # a dev row through the teacher and one student
BF16_SPEEDUP = 1.8  # training x1.75-1.95, sampling x1.75-2.1 (bench/cpu_precision.py)


RECIPE_BATCH_SIZE = 8  # smollm2-demo.yaml's train.batch_size


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
    # Dev prompts sampled at each dev pass (train.num_sample_generations); None: the recipe's (2).
    dev_samples: int | None = None
    # Rows per step (train.batch_size = micro_batch_size); None: the recipe's (8).
    batch_size: int | None = None
    eval_limits: dict[str, int] = field(default_factory=dict)
    max_new_tokens: int = 40
    seeds: tuple[int, ...] = (10, 20)
    perplexity_rows: int = 200
    eval_batch_size: int = 16
    # The first dev rows `mta inspect` streams through the teacher and each student (half fit HRA's
    # linear map, half measure it); None: every dev row.
    inspect_rows: int | None = None
    # train.checkpoint_at_end: each run's last DeepSpeed checkpoint (checkpoints/step-N/, 1 GB of
    # optimizer state a run, which could continue it) besides final/; the quick run writes none.
    checkpoint_at_end: bool = True
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
            # A plumbing check: every stage runs on a few rows. cProfile of the earlier size (4
            # steps of 8 rows, 8 dev rows, 8 rows x 24 tokens a set, 50 perplexity rows, every dev
            # row inspected; issue 50): 32 % of its time evaluating, 32 % inspecting, 32 % training,
            # of which the dev passes and the final checkpoint were half; these sizes cut each.
            train_steps=4,
            batch_size=2,
            dev_rows=4,
            dev_sample_tokens=8,
            dev_samples=1,
            eval_limits={"dolly": 2, "self-inst": 2, "vicuna": 2, "sinst": 2},
            max_new_tokens=8,
            seeds=(10,),
            perplexity_rows=4,
            inspect_rows=2,
            checkpoint_at_end=False,
        )

    def recipe_overrides(self) -> list[str]:
        """The recipe keys these sizes set on every run (besides paths and steps)."""
        # A dev pass at step 0 and at the end (the recipe's 30 would add one two steps before the
        # end of a 32-step run), one checkpoint at the end (30 would add a second 1 GB one).
        overrides = [
            f"train.precision={self.precision}",
            f"train.eval_interval={self.train_steps}",
            f"train.save_interval={self.train_steps}",
            f"train.checkpoint_at_end={str(self.checkpoint_at_end).lower()}",
        ]
        if self.dev_sample_tokens is not None:
            overrides.append(f"train.sample_max_new_tokens={self.dev_sample_tokens}")
        if self.dev_samples is not None:
            overrides.append(f"train.num_sample_generations={self.dev_samples}")
        if self.batch_size is not None:
            overrides += [f"train.batch_size={self.batch_size}", f"train.micro_batch_size={self.batch_size}"]
        return overrides

    def estimated_seconds(self) -> float:
        batch = self.batch_size or RECIPE_BATCH_SIZE
        rows = self.train_steps * batch  # per run
        training = len(VARIANTS) * (SECONDS_PER_RUN + rows * SECONDS_PER_SFT_ROW) + 2 * rows * SECONDS_PER_KD_ROW_EXTRA
        models = len(VARIANTS) + 2
        tokens = sum(self.eval_limits.values()) * len(self.seeds) * self.max_new_tokens
        evaluation = models * (SECONDS_PER_EVALUATED_MODEL + tokens * SECONDS_PER_GENERATED_TOKEN)
        inspected = self.inspect_rows if self.inspect_rows is not None else self.dev_rows
        inspection = (models - 1) * (SECONDS_PER_INSPECTED_STUDENT + inspected * SECONDS_PER_INSPECTED_ROW)
        slower = 1.0 if self.resolved_precision() == "bf16" else BF16_SPEEDUP
        return FIXED_SECONDS + (training + evaluation + inspection) * slower

    def resolved_precision(self) -> str:
        """``fp32`` / ``bf16``: what ``precision`` means on this machine."""
        return resolve_precision(self.precision, local_device())
