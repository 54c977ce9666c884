"""Benchmark: bf16 against fp32 on this CPU, at the demo's shapes (random weights).

    python bench/cpu_precision.py            # ~4 min on a quiet 2-core machine
    python bench/cpu_precision.py --quick    # < 3 min: fewer rounds, no teacher forward

One process, the machine's torch threads (``--threads``), variants interleaved over rounds (the
order rotates), medians of wall seconds; ratios are medians of per-round ratios (fp32 seconds /
bf16 seconds: > 1 means bf16 is faster). Measured:

- the training step of the demo's student (the 10-layer SmolLM2 prune, 63.7M parameters, 49k
  vocabulary; batch 8 x 160 tokens, cross-entropy, AdamW, gradient clipping) through mta's
  DeepSpeed engine, as ``mta distill`` runs it: ``fp32``; ``bf16`` (``train.precision=bf16`` on a
  CPU: torch autocast over fp32 weights, gradients and optimizer state); ``ds_bf16`` (DeepSpeed's
  own bf16 mode: bf16 weights and gradients, fp32 master weights in the optimizer), the
  alternative mta does not take on a CPU, for the record. GFLOP/s count ``6·N·tokens``
  (``mta.training.lifecycle.utilisation``). The first two steps of each fresh engine are timed apart (the
  first variant's are a fresh process's);
- sampling 32 new tokens (exactly: ``min_new_tokens``) for 16 prompts of 40-100 tokens with the
  demo's 30-layer teacher shape through ``HFGenerator`` (what ``mta evaluate`` runs): fp32 against
  bf16 weights (``--dtype bf16``);
- (full run only) the teacher's forward on the training batch: fp32 weights against bf16 weights
  under autocast (how a CPU bf16 run holds a frozen fp32 teacher);
- this machine's matrix-product peak: the median of 2048³ products, fp32 and bf16.

Writes bench/results/cpu_precision.json (``--out``): ``ratio_bf16_vs_fp32_train``,
``ratio_bf16_vs_fp32_generate``, ``train_gflops_fp32``, ``train_gflops_bf16``,
``matmul_peak_gflops_fp32`` (+ bf16), ``train_fraction_of_fp32_peak``, the per-round seconds and
the targets (on a processor with native bf16: both ratios >= 1.35, the fp32 step >= 70 % of the
fp32 peak). Like every step the trainer runs on a CPU, this one serves large blocks from glibc's
heap (``mta.training.engine.keep_freed_memory``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interleaving import interleaved_rounds, paired_ratio  # noqa: E402
from machine import created, describe_machine  # noqa: E402
from mta.dtypes import cpu_bf16_instructions, cpu_has_native_bf16  # noqa: E402
from mta.files import atomic_write_json  # noqa: E402
from mta.generation import HFGenerator, SamplingParams, sampling_seed  # noqa: E402
from mta.training import engine as engines  # noqa: E402
from mta.training.config.schema import TrainSpec  # noqa: E402
from mta.training.lifecycle.utilisation import StepFlops  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "recipes" / "configs"
STUDENT_CONFIG = CONFIGS / "smollm2-135m-10layers.json"
TEACHER_CONFIG = CONFIGS / "smollm2-135m-instruct.json"
RESULTS = REPO / "bench" / "results" / "cpu_precision.json"
BATCH, SEQUENCE = 8, 160
PROMPTS, NEW_TOKENS = 16, 32
MATMUL = 2048
TARGET_RATIO, TARGET_FRACTION = 1.35, 0.70


def random_model(config_path: Path, seed: int) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


class StudentStep(torch.nn.Module):
    """What the engine trains: the student, its loss the cross-entropy on its own tokens."""

    def __init__(self, student: torch.nn.Module):
        super().__init__()
        self.student = student

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.student(input_ids=ids, labels=ids).loss


class TrainVariant:
    def __init__(self, name: str, ids: torch.Tensor, world_size: int):
        self.name, self.ids = name, ids
        cpu = torch.device("cpu")
        spec = TrainSpec(
            lr=1e-4,
            max_steps=10_000,
            batch_size=BATCH,
            micro_batch_size=BATCH,
            zero_stage=1,
            precision="fp32" if name == "fp32" else "bf16",
        )
        if name == "ds_bf16":
            self.precision = engines.TrainingPrecision("bf16", "bf16", False, "cpu")  # DeepSpeed's bf16
        else:
            self.precision = engines.resolve_training_precision(spec, cpu)
        model = StudentStep(random_model(STUDENT_CONFIG, seed=0)).train()
        self.engine = engines.initialize(model, [], spec, {}, 10_000, world_size, self.precision)
        self.flops = StepFlops(self.engine.module, self.engine.module.student).of(ids.numel())
        self.first: list[float] = []
        self.seconds: list[float] = []

    def step(self) -> float:
        started = time.perf_counter()
        with self.precision.context():
            loss = self.engine(self.ids)
        self.engine.backward(loss)
        self.engine.step()
        return time.perf_counter() - started


def train_section(rounds: int, world_size: int) -> dict:
    ids = torch.randint(
        0,
        AutoConfig.from_pretrained(STUDENT_CONFIG).vocab_size,
        (BATCH, SEQUENCE),
        generator=torch.Generator().manual_seed(0),
    )
    variants = []
    for name in ("fp32", "bf16", "ds_bf16"):  # fp32 first: its first steps are a fresh process's
        variant = TrainVariant(name, ids, world_size)
        variant.first = [variant.step(), variant.step()]
        print(f"  {name}: first two steps {variant.first[0]:.2f} s, {variant.first[1]:.2f} s", flush=True)
        variants.append(variant)
    interleaved_rounds(
        variants,
        rounds,
        lambda v: v.seconds.append(v.step()),
        warm_up=lambda v: None,
        describe=lambda v: f"{v.name} {v.seconds[-1]:.2f} s",
    )
    by_name = {v.name: v for v in variants}
    medians = {v.name: statistics.median(v.seconds) for v in variants}
    out = {
        "train_seconds_median": medians,
        "train_seconds_rounds": {v.name: v.seconds for v in variants},
        "train_first_two_steps_s": {v.name: v.first for v in variants},
        "train_flops_per_step": by_name["fp32"].flops,
        "ratio_bf16_vs_fp32_train": paired_ratio(by_name["fp32"].seconds, by_name["bf16"].seconds),
        "ratio_ds_bf16_vs_fp32_train": paired_ratio(by_name["fp32"].seconds, by_name["ds_bf16"].seconds),
        "ratio_ds_bf16_vs_bf16_train": paired_ratio(by_name["bf16"].seconds, by_name["ds_bf16"].seconds),
    }
    for name in medians:
        out[f"train_gflops_{name}"] = by_name[name].flops / medians[name] / 1e9
    for variant in variants:
        variant.engine.destroy()
    return out


def generate_section(rounds: int) -> dict:
    fp32 = random_model(TEACHER_CONFIG, seed=1).eval()
    models = {"fp32": fp32, "bf16": random_model(TEACHER_CONFIG, seed=1).to(torch.bfloat16).eval()}
    vocab = fp32.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    lengths = torch.linspace(40, 100, PROMPTS).round().int().tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    seeds = [sampling_seed(0, "bench/cpu_precision", 0, row) for row in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    tokenizer = SimpleNamespace(eos_token_id=fp32.config.eos_token_id, pad_token_id=fp32.config.eos_token_id)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    tokens: dict[str, int] = {}

    def sample(name: str) -> float:
        started = time.perf_counter()
        engine = HFGenerator(models[name], tokenizer, params, batch_size=PROMPTS)
        tokens[name] = sum(c.num_tokens for batch in engine.generate(prompts, seeds) for c in batch)
        return time.perf_counter() - started

    interleaved_rounds(
        list(models),
        rounds,
        lambda name: seconds[name].append(sample(name)),
        warm_up=sample,
        describe=lambda name: f"{name} {seconds[name][-1]:.2f} s",
    )
    return {
        "generate_seconds_median": {name: statistics.median(v) for name, v in seconds.items()},
        "generate_seconds_rounds": seconds,
        "generate_new_tokens": tokens,
        "ratio_bf16_vs_fp32_generate": paired_ratio(seconds["fp32"], seconds["bf16"]),
    }


def teacher_section(rounds: int) -> dict:
    """The frozen teacher's forward on the training batch: fp32 weights (no autocast, as an fp32
    run) against bf16 weights under autocast (a CPU bf16 run)."""
    fp32 = random_model(TEACHER_CONFIG, seed=1).eval().requires_grad_(False)
    bf16 = random_model(TEACHER_CONFIG, seed=1).eval().requires_grad_(False).to(torch.bfloat16)
    ids = torch.randint(0, fp32.config.vocab_size, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(2))
    runs = {"fp32": (fp32, contextlib.nullcontext), "bf16": (bf16, lambda: torch.autocast("cpu", dtype=torch.bfloat16))}
    seconds: dict[str, list[float]] = {name: [] for name in runs}

    def forward(name: str) -> float:
        model, context = runs[name]
        started = time.perf_counter()
        with torch.no_grad(), context():
            model(input_ids=ids, output_hidden_states=True)
        return time.perf_counter() - started

    interleaved_rounds(
        list(runs),
        rounds,
        lambda n: seconds[n].append(forward(n)),
        warm_up=forward,
        describe=lambda n: f"{n} {seconds[n][-1]:.2f} s",
    )
    return {
        "teacher_forward_seconds_median": {n: statistics.median(v) for n, v in seconds.items()},
        "ratio_bf16_vs_fp32_teacher_forward": paired_ratio(seconds["fp32"], seconds["bf16"]),
    }


def matmul_peak(dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of the median 2048³ product in ``dtype``."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(MATMUL, MATMUL, generator=generator).to(dtype)
    b = torch.randn(MATMUL, MATMUL, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up: kernel selection, first touch
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - started)
    return 2 * MATMUL**3 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, no teacher forward (< 3 min)")
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (3 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 7)
    started = time.perf_counter()
    freed = engines.keep_freed_memory()  # as every CPU training run
    _, world_size = engines.init_distributed()

    peaks = {
        "matmul_peak_gflops_fp32": matmul_peak(torch.float32, 5 if args.quick else 15),
        "matmul_peak_gflops_bf16": matmul_peak(torch.bfloat16, 5 if args.quick else 15),
    }
    print(
        f"matrix-product peak: fp32 {peaks['matmul_peak_gflops_fp32']:.0f} GFLOP/s, "
        f"bf16 {peaks['matmul_peak_gflops_bf16']:.0f} GFLOP/s",
        flush=True,
    )
    print("training step:", flush=True)
    train = train_section(rounds, world_size)
    print("sampling:", flush=True)
    generate = generate_section(rounds)
    teacher = {}
    if not args.quick:
        print("teacher forward:", flush=True)
        teacher = teacher_section(rounds)

    fraction = train["train_gflops_fp32"] / peaks["matmul_peak_gflops_fp32"]
    native = cpu_has_native_bf16()
    result = {
        "benchmark": "cpu_precision",
        "created": created(),
        "machine": describe_machine(
            torch.device("cpu"),
            bf16_instructions=list(cpu_bf16_instructions()),
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            glibc_keep_freed_memory=freed,
        ),
        "setup": {
            "quick": args.quick,
            "rounds": rounds,
            "student": STUDENT_CONFIG.name,
            "teacher": TEACHER_CONFIG.name,
            "batch": BATCH,
            "sequence": SEQUENCE,
            "prompts": PROMPTS,
            "new_tokens": NEW_TOKENS,
            "matmul": MATMUL,
            "weights": "random",
            "clock": "wall, medians; ratios: median of per-round fp32 / bf16",
        },
        "targets": {
            "ratio_min": TARGET_RATIO,
            "train_fraction_of_fp32_peak_min": TARGET_FRACTION,
            "apply": "a processor with native bf16",
        },
        **peaks,
        **train,
        "train_fraction_of_fp32_peak": fraction,
        "train_fraction_of_bf16_peak_bf16": train["train_gflops_bf16"] / peaks["matmul_peak_gflops_bf16"],
        **generate,
        **teacher,
        "seconds_spent": time.perf_counter() - started,
    }
    result["target_met"] = (not native) or (
        result["ratio_bf16_vs_fp32_train"] >= TARGET_RATIO
        and result["ratio_bf16_vs_fp32_generate"] >= TARGET_RATIO
        and fraction >= TARGET_FRACTION
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(
        f"train: fp32 {train['train_seconds_median']['fp32']:.2f} s ({train['train_gflops_fp32']:.0f} GFLOP/s, "
        f"{100 * fraction:.0f} % of the fp32 peak), bf16 {train['train_seconds_median']['bf16']:.2f} s "
        f"(x{train['ratio_bf16_vs_fp32_train']:.2f}), DeepSpeed bf16 {train['train_seconds_median']['ds_bf16']:.2f} s "
        f"(x{train['ratio_ds_bf16_vs_fp32_train']:.2f}); sampling x{generate['ratio_bf16_vs_fp32_generate']:.2f}; "
        f"{result['seconds_spent']:.0f} s -> {args.out}"
    )


if __name__ == "__main__":
    main()
