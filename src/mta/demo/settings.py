"""What the demo runs, at its two sizes (``--quick`` and full), and how long that takes."""

from __future__ import annotations

from dataclasses import dataclass, field

# Seconds per unit, measured on the 2-core development machine (fp32), for the start-up estimate.
SECONDS_PER_SFT_STEP = 4.0        # 10-layer student, batch 8 x 192 tokens, forward + backward
SECONDS_PER_KD_STEP_EXTRA = 1.5   # + the 30-layer teacher's forward
SECONDS_PER_GENERATED_TOKEN = 0.012  # one batched decoding step of a 135M model, batch 16, per row
FIXED_SECONDS = 120               # conversion, pruning, annotation, model loading


@dataclass(frozen=True)
class Variant:
    """One of the three students: a name for tables and the recipe overrides that make it."""

    name: str
    label: str
    overrides: tuple[str, ...]
    uses_teacher: bool


VARIANTS = (
    Variant("sft", "SFT (cross-entropy, no teacher)",
            ("teacher=null", "loss.base=ce", "loss.dsa_weight=0", "loss.hra_weight=0"), False),
    Variant("kd", "KD: skew reverse KL", ("loss.dsa_weight=0", "loss.hra_weight=0"), True),
    Variant("mta", "KD + MTA (DSA + HRA)", (), True),
)


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run. ``full()`` is ``make demo``, ``quick()`` is ``make demo-quick``."""

    name: str
    student_layers: int = 10
    train_steps: int = 60
    batch_size: int = 8
    max_length: int = 192
    max_prompt_length: int = 128
    lr: float = 2e-4
    dev_rows: int = 32            # dev loss during training
    eval_limits: dict[str, int] = field(default_factory=dict)
    max_new_tokens: int = 64
    seeds: tuple[int, ...] = (10, 20)
    perplexity_rows: int = 200
    eval_batch_size: int = 16

    @property
    def train_rows(self) -> int:
        """One pass over a fixed Dolly subset: every step sees new rows."""
        return self.train_steps * self.batch_size

    @classmethod
    def full(cls) -> "DemoSettings":
        return cls(
            name="full",
            eval_limits={"dolly": 64, "self-inst": 32, "vicuna": 32, "sinst": 32},
        )

    @classmethod
    def quick(cls) -> "DemoSettings":
        return cls(
            name="quick",
            train_steps=12,
            eval_limits={"dolly": 16, "self-inst": 16, "vicuna": 16, "sinst": 16},
            max_new_tokens=32,
            seeds=(10,),
            perplexity_rows=50,
        )

    def estimated_seconds(self) -> float:
        steps = self.train_steps * len(VARIANTS)
        training = steps * SECONDS_PER_SFT_STEP + self.train_steps * 2 * SECONDS_PER_KD_STEP_EXTRA
        rows = sum(self.eval_limits.values()) * len(self.seeds)
        models = len(VARIANTS) + 2
        generation = models * rows * self.max_new_tokens * SECONDS_PER_GENERATED_TOKEN
        return FIXED_SECONDS + training + generation
