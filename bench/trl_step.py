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

`--zero3`: the same two trainers on two CPU ranks under DeepSpeed ZeRO-3 (`accelerate launch
--config_file examples/accelerate/zero3.yaml --num_processes 2`, gloo, one torch thread per rank),
each rank with its own span parser of one worker process: two ranks and two span workers share
the machine's cores, unpinned (the OS places them), so the parse overlaps the models only as far
as a core is free. TRL's own loop runs the steps (the engine owns the optimizer): each round a
fresh trainer of each variant trains `--steps` + 1 steps, the first untimed; a step is timed on
rank 0 from TRL's step begin to its end. `--batch` is the global batch (half per rank).

    python bench/trl_step.py --zero3 --quick   # -> bench/results/trl_step_zero3.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from interleaving import interleaved_rounds, paired_ratio
from machine import created, describe_machine
from mta.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "trl_step.json"
RESULT_ZERO3 = REPO / "bench" / "results" / "trl_step_zero3.json"
TARGET = 1.15
PLACEMENT = (
    "2 ranks (1 torch thread each) + 1 span worker process per rank (2 in all), unpinned, on the machine's cores"
)


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


def sharded_worker(args: argparse.Namespace) -> None:
    """One rank of the ``--zero3`` launch: interleaved rounds of a fresh trainer per variant; rank
    0 writes each variant's per-round median step (and generation) seconds to ``args.zero3_out``."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from mta.api import GeneratedRow
    from mta.distributed import is_main, world_size
    from mta.integrations.trl import MTADistillationConfig, MTADistillationTrainer, join_cpu_launch

    torch.set_num_threads(1)
    if os.environ.get("RANK", "0") != "0":  # rank 0 prints the rounds (the group is joined later)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's life)
    models = args.zero3_worker
    rows = [json.loads(line) for line in (REPO / "recipes" / "examples" / "tiny.jsonl").read_text().splitlines()]
    prompts = Dataset.from_list([{"prompt": row["instruction"]} for row in rows[: args.batch]] * (args.steps + 1))
    tokenizer = AutoTokenizer.from_pretrained(models / "student")

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self._started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self._started)

    class ShardedVariant:
        def __init__(self, name: str):
            self.name = name
            self.steps: list[float] = []
            self.generation: list[float] = []

        def round(self) -> None:
            common = dict(
                output_dir=str(models / "runs" / self.name),
                per_device_train_batch_size=args.batch // world_size(),
                max_completion_length=args.new_tokens,
                generation_kwargs={"min_new_tokens": args.new_tokens},
                learning_rate=0.0,
                max_steps=args.steps + 1,
                report_to=[],
                save_strategy="no",
                bf16=False,
                seed=0,
                disable_tqdm=True,
                **join_cpu_launch(),
            )
            if self.name == "plain":
                config: Any = DistillationConfig(**common)
                trainer_class: Any = DistillationTrainer
            else:
                config = MTADistillationConfig(mta={"span_workers": 1}, **common)
                trainer_class = MTADistillationTrainer
            trainer = trainer_class(
                model=str(models / "student"),
                teacher_model=str(models / "teacher"),
                args=config,
                train_dataset=prompts,
                processing_class=tokenizer,
            )
            if self.name == "mta":  # its span worker started and spaCy loaded before the clock runs
                ids = tokenizer("Name three colours.")["input_ids"]
                trainer.span_parser.parse([GeneratedRow("Name three colours.", ids, ids, finished=False, id=0)])
            times = StepTimes()
            trainer.add_callback(times)
            generated: list[float] = []
            original = trainer._generate_and_score_completions

            def timed(inputs):
                started = time.perf_counter()
                try:
                    return original(inputs)
                finally:
                    generated.append(time.perf_counter() - started)

            trainer._generate_and_score_completions = timed
            trainer.train()
            self.steps.append(statistics.median(times.steps[1:]))
            self.generation.append(statistics.median(generated[1:]))

    variants = [ShardedVariant("plain"), ShardedVariant("mta")]
    interleaved_rounds(
        variants,
        args.rounds,
        lambda v: v.round(),
        warm_up=lambda v: None,
        describe=lambda v: f"{v.name} {v.steps[-1]:.3f}s",
    )
    if is_main():
        atomic_write_json(args.zero3_out, {v.name: {"steps": v.steps, "generation": v.generation} for v in variants})


def sharded(args: argparse.Namespace) -> None:
    """``--zero3``: build the models, launch ``sharded_worker`` on two ranks, write the result."""
    import subprocess

    from mta.distributed import free_port

    with tempfile.TemporaryDirectory() as scratch:
        student, teacher = build(Path(scratch), args)
        (Path(scratch) / "models").mkdir()
        (Path(scratch) / "models" / "student").symlink_to(student)
        (Path(scratch) / "models" / "teacher").symlink_to(teacher)
        times = Path(scratch) / "times.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        command = [
            *(sys.executable, "-m", "accelerate.commands.launch"),
            *("--config_file", str(REPO / "examples" / "accelerate" / "zero3.yaml")),
            *("--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port())),
            __file__,
            *("--zero3-worker", str(Path(scratch) / "models"), "--zero3-out", str(times)),
            *("--rounds", str(args.rounds), "--steps", str(args.steps), "--batch", str(args.batch)),
            *("--new-tokens", str(args.new_tokens), "--student-width", str(args.student_width)),
            *("--teacher-width", str(args.teacher_width)),
        ]
        subprocess.run(command, env=env, check=True)
        measured = json.loads(times.read_text())
    plain, mta = measured["plain"], measured["mta"]
    after = {name: [s - g for s, g in zip(v["steps"], v["generation"], strict=True)] for name, v in measured.items()}
    results = {
        "benchmark": "a step of MTADistillationTrainer vs trl.DistillationTrainer, two CPU ranks under "
        "DeepSpeed ZeRO-3 (bench/trl_step.py --zero3)",
        "created": created(),
        "machine": describe_machine(torch.device("cpu"), trl=__import__("trl").__version__),
        "settings": {
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "global_batch": args.batch,
            "new_tokens": args.new_tokens,
            "student": f"llama, 4 layers, width {args.student_width}",
            "teacher": f"llama, 8 layers, width {args.teacher_width}",
            "vocabulary": 2048,
            "engine": "accelerate launch --config_file examples/accelerate/zero3.yaml --num_processes 2 "
            "--mixed_precision no (gloo, fp32)",
            "span_workers": PLACEMENT,
            "mta": "dsa_weight 2, hra_weight 0.2, layers auto, importance attention",
            "timing": "rank 0's wall clock per step (TRL's step begin to end), median per round over a fresh "
            "trainer's steps after its first (the span workers started and spaCy loaded before train); ratios: "
            "medians of per-round ratios",
        },
        "variants": {
            name: {
                "step_s": statistics.median(v["steps"]),
                "generation_s": statistics.median(v["generation"]),
                "after_generation_s": statistics.median(after[name]),
            }
            for name, v in measured.items()
        },
        "ratio_mta_vs_plain": paired_ratio(mta["steps"], plain["steps"]),
        "ratio_mta_vs_plain_after_generation": paired_ratio(after["mta"], after["plain"]),
        "target": {"ratio_mta_vs_plain": TARGET, "of": "the single-process step (bench/results/trl_step.json)"},
    }
    results["met"] = results["ratio_mta_vs_plain"] <= TARGET
    atomic_write_json(args.out or RESULT_ZERO3, results)
    print(json.dumps({k: results[k] for k in ("ratio_mta_vs_plain", "ratio_mta_vs_plain_after_generation", "met")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--student-width", type=int, default=128)
    parser.add_argument("--teacher-width", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="4 rounds (--zero3: 3 rounds of 3 steps)")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/trl_step[_zero3].json")
    parser.add_argument("--zero3", action="store_true", help="two CPU ranks under DeepSpeed ZeRO-3")
    parser.add_argument("--steps", type=int, default=6, help="--zero3: timed steps per round and variant")
    parser.add_argument("--zero3-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--zero3-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3 if args.zero3 else 4
        args.steps = 3
    if args.zero3_worker is not None:
        return sharded_worker(args)
    if args.zero3:
        return sharded(args)
    args.out = args.out or RESULT
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
