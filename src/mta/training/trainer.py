"""The distillation loop: ``run_distillation(recipe)`` builds a run, trains it, returns ``final/``.

``Run`` gathers what the loop needs (engine, frozen teacher, batches, schedule); ``Trainer.step``
is one optimizer step, top to bottom: micro batches -> teacher -> student + objective ->
finite check -> backward -> DeepSpeed step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from mta import distributed, tracking
from mta.errors import MtaError
from mta.generation import HFGenerator, SamplingParams, sampling_seed
from mta.reporting import Reporter, SilentReporter
from mta.scoring import completion_text
from mta.task_registry import Task, task_of
from mta.training import asam
from mta.training import engine as engines
from mta.training.batching import AnnotatedExamples, StepSchedule, TrainBatch, micro_batch_order
from mta.training.config import resume_rules
from mta.training.config.schema import Recipe
from mta.training.dry_run import RunPlan
from mta.training.lifecycle import checkpointing, run_directory, stopping, utilisation
from mta.training.lifecycle.metrics import LossWindow, MetricsLog, loss_record
from mta.training.lifecycle.selection import Selector
from mta.training.lifecycle.utilisation import StepFlops
from mta.training.off_policy.micro_batches import OffPolicyBatches, dev_cross_entropy
from mta.training.teacher import TeacherForward, TeacherOutput
from mta.training.teacher_cache.read import CachedTeacher

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

log = logging.getLogger(__name__)

DEV_ROWS = 64  # dev loss over at most this many rows: a signal, not an evaluation
SPAN_WORKERS = 1  # processes parsing generated responses while the step computes


class NonFiniteLoss(MtaError):
    """The loss became NaN or infinite; the run stopped before updating any weight with it."""


class NonFiniteWeights(MtaError):
    """An optimizer step left NaN or infinite weights; the run stopped without saving them."""


# What a person can do about a non-finite step and that really works (a resume may lower the
# learning rate: see mta.training.config.resume_rules).
NON_FINITE_ADVICE = (
    "lower the learning rate and continue from that checkpoint with `--resume auto train.lr=<lower>`; "
    "with fp16, train in bf16 or fp32 instead (a new run: --overwrite or another output_dir)"
)


@dataclass(kw_only=True)
class Run:
    """Everything one training run holds, built by ``build_run``."""

    recipe: Recipe
    task: Task  # the recipe's task, resolved once: what the loop does differently for it
    plan: RunPlan | None  # what the run was built from, ``mta distill --dry-run``'s plan (task: llm)
    output_dir: Path
    run_id: str
    engine: DeepSpeedEngine
    teacher: TeacherForward | None  # the frozen teacher (a ZeRO-3 engine around it with train.teacher_zero3)
    tokenizer: PreTrainedTokenizerBase
    train: AnnotatedExamples
    dev: AnnotatedExamples | None
    schedule: StepSchedule
    total_steps: int
    rank: int
    world_size: int
    device: torch.device
    resume_from: Path | None = None  # the checkpoint to continue from, checked against the recipe
    off_policy: OffPolicyBatches | None = None  # off_policy: on (the student's own samples)
    teacher_cache: CachedTeacher | None = None  # teacher_cache.dir: the teacher's side of gold micro batches
    messages: list[str] = field(default_factory=list)
    selector: Selector | None = None  # data.dev: OUT/best/ by train.select_by
    precision: engines.TrainingPrecision  # train.precision on this device
    flops: StepFlops  # model FLOPs per micro batch (metrics: flops_per_s, mfu)

    def close(self) -> None:
        """Release the engine and the span workers (every run ends here, also after an error)."""
        if self.off_policy is not None:
            self.off_policy.parser.close()
        self.engine.destroy()


def build_run(recipe: Recipe, reporter: Reporter, *, resume: str | None = None, overwrite: bool = False) -> Run:
    """The run of ``recipe``, built by its task (``mta.task_registry``): ``mta.training.llm.build``
    for ``task: llm``, ``mta.embedding.training_run`` for ``task: embedding``."""
    return task_of(recipe).build_run(recipe, reporter, resume=resume, overwrite=overwrite)


class Trainer:
    def __init__(self, run: Run, reporter: Reporter, *, stops: stopping.StopRequests | None = None):
        self.run = run
        self.reporter = reporter
        # SIGUSR1 / SIGTERM (run_distillation installs the handlers); none arrive on a bare one.
        self.stops = stops if stops is not None else stopping.StopRequests()
        self.saved: tuple[int, Path] | None = None  # the newest checkpoint this process wrote
        self._orders: dict[int, list[np.ndarray]] = {}
        spec = run.recipe.train.asam
        self.asam = asam.Asam.for_engine(spec, run.engine) if spec is not None else None

    def micro_batches(self, step: int) -> Iterator[TrainBatch]:
        """This process's micro batches of global step ``step`` (a function of seed and step),
        one at a time: an off-policy run decides, and generates, each one after the last trained."""
        run = self.run
        epoch, step_in_epoch = run.schedule.locate(step)
        if epoch not in self._orders:
            # The task's pools (mta.task_registry): TALAS's uniformly random micro batches, or
            # the length-grouped ones of micro_batch_order's default.
            group_factor = run.task.group_factor
            pools = {"group_factor": group_factor} if group_factor is not None else {}
            self._orders = {
                epoch: micro_batch_order(
                    run.train.student_lengths,
                    run.recipe.train.micro_batch_size,
                    seed=run.recipe.seed,
                    epoch=epoch,
                    paired=run.train.pair_ids is not None,
                    **pools,
                )
            }
        indices = run.schedule.micro_batch_indices(step_in_epoch, run.rank)
        for k, rows in enumerate(self._orders[epoch][index] for index in indices):
            gold = run.train.batch(rows)
            # Its gold rows, or the student's own responses to their prompts, or rows from the
            # replay buffer (the same decision on every rank).
            batch = gold if run.off_policy is None else self._off_policy_batch(run.off_policy, step, k, rows, gold)
            # The authors pad every batch to max_length, and their importance averages those rows.
            reference = run.task.reference_padding and run.recipe.loss.reference_code
            yield batch.padded_to(run.recipe.data.max_length, run.train.pad_ids) if reference else batch

    def _off_policy_batch(
        self, off_policy: OffPolicyBatches, step: int, k: int, rows: np.ndarray, gold: TrainBatch
    ) -> TrainBatch:
        with self.run.precision.context():  # the student's own samples: bf16 products in a CPU bf16 run
            return off_policy.batch(step, k, rows, gold)[0]

    def teacher_forward(self, batch: TrainBatch, split: str = "train") -> TeacherOutput | None:
        """The teacher's side of ``batch``: from the teacher cache for a gold micro batch of a
        run with ``teacher_cache.dir``, else the online teacher's forward (None without one)."""
        if self.run.teacher_cache is not None and batch.origin == "gold":
            return self.run.teacher_cache.outputs(batch, split)
        if self.run.teacher is None:
            return None
        assert batch.teacher is not None, "a run with a teacher gathers its side of every batch (with_teacher)"
        return self.run.teacher(batch.teacher.input_ids, batch.teacher.attention_mask)

    def with_spans(self, batch: TrainBatch) -> TrainBatch:
        """The micro batch with its spans: a generated one's, parsed in the span workers since it
        was generated, are waited for here (after the teacher forward); others have them."""
        return batch if self.run.off_policy is None else self.run.off_policy.with_spans(batch)

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step; returns the mean of each loss component over its micro batches,
        the step's ``tokens`` and ``flops``, and ``grad_norm``, the gradient's 2-norm before
        clipping (``mta.training.engine.step_gradient_norm``; NaN where DeepSpeed reports none).

        With ``train.asam`` the window runs twice (``mta.training.asam``): its gradient at w sets
        ε, the window runs again at w + ε, and the optimizer applies that gradient to w."""
        window, options = self.window(step)
        if self.asam is None:
            totals, tokens = self.run_window(window, step, options)
        else:
            replayed = list(window)  # the same micro batches, replayed at w + ε
            with self.asam.perturbed(self.window_losses(replayed, step, options), step=step):
                totals, tokens = self.run_window(replayed, step, options)
        own_norm = engines.own_gradient_norm(self.run.engine)  # ZeRO-0 fp32: DeepSpeed keeps none
        self.run.engine.step()  # the window's last micro batch: the optimizer updates w
        self.stop_unless_finite_weights(step)
        count = self.run.schedule.accumulation
        return {name: value / count for name, value in totals.items()} | {
            "tokens": tokens,
            "flops": self.run.flops.take(),
            "grad_norm": engines.step_gradient_norm(self.run.engine, own_norm),
        }

    def window(self, step: int) -> tuple[Iterable[TrainBatch], dict[str, Any]]:
        """Step ``step``'s micro batches on the device, and the objective's keyword arguments.

        ``train.loss_reduction: micro_batch``: one at a time (an off-policy run generates each
        after the last trained), each its own mean. ``global``: all of them first, since their
        counts, summed over the window and the processes, divide every micro batch's sums
        before its backward (``mta.training.engine.window_divisors``); generating them before
        the first backward changes no sample, the student being the same until the step."""
        run = self.run
        batches = (batch.to(run.device) for batch in self.micro_batches(step))
        if run.recipe.train.loss_reduction != "global" or not run.task.global_reduction:
            return batches, {}
        window = list(batches)
        counts = [run.engine.module.objective.counts(batch) for batch in window]
        return window, {"divisors": engines.window_divisors(counts, run.schedule.accumulation, run.world_size)}

    def run_window(
        self, window: Iterable[TrainBatch], step: int, options: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, float], int]:
        """Forward and backward of each micro batch, DeepSpeed accumulating the gradient (its step
        after every micro batch but the last, which is the caller's); the loss sums and tokens.
        options: the objective's keyword arguments, from ``window``."""
        engine = self.run.engine
        totals: dict[str, float] = {}
        tokens = 0
        for k, batch in enumerate(window):
            if k:
                engine.step()  # inside the window: DeepSpeed only counts the micro batch
            with self.run.precision.context():
                teacher_out = self.teacher_forward(batch)
                batch = self.with_spans(batch)
                losses = engine(batch, teacher_out, **(options or {}))
            self.stop_unless_finite_loss(losses, step, batch)
            engine.backward(losses["total"])
            for name, value in losses.items():
                totals[name] = totals.get(name, 0.0) + value.item()
            tokens += batch.num_tokens
            self.run.flops.count(batch)
        return totals, tokens

    def window_losses(
        self, window: list[TrainBatch], step: int, options: Mapping[str, Any] | None = None
    ) -> Iterator[torch.Tensor]:
        """ASAM's first pass: each micro batch's total loss at w, outside the engine (no
        DeepSpeed gradient bookkeeping), one at a time."""
        for batch in window:
            with self.run.precision.context():
                teacher_out = self.teacher_forward(batch)
                batch = self.with_spans(batch)
                losses = self.run.engine.module(batch, teacher_out, **(options or {}))
            self.stop_unless_finite_loss(losses, step, batch)
            yield losses["total"]

    def stop_unless_finite_loss(self, losses: dict[str, torch.Tensor], step: int, batch: TrainBatch) -> None:
        """Every process stops (none waits forever) before a non-finite loss is applied."""
        if distributed.all_ranks_agree(bool(torch.isfinite(losses["total"].detach()))):
            return
        raise NonFiniteLoss(
            f"non-finite loss at step {step + 1} (components: "
            + ", ".join(f"{k}={v.item():.4g}" for k, v in losses.items())
            + f"), micro batch rows {batch.row_ids}; the run stopped without applying it. "
            f"The last good checkpoint is kept under {checkpointing.checkpoints_dir(self.run.output_dir)}: "
            + NON_FINITE_ADVICE
        )

    @torch.no_grad()
    def stop_unless_finite_weights(self, step: int) -> None:
        """After the optimizer step: non-finite gradients or an infinite learning rate leave
        non-finite weights, which are never saved. Checks each process's own shard (ZeRO-3
        keeps a partition in ``ds_tensor``), one reduction for all of them."""
        local = [getattr(p, "ds_tensor", p) for p in self.run.engine.module.parameters()]
        local = [t for t in local if t.numel()]
        # Each tensor's largest magnitude, in one fused call (one op per tensor cost ~1.5 s a step
        # on a loaded 2-core CPU): NaN or inf exactly where the tensor holds one, never an overflow.
        finite = bool(torch.stack(torch._foreach_norm(local, float("inf"))).isfinite().all()) if local else True
        if distributed.all_ranks_agree(finite):
            return
        raise NonFiniteWeights(
            f"step {step + 1} left non-finite weights (non-finite gradients, or a learning rate "
            "too large); the run stopped and saved nothing of that step. The last good checkpoint "
            f"is kept under {checkpointing.checkpoints_dir(self.run.output_dir)}: " + NON_FINITE_ADVICE
        )

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, Any]:
        """Dev loss over the first ``DEV_ROWS`` rows, and a few sampled generations."""
        run, dev = self.run, self.run.dev
        assert dev is not None, "a run evaluates only with data.dev (Trainer.train checks)"
        run.engine.eval()
        rows = np.arange(min(len(dev), DEV_ROWS))
        size = run.recipe.train.micro_batch_size
        sums: dict[str, float] = {}
        batches = [dev.batch(rows[i : i + size]) for i in range(0, len(rows), size)]
        for batch in batches:
            batch = batch.to(run.device)
            for name, value in run.engine(batch, self.teacher_forward(batch, "dev")).items():
                sums[name] = sums.get(name, 0.0) + value.item() * len(batch.row_ids)
        record = loss_record("dev", step, {name: value / len(rows) for name, value in sums.items()})
        if run.off_policy is not None and run.recipe.off_policy.mode == "adaptive":
            # DistiLLM's threshold follows the student's cross-entropy on the dev references.
            ce_rows = np.arange(min(len(dev), run.recipe.off_policy.dev_rows or len(dev)))
            ce_batches = [dev.batch(ce_rows[i : i + size]) for i in range(0, len(ce_rows), size)]
            record["off_policy/dev_ce"] = dev_cross_entropy(run.engine.module.student, ce_batches, run.device)
            run.off_policy.update_threshold(record["off_policy/dev_ce"])
            record["off_policy/threshold"] = run.off_policy.state.threshold
        if run.selector is not None:  # select_by=rouge: dev/rougeL of sampled responses
            record.update(run.selector.measure(run.engine.module.student))
        record["samples"] = self.sample_generations(step)
        run.engine.train()
        return record

    def sample_generations(self, step: int) -> list[dict[str, str]]:
        """Sampled continuations of the first dev prompts (docs/method.md §6 sampling: top_k 0, T 1).

        Row r draws from ``sampling_seed(recipe.seed, "dev-samples", step, r)``, never from the
        global RNG, so a resumed run does not diverge. Every rank samples the same rows (under
        ZeRO-3 all ranks must take part in each forward).
        """
        run, dev = self.run, self.run.dev
        assert dev is not None, "a run samples dev prompts only with data.dev (Trainer.train checks)"
        count = min(run.recipe.train.num_sample_generations, len(dev))
        if count == 0 or not run.task.samples_dev_prompts:  # an encoder generates nothing
            return []
        rows = np.arange(count)
        dev_batch = dev.batch(rows)
        prompt_lengths = dev.prompt_len["student"][rows].tolist()
        prompts = [ids[:n].tolist() for ids, n in zip(dev_batch.student.input_ids, prompt_lengths, strict=True)]
        params = SamplingParams(
            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=run.recipe.train.sample_max_new_tokens
        )
        generator = HFGenerator(run.engine.module.student, run.tokenizer, params, batch_size=count)
        seeds = [sampling_seed(run.recipe.seed, "dev-samples", step, row) for row in range(count)]
        completions = {c.position: c for batch in generator.generate(prompts, seeds) for c in batch}
        return [
            {
                "prompt": str(run.tokenizer.decode(prompts[row], skip_special_tokens=True)),
                "generation": completion_text(run.tokenizer, completions[row].token_ids),
            }
            for row in range(count)
        ]

    def train(self) -> Path:
        run, recipe, reporter = self.run, self.run.recipe, self.reporter
        start = 0
        if run.resume_from is not None:
            start = checkpointing.load_checkpoint(run.engine, run.resume_from).step
            resume_rules.check_resume_length(start, run.total_steps, recipe, run.resume_from)
            # The recipe's rates (a resume may lower them) under the schedule for its length.
            engines.restart_schedule(run.engine, recipe.train, start, run.total_steps)
            if run.off_policy is not None:
                run.off_policy.restore(run.resume_from)
            reporter.message(f"resumed from {run.resume_from} at step {start}")
            for line in run.selector.restore(start) if run.selector is not None else ():
                log.info(line)
        metrics = MetricsLog(run.output_dir / "metrics.jsonl", resume_step=start if run.resume_from else None)
        # train.report_to: every record metrics.jsonl gets also goes to these (main process only).
        trackers = tracking.open_trackers(
            recipe.train.report_to,
            run.output_dir,
            name=recipe.name,
            run_id=run.run_id,
            resume_step=start if run.resume_from else None,
        )
        trackers.log_config(recipe.model_dump(mode="json"))
        main = run.rank == 0
        reporter.start("distill", run.total_steps, completed=start, unit="steps")
        # from_pretrained returns the student in eval mode: dropout must be on from the first step.
        run.engine.train()
        try:
            if run.dev is not None and start == 0:  # the baseline later dev losses compare with
                self._evaluate_and_log(0, metrics, trackers)
            window = LossWindow()
            peak_flops = utilisation.device_peak_flops(run.device)  # None on a CPU: mfu null
            for step in range(start, run.total_steps):
                window.add(self.step(step))
                done = step + 1
                reporter.advance(1)
                if run.off_policy is not None and recipe.train.save_generated:
                    run.off_policy.write_generated(run.output_dir, done)
                if done % recipe.train.log_interval == 0 or done == run.total_steps:
                    record = window.record(
                        done,
                        lr=run.engine.get_lr()[0],
                        sum_over_processes=_sum_over_processes,
                        world_size=run.world_size,
                    )
                    if run.off_policy is not None:
                        record.update(run.off_policy.log_fields())
                    record["mfu"] = utilisation.mfu(record["flops_per_s"], peak_flops, run.world_size)
                    if main:
                        metrics.write(record)
                        trackers.log(record)
                    reporter.record(record)
                    window = LossWindow()
                # Also at the last step when it is off the interval: every run ends with a dev loss.
                if run.dev is not None and (done % recipe.train.eval_interval == 0 or done == run.total_steps):
                    self._evaluate_and_log(done, metrics, trackers)
                if done % recipe.train.save_interval == 0 and done < run.total_steps:
                    self.save(done)
                self.stop_if_requested(done)
            if recipe.train.checkpoint_at_end:
                self.save(run.total_steps)
            if run.selector is not None and (note := run.selector.closing_note()) is not None:
                log.warning(note)
                reporter.message(note)
            return checkpointing.save_final(run.engine, run.tokenizer, recipe, run.output_dir)
        except BaseException:
            trackers.close(failed=True)
            raise
        finally:
            trackers.close()  # a no-op after a failure
            reporter.stop()

    def _evaluate_and_log(self, step: int, metrics: MetricsLog, trackers: tracking.Trackers) -> None:
        with self.run.precision.context():  # dev loss and samples: bf16 products in a CPU bf16 run
            record = self.evaluate(step)
        if self.run.rank == 0:
            metrics.write(record)
            trackers.log(record)
        self.reporter.record(record)
        if self.run.selector is not None:  # after metrics.jsonl has the record best/ is chosen on
            self.run.selector.consider(step, record, self.run.engine)

    def save(self, step: int) -> Path:
        state = checkpointing.TrainerState(step=step, total_steps=self.run.total_steps, run_id=self.run.run_id)
        extra = self.run.off_policy.save if self.run.off_policy is not None else None
        with self.stops.saving():  # timed, for a SIGTERM's budget; a signal lets it finish
            path = checkpointing.save_checkpoint(
                self.run.engine, self.run.tokenizer, self.run.recipe, self.run.output_dir, state, extra_state=extra
            )
        self.saved = (step, path)
        return path

    def stop_if_requested(self, done: int) -> None:
        """After step ``done`` (every rank): on a SIGUSR1 or SIGTERM any rank received, write a
        checkpoint of ``done`` (unless one was just written, or a SIGTERM's budget does not allow
        it) and raise ``RunStopped`` (``mta.training.lifecycle.stopping``)."""
        self.stops.steps_done = done
        code, waited_s = self.stops.agreed_request()
        if not code:
            return
        name = stopping.signal_name(code)
        if self.saved is None or self.saved[0] != done:
            reason = self.stops.refusal(code, waited_s)
            if reason is not None:
                raise stopping.RunStopped(name, step=done, reason=reason)
            self.save(done)
        assert self.saved is not None, "save() records the checkpoint it wrote"
        raise stopping.RunStopped(name, step=done, checkpoint=self.saved[1])


