"""Benchmark: a step of the TRL plug-in (`mta.integrations.trl.MTADistillationTrainer`) against the
plain `trl.DistillationTrainer` it extends, on the same tiny models and prompts.

A step is what TRL's loop does per optimizer step with one accumulation step: generate the
completions of a batch of prompts (the student, on-policy), the student's and the teacher's
forwards, the loss (TRL's generalised JSD; the plug-in adds DSA + HRA, the spans of the
completions parsed by one worker process while the forwards run), backward and the optimizer.
Every completion has exactly `--new-tokens` tokens (`min_new_tokens`), and the learning rate is 0
(AdamW still does all its work), so both trainers generate from the same student all along.

The variants are interleaved over rounds (`bench/interleaving.py`, the order rotating), each
reports the median seconds per step and per part (generation: inside `_generate_and_score_completions`;
the rest: forwards, loss, backward, optimizer); `ratio_mta_vs_plain` is the median of per-round
ratios of whole steps (target at most 1.15), `ratio_mta_vs_plain_after_generation` the same for
the part after generation. One torch thread (the machine is shared).

    python bench/trl_step.py            # a few minutes -> bench/results/trl_step.json
    python bench/trl_step.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from interleaving import interleaved_rounds, paired_ratio
from machine import created, describe_machine
from mta.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "trl_step.json"
TARGET = 1.15


class Variant:
    """One trainer, stepped by hand the way TRL's loop steps it, with its step times."""

    def __init__(self, name: str, trainer, prompts: list[dict]):
        self.name, self.trainer, self.prompts = name, trainer, prompts
        self.steps: list[float] = []
        self.generation: list[float] = []
        trainer.create_optimizer_and_scheduler(num_training_steps=10_000)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets per step
        original = trainer._generate_and_score_completions

        def timed(inputs):
            started = time.perf_counter()
            try:
                return original(inputs)
            finally:
                self._generated = time.perf_counter() - started

        trainer._generate_and_score_completions = timed
        self._generated = 0.0

    def step(self) -> None:
        trainer = self.trainer
        torch.manual_seed(0)  # the same sampling noise for both variants
        started = time.perf_counter()
        trainer.training_step(trainer.model, list(self.prompts), None)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        self.steps.append(time.perf_counter() - started)
        self.generation.append(self._generated)

    def after_generation(self) -> list[float]:
        return [step - generation for step, generation in zip(self.steps, self.generation, strict=True)]


def build(directory: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    from mta.models.tiny import build_tiny_model, build_tiny_tokenizer

    rows = REPO / "recipes" / "examples" / "tiny.jsonl"
    build_tiny_tokenizer(rows, directory / "tokenizer", vocab_size=2048)
    student = build_tiny_model(directory / "tokenizer", directory / "student", hidden_size=args.student_width)
    teacher = build_tiny_model(
        directory / "tokenizer", directory / "teacher", hidden_size=args.teacher_width, num_layers=8, seed=1
    )
    return student, teacher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--student-width", type=int, default=128)
    parser.add_argument("--teacher-width", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="4 rounds")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 4
    torch.set_num_threads(1)

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    from mta.integrations.trl import MTADistillationConfig, MTADistillationTrainer

    rows = [json.loads(line) for line in (REPO / "recipes" / "examples" / "tiny.jsonl").read_text().splitlines()]
    prompts = [{"prompt": row["instruction"]} for row in rows[: args.batch]]
    with tempfile.TemporaryDirectory() as scratch:
        student, teacher = build(Path(scratch), args)
        tokenizer = AutoTokenizer.from_pretrained(student)
        common = dict(
            per_device_train_batch_size=args.batch,
            max_completion_length=args.new_tokens,
            generation_kwargs={"min_new_tokens": args.new_tokens},
            learning_rate=0.0,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            seed=0,
        )
        dataset = Dataset.from_list(prompts)
        plain = DistillationTrainer(
            model=str(student),
            teacher_model=str(teacher),
            args=DistillationConfig(output_dir=str(Path(scratch) / "plain"), **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        mta = MTADistillationTrainer(
            model=str(student),
            teacher_model=str(teacher),
            args=MTADistillationConfig(output_dir=str(Path(scratch) / "mta"), mta={"span_workers": 1}, **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        variants = [Variant("plain", plain, prompts), Variant("mta", mta, prompts)]
        print(f"trl_step: {args.rounds} rounds, batch {args.batch}, {args.new_tokens} new tokens", flush=True)
        interleaved_rounds(
            variants,
            args.rounds,
            lambda v: v.step(),
            warm_up=lambda v: (v.step(), v.steps.clear(), v.generation.clear()),
            describe=lambda v: f"{v.name} {v.steps[-1]:.3f}s",
        )
        mta.close_span_parser()
    by_name = {v.name: v for v in variants}
    results = {
        "benchmark": "a step of MTADistillationTrainer vs trl.DistillationTrainer (bench/trl_step.py)",
        "created": created(),
        "machine": describe_machine(torch.device("cpu"), trl=__import__("trl").__version__),
        "settings": {
            "rounds": args.rounds,
            "batch": args.batch,
            "new_tokens": args.new_tokens,
            "student": f"llama, 4 layers, width {args.student_width}",
            "teacher": f"llama, 8 layers, width {args.teacher_width}",
            "vocabulary": 2048,
            "mta": "dsa_weight 2, hra_weight 0.2, layers auto, importance attention, 1 span worker",
            "timing": "wall clock per step, medians over rounds; ratios: medians of per-round ratios",
        },
        "variants": {
            v.name: {
                "step_s": statistics.median(v.steps),
                "generation_s": statistics.median(v.generation),
                "after_generation_s": statistics.median(v.after_generation()),
            }
            for v in variants
        },
        "ratio_mta_vs_plain": paired_ratio(by_name["mta"].steps, by_name["plain"].steps),
        "ratio_mta_vs_plain_after_generation": paired_ratio(
            by_name["mta"].after_generation(), by_name["plain"].after_generation()
        ),
        "target": {"ratio_mta_vs_plain": TARGET},
    }
    results["met"] = results["ratio_mta_vs_plain"] <= TARGET
    atomic_write_json(args.out, results)
    print(json.dumps({k: results[k] for k in ("ratio_mta_vs_plain", "ratio_mta_vs_plain_after_generation", "met")}))


if __name__ == "__main__":
    main()
