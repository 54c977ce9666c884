"""The distillation loop: ``run_distillation(recipe)`` builds a run, trains it, returns ``final/``.

``Run`` gathers what the loop needs (engine, frozen teacher, batches, schedule); ``Trainer.step``
is one optimizer step, top to bottom: micro batches -> teacher -> student + objective ->
finite check -> backward -> DeepSpeed step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from mta.errors import MtaError
from mta.models.tokenizers import tokenizer_fingerprint
from mta.training import checkpoint, engine as engines
from mta.training.annotations import load_split
from mta.training.batching import AnnotatedExamples, StepSchedule, TrainBatch, micro_batch_order
from mta.training.layers import resolve_layer_map
from mta.training.metrics import MetricsLog, Reporter, SilentReporter
from mta.training.models import FrozenTeacher, hidden_size, load_causal_lm, model_source, num_layers
from mta.training.objective import DistillationModel, DistillationObjective
from mta.training.recipe import Recipe

log = logging.getLogger(__name__)

DEV_ROWS = 64  # dev loss over at most this many rows: a signal, not an evaluation


class NonFiniteLoss(MtaError):
    """The loss became NaN or infinite; the run stopped before updating any weight with it."""


@dataclass
class Run:
    """Everything one training run holds, built by ``build_run``."""

    recipe: Recipe
    output_dir: Path
    engine: Any
    teacher: Optional[Any]
    tokenizer: Any
    train: AnnotatedExamples
    dev: Optional[AnnotatedExamples]
    schedule: StepSchedule
    total_steps: int
    rank: int
    world_size: int
    device: torch.device
    messages: list[str] = field(default_factory=list)


def build_run(recipe: Recipe, reporter: Reporter) -> Run:
    """Load models and data, check they fit together, and start the DeepSpeed engine."""
    rank, world_size = engines.init_distributed()
    device = engines.device()
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    output_dir.mkdir(parents=True, exist_ok=True)

    student, tokenizer = load_causal_lm(recipe.student, recipe, "student")
    student_tokenizer_source = model_source(recipe.student, recipe, "student")[1]
    fingerprints = {"student": tokenizer_fingerprint(tokenizer)}
    teacher_model, teacher_tokenizer, teacher_tokenizer_source = None, tokenizer, student_tokenizer_source
    if recipe.teacher is not None:
        teacher_model, teacher_tokenizer = load_causal_lm(recipe.teacher, recipe, "teacher")
        teacher_tokenizer_source = model_source(recipe.teacher, recipe, "teacher")[1]
    fingerprints["teacher"] = tokenizer_fingerprint(teacher_tokenizer)
    same_tokenizer = fingerprints["teacher"] == fingerprints["student"]

    layer_pairs = []
    if recipe.loss.dsa_weight or recipe.loss.hra_weight:
        layer_pairs = resolve_layer_map(recipe.loss.layers, num_layers(student), num_layers(teacher_model))
    # Projector initialisation (nn.Linear defaults) follows the recipe's seed.
    torch.manual_seed(recipe.seed)
    objective = DistillationObjective(
        recipe.loss, layer_pairs,
        student_hidden_size=hidden_size(student),
        teacher_hidden_size=hidden_size(teacher_model) if teacher_model is not None else None,
        same_tokenizer=same_tokenizer, vocab_size=len(tokenizer),
    )

    splits = {
        split: load_split(
            recipe, split, teacher_tokenizer=teacher_tokenizer_source,
            student_tokenizer=student_tokenizer_source, fingerprints=fingerprints,
        )
        for split in ("train", "dev")
    }
    granularities = tuple(sorted({pair.granularity for pair in layer_pairs}))
    examples = {
        split: AnnotatedExamples(
            annotations.table, student_pad_id=tokenizer.pad_token_id,
            teacher_pad_id=teacher_tokenizer.pad_token_id, with_teacher=teacher_model is not None,
            granularities=granularities,
        ) if annotations is not None else None
        for split, annotations in splits.items()
    }

    accumulation = recipe.train.accumulation_steps(world_size)
    schedule = StepSchedule(len(examples["train"]), recipe.train.micro_batch_size, accumulation, world_size)
    total_steps = schedule.total_steps(recipe.train.epochs, recipe.train.max_steps)
    model = DistillationModel(student, objective)
    engine = engines.initialize(model, model.projector_parameters(), recipe, total_steps, world_size)

    teacher = None
    if teacher_model is not None:
        teacher = FrozenTeacher(teacher_model, objective.teacher_layers, objective.needs_teacher_logits)
        teacher = (
            engines.teacher_zero3_engine(teacher, recipe, world_size)
            if recipe.train.teacher_zero3 else teacher.to(device)
        )

    messages = [
        f"global batch {recipe.train.batch_size} = {recipe.train.micro_batch_size} per device "
        f"× {accumulation} accumulation × {world_size} process(es); {total_steps} steps, "
        f"{schedule.steps_per_epoch} per epoch over {len(examples['train'])} rows",
    ]
    if teacher_model is None:
        messages.append("no teacher: plain SFT on the reference responses")
    elif same_tokenizer:
        messages.append(
            f"teacher and student share a tokenizer: base loss {recipe.loss.base} on the "
            f"{len(tokenizer)}-token vocabulary" + (", token-level HRA" if layer_pairs else "")
        )
    else:
        messages.append(
            "teacher and student tokenizers differ: no logit loss (base ce on the reference), "
            "each model pools spans on its own tokens, DSA on span geometry, HRA on span representations"
        )
    if layer_pairs:
        messages.append("aligned layers (student→teacher): " + ", ".join(
            f"{p.student}→{p.teacher} {p.granularity}" for p in layer_pairs
        ))
    return Run(
        recipe, output_dir, engine, teacher, tokenizer, examples["train"], examples["dev"],
        schedule, total_steps, rank, world_size, device, messages,
    )


class Trainer:
    def __init__(self, run: Run, reporter: Reporter):
        self.run = run
        self.reporter = reporter
        self._orders: dict[int, list[np.ndarray]] = {}

    def micro_batches(self, step: int) -> list[TrainBatch]:
        """This process's micro batches of global step ``step`` (a function of seed and step)."""
        run = self.run
        epoch, step_in_epoch = run.schedule.locate(step)
        if epoch not in self._orders:
            self._orders = {epoch: micro_batch_order(
                run.train.student_lengths, run.recipe.train.micro_batch_size,
                seed=run.recipe.seed, epoch=epoch,
            )}
        order = self._orders[epoch]
        return [run.train.batch(order[index]) for index in run.schedule.micro_batch_indices(step_in_epoch, run.rank)]

    def teacher_forward(self, batch: TrainBatch):
        if self.run.teacher is None:
            return None
        return self.run.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step; returns the mean of each loss component over its micro batches."""
        engine = self.run.engine
        totals: dict[str, float] = {}
        tokens = 0
        for batch in self.micro_batches(step):
            batch = batch.to(self.run.device)
            losses = engine(batch, self.teacher_forward(batch))
            if not _finite_everywhere(losses["total"]):
                raise NonFiniteLoss(
                    f"non-finite loss at step {step + 1} (components: "
                    + ", ".join(f"{k}={v.item():.4g}" for k, v in losses.items())
                    + f"), micro batch rows {batch.row_ids}; the run stopped without applying it. "
                    f"The last good checkpoint is kept under {checkpoint.checkpoints_dir(self.run.output_dir)}; "
                    "lower train.lr, or use bf16/fp32 instead of fp16, and resume with --resume auto"
                )
            engine.backward(losses["total"])
            engine.step()
            for name, value in losses.items():
                totals[name] = totals.get(name, 0.0) + value.item()
            tokens += batch.num_tokens
        count = self.run.schedule.accumulation
        return {name: value / count for name, value in totals.items()} | {"tokens": tokens}

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, Any]:
        """Dev loss over the first ``DEV_ROWS`` rows, and a few sampled generations."""
        run = self.run
        run.engine.eval()
        rows = np.arange(min(len(run.dev), DEV_ROWS))
        size = run.recipe.train.micro_batch_size
        sums: dict[str, float] = {}
        batches = [run.dev.batch(rows[i : i + size]) for i in range(0, len(rows), size)]
        for batch in batches:
            batch = batch.to(run.device)
            for name, value in run.engine(batch, self.teacher_forward(batch)).items():
                sums[name] = sums.get(name, 0.0) + value.item() * len(batch.row_ids)
        record = _record("dev", step, {name: value / len(rows) for name, value in sums.items()})
        record["samples"] = self.sample_generations(step)
        run.engine.train()
        return record

    def sample_generations(self, step: int) -> list[dict[str, str]]:
        """Sampled continuations of the first dev prompts (METHOD §6 sampling: top_k 0, T 1)."""
        run = self.run
        count = min(run.recipe.train.num_sample_generations, len(run.dev))
        if count == 0:
            return []
        student = run.engine.module.student
        samples = []
        # Sampling must not move the training RNG, or a resumed run would diverge.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(run.recipe.seed + step)
            for row in range(count):
                batch = run.dev.batch([row])
                prompt_len = int(run.dev.prompt_len["student"][row])
                prompt = batch.student.input_ids[:, :prompt_len].to(run.device)
                output = student.generate(
                    prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0, top_p=1.0,
                    temperature=1.0, max_new_tokens=run.recipe.train.sample_max_new_tokens,
                    pad_token_id=run.tokenizer.pad_token_id,
                    synced_gpus=run.world_size > 1 and run.engine.zero_optimization_partition_weights(),
                )
                samples.append({
                    "prompt": run.tokenizer.decode(prompt[0], skip_special_tokens=True),
                    "generation": run.tokenizer.decode(output[0, prompt_len:], skip_special_tokens=True).strip(),
                })
        return samples

    def train(self, resume_from: Optional[Path]) -> Path:
        run, recipe, reporter = self.run, self.run.recipe, self.reporter
        start = 0
        if resume_from is not None:
            start = checkpoint.load_checkpoint(run.engine, resume_from).step
            reporter.message(f"resumed from {resume_from} at step {start}")
        metrics = MetricsLog(run.output_dir / "metrics.jsonl", resume_step=start if resume_from else None)
        main = run.rank == 0
        reporter.start(run.total_steps, start)
        window = {"sums": {}, "steps": 0, "tokens": 0, "since": time.perf_counter()}
        try:
            for step in range(start, run.total_steps):
                losses = self.step(step)
                done = step + 1
                window["tokens"] += losses.pop("tokens")
                window["steps"] += 1
                for name, value in losses.items():
                    window["sums"][name] = window["sums"].get(name, 0.0) + value
                if done % recipe.train.log_interval == 0 or done == run.total_steps:
                    record = self._train_record(done, window)
                    if main:
                        metrics.write(record)
                    reporter.train_step(record)
                    window = {"sums": {}, "steps": 0, "tokens": 0, "since": time.perf_counter()}
                if run.dev is not None and done % recipe.train.eval_interval == 0:
                    record = self.evaluate(done)
                    if main:
                        metrics.write(record)
                    reporter.dev(record)
                if done % recipe.train.save_interval == 0 and done < run.total_steps:
                    self.save(done)
            self.save(run.total_steps)
            return checkpoint.save_final(run.engine, run.tokenizer, recipe, run.output_dir)
        finally:
            reporter.stop()

    def save(self, step: int) -> Path:
        state = checkpoint.TrainerState(step=step, total_steps=self.run.total_steps, tokens_seen=0, rng=[])
        return checkpoint.save_checkpoint(self.run.engine, self.run.tokenizer, self.run.recipe, self.run.output_dir, state)

    def _train_record(self, step: int, window: dict[str, Any]) -> dict[str, Any]:
        elapsed = time.perf_counter() - window["since"]
        tokens = _sum_over_processes(window["tokens"])
        record = _record("train", step, {k: v / window["steps"] for k, v in window["sums"].items()})
        record["lr"] = self.run.engine.get_lr()[0]
        record["tokens_per_s"] = tokens / max(elapsed, 1e-9)
        return record


def _record(split: str, step: int, losses: dict[str, float]) -> dict[str, Any]:
    record: dict[str, Any] = {"split": split, "step": step, "loss": losses["total"]}
    record.update({f"loss/{name}": value for name, value in losses.items() if name != "total"})
    return record


def _finite_everywhere(loss: torch.Tensor) -> bool:
    finite = torch.isfinite(loss.detach()).float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every process stops, none waits forever
    return bool(finite.item())


def _sum_over_processes(value: float) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        tensor = torch.tensor([value], dtype=torch.float64, device=engines.device())
        dist.all_reduce(tensor)
        return tensor.item()
    return value


def run_distillation(
    recipe: Recipe, resume: Optional[str] = None, reporter: Optional[Reporter] = None
) -> Path:
    """Train the recipe's student; returns the ``final/`` directory (Hugging Face format).

    resume: None (start fresh, overwriting metrics), ``"auto"`` (the newest complete checkpoint
    of ``output_dir`` if there is one) or a checkpoint directory. Several runs may follow each
    other in one process: each builds its own engine and releases it at the end.
    """
    reporter = reporter or SilentReporter()
    run = build_run(recipe, reporter)
    for message in run.messages:
        log.info(message)
        reporter.message(message)
    try:
        return Trainer(run, reporter).train(checkpoint.resolve_resume(resume, run.output_dir))
    finally:
        run.engine.destroy()