def _sum_over_processes(values: dict[str, float]) -> dict[str, float]:
    names = sorted(values)
    return dict(zip(names, distributed.sum_over_ranks([values[name] for name in names]), strict=True))


def run_distillation(
    recipe: Recipe,
    resume: str | None = None,
    reporter: Reporter | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Train the recipe's student; returns the ``final/`` directory (Hugging Face format).

    resume: None (a new run: ``output_dir`` must hold no other run's outputs), ``"auto"`` (the
    newest complete checkpoint of ``output_dir`` if there is one, else a new run) or a checkpoint
    directory. overwrite: remove the outputs of the run in ``output_dir`` first (its caches stay);
    see ``mta.training.lifecycle.run_directory``. Several runs may follow each other in one process: each
    builds its own engine and releases it at the end.

    Rank 0 holds ``output_dir``'s lock from the claim until ``final/`` is written (a second run
    into it is refused). SIGUSR1, and SIGTERM when a checkpoint fits its budget, stop the run
    after the current step with a checkpoint of it; a SIGTERM without that time stops it at once:
    both raise ``mta.training.lifecycle.stopping.RunStopped``.
    """
    reporter = reporter or SilentReporter()
    tracking.require(recipe.train.report_to)  # a tracker not installed stops the run before any work
    if recipe.train.push_to_hub and distributed.is_main():
        from mta.models.push import require_hub

        require_hub("train.push_to_hub")  # an offline or unreachable Hub stops the run before any work
    output_dir = recipe.resolve(recipe.output_dir, "output_dir")
    stops = stopping.StopRequests()
    # SIGUSR1 / SIGTERM stop the run (stopping.RunStopped) from before the claim, and the
    # claim's lock on output_dir is held until final/ is written or the run ends otherwise.
    with stops.installed():
        try:
            run = build_run(recipe, reporter, resume=resume, overwrite=overwrite)
            for message in run.messages:
                log.info(message)
                reporter.message(message)
            try:
                final = Trainer(run, reporter, stops=stops).train()
            finally:
                run.close()
            if recipe.train.push_to_hub and distributed.is_main():
                from mta.models.push import push_run_exports

                for url in push_run_exports(output_dir, recipe.train.push_to_hub):
                    reporter.message(f"pushed: {url}")
            return final
        finally:
            run_directory.release(output_dir)
