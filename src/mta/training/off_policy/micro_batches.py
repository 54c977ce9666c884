"""Where each micro batch of an off-policy run comes from: the gold rows, the student's own
samples of their prompts, or the replay buffer (``mta.training.off_policy.policy`` decides which).

``OffPolicyBatches.batch(step, k, rows, gold)`` returns the micro batch to train on. For a
*generated* one, the student (possibly in the middle of a ZeRO-3 step, see ``mta.generation``)
samples a response to each gold row's prompt — every rank generates together, since every rank
takes the same decision — and the batch's tokens are those ids at once (labels on the response
tokens only, as for annotated rows), while the spans of prompt + response are parsed by
``mta.data.online_spans`` (the code of ``mta annotate``, on the ids the models see) in worker
processes. Such a batch comes back with its spans pending (``TrainBatch.pending_spans``, a
``GeneratedMicroBatch``); the trainer runs the teacher forward meanwhile and then asks for them,
explicitly, with ``with_spans(batch)`` before the student's forward and loss. The parsed rows
are settled once (at ``with_spans``, or at the latest before the next micro batch is decided,
before logging and before saving): checked to hold exactly the ids trained on, pushed into the
buffer and kept for ``save_generated``. Each rank keeps its own buffer (``replay_buffer``).
State (threshold, counts) and buffers are saved with every checkpoint as JSON and Parquet
(``save`` / ``restore``), never pickled; ``train.save_generated`` also writes each step's
generated and replayed rows to ``OUT/generated/``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from mta import distributed
from mta.data.artefact_schema import ID, INPUT_IDS, PROMPT_CHARS, PROMPT_LEN, TEXT
from mta.data.online_spans import GeneratedRow, PendingSpans, SpanParser
from mta.errors import MtaError
from mta.generation import HFGenerator
from mta.losses.span_masks import SpanBatch
from mta.training.batching import AnnotatedExamples, TrainBatch
from mta.training.config.schema import Recipe
from mta.training.off_policy import policy
from mta.training.off_policy.replay_buffer import (
    ReplayBuffer,
    agreed_buffer_flags,
    buffer_file,
    rows_table,
    write_generated_rows,
)

GENERATED_DIR = "generated"


class ExampleOptions(TypedDict):
    """How this run's rows become ``AnnotatedExamples`` (its keyword arguments)."""

    student_pad_id: int
    teacher_pad_id: int
    with_teacher: bool
    granularities: tuple[str, ...]


@dataclass
class GeneratedMicroBatch:
    """A generated micro batch in training while the span workers parse its rows: the handle a
    batch carries as ``TrainBatch.pending_spans`` until ``OffPolicyBatches.with_spans``."""

    step: int
    micro_batch: int
    tokens: TrainBatch  # the ids as generated, what the models see
    pending: PendingSpans
    spans: Mapping[str, SpanBatch] | None = None  # set once parsed and settled


class OffPolicyBatches:
    """The off-policy part of a run: decisions, generation, spans, buffer, their checkpoints.

    recipe: the run's recipe (``off_policy:`` is on); table: the training artefact's rows (for
    each row's prompt text and ids); model: the student being trained (the engine's module);
    pad_ids: ``{"student": id, "teacher": id}``; granularities: the span kinds the loss reads;
    parser: a started ``SpanParser``; total_steps: the run's length.
    """

    def __init__(
        self,
        recipe: Recipe,
        table: pa.Table,
        *,
        model: Any,
        tokenizer: Any,
        pad_ids: dict[str, int],
        with_teacher: bool,
        granularities: tuple[str, ...],
        parser: SpanParser,
        total_steps: int,
    ):
        self.recipe = recipe
        self.model = model
        self.spec = recipe.off_policy
        self.state = policy.OffPolicyState.initial(self.spec)
        self.buffer = ReplayBuffer(self.spec.buffer_size) if self.spec.mode == "adaptive" else None
        self.parser = parser
        self.tokenizer = tokenizer
        self.total_steps = total_steps
        self.params = policy.generation_params(recipe)
        self._examples = ExampleOptions(
            student_pad_id=pad_ids["student"],
            teacher_pad_id=pad_ids["teacher"],
            with_teacher=with_teacher,
            granularities=granularities,
        )
        self._ids = table.column(ID).to_numpy()
        self._texts = table.column(TEXT)
        self._prompt_chars = table.column(PROMPT_CHARS).to_numpy()
        self._student_ids = table.column(INPUT_IDS["student"])
        self._prompt_len = table.column(PROMPT_LEN["student"]).to_numpy()
        self._saved: list[tuple[list[dict], int, str]] = []  # (rows, micro batch, source) of this step
        self._parsing: GeneratedMicroBatch | None = None  # the last generated micro batch, until settled
        self.window = {"generated_tokens": 0, "generation_s": 0.0, "span_wait_s": 0.0}
        self._counted = dict(self.state.micro_batches)  # the counts at the last log line

    # ------------------------------------------------------------------ one micro batch

    def batch(self, step: int, micro_batch: int, rows: np.ndarray, gold: TrainBatch) -> tuple[TrainBatch, str]:
        """The micro batch to train on in place of ``gold`` (table positions ``rows``), and its
        source: ``"gold"``, ``"generated"`` or ``"buffer"``. A generated batch's spans are being
        parsed: it holds none yet (``pending_spans`` is set) until ``with_spans``."""
        self.settle()
        full, empty = agreed_buffer_flags(self.buffer) if self.buffer is not None else (False, True)
        source = policy.decide(
            self.state, self.spec, step, self.total_steps, micro_batch, full, empty, self.recipe.seed
        )
        self.state = self.state.count(source)
        if source == "gold":
            return gold, source
        if source == "buffer":
            # policy.decide draws from the buffer only when every rank has one that is not empty.
            assert self.buffer is not None, "a buffer source without a replay buffer (off_policy.mode is not adaptive)"
            generator = policy.buffer_generator(self.recipe.seed, step, micro_batch, distributed.rank())
            sampled = self.buffer.sample(len(rows), generator)
            if self.recipe.train.save_generated:
                self._saved.append((sampled, micro_batch, source))
            examples = AnnotatedExamples(rows_table(sampled), **self._examples)
            return replace(examples.batch(np.arange(len(examples))), origin=source), source
        generated = self._generate(step, rows)
        tokens = self._token_batch(generated)
        self._parsing = GeneratedMicroBatch(step, micro_batch, tokens, self.parser.submit(generated))
        return replace(tokens, pending_spans=self._parsing, origin=source), source

    def with_spans(self, batch: TrainBatch) -> TrainBatch:
        """``batch`` with its spans, on its device: a generated micro batch's are waited for here
        (parsed since it was generated) and its rows settled; any other batch is returned as is."""
        if batch.pending_spans is None:
            return batch
        spans = self._parsed(batch.pending_spans)
        device = batch.student.input_ids.device
        return replace(batch, spans={name: s.to(device) for name, s in spans.items()}, pending_spans=None)

    def settle(self) -> None:
        """Wait for the last generated micro batch's rows, if not yet, and file them: into the
        buffer and, with ``save_generated``, the rows of this step."""
        parsing, self._parsing = self._parsing, None
        if parsing is not None:
            self._parsed(parsing)

    def _parsed(self, parsing: GeneratedMicroBatch) -> Mapping[str, SpanBatch]:
        """The spans of ``parsing`` (waiting for them once), its rows settled."""
        if parsing.spans is not None:
            return parsing.spans
        started = time.perf_counter()
        result = parsing.pending.result()
        self.window["span_wait_s"] += time.perf_counter() - started
        table = rows_table(result.batch)
        parsed = AnnotatedExamples(table, **self._examples).batch(np.arange(table.num_rows))
        _check_same_tokens(parsed, parsing.tokens)
        rows = table.to_pylist()
        if self.buffer is not None:
            self.buffer.push(rows, parsing.step)
        if self.recipe.train.save_generated:
            self._saved.append((rows, parsing.micro_batch, "generated"))
        parsing.spans = parsed.spans
        return parsed.spans

    def _generate(self, step: int, rows: np.ndarray) -> list[GeneratedRow]:
        """The student's responses to the prompts of table rows ``rows``, EOS kept when it stopped."""
        prompts = [self._student_ids[int(row)].values.to_numpy()[: self._prompt_len[row]].tolist() for row in rows]
        seeds = policy.generation_seeds(self.recipe.seed, step, [int(self._ids[row]) for row in rows])
        started = time.perf_counter()
        generator = HFGenerator(self.model, self.tokenizer, self.params, batch_size=len(rows))
        completions = sorted(
            (c for batch in generator.generate(prompts, seeds) for c in batch), key=lambda c: c.position
        )
        self.window["generation_s"] += time.perf_counter() - started
        eos = self.tokenizer.eos_token_id
        generated = []
        for completion, row, prompt_ids in zip(completions, rows, prompts, strict=True):
            text = self._texts[int(row)].as_py()
            ids = completion.token_ids + ([eos] if completion.finished else [])
            self.window["generated_tokens"] += len(ids)
            generated.append(
                GeneratedRow(
                    text[: self._prompt_chars[row]],
                    prompt_ids,
                    ids,
                    finished=completion.finished,
                    id=int(self._ids[row]),
                )
            )
        return generated

    def _token_batch(self, generated: list[GeneratedRow]) -> TrainBatch:
        """The tokens of generated rows as a batch without spans: prompt + response ids on both
        sides (the teacher shares the tokenizer), labels on the response."""
        ids = [np.concatenate([row.prompt_ids, row.generated_ids]) for row in generated]
        prompt_len = [len(row.prompt_ids) for row in generated]
        table = pa.table(
            {
                ID: [row.id for row in generated],
                **{INPUT_IDS[side]: ids for side in ("student", "teacher")},
                **{PROMPT_LEN[side]: prompt_len for side in ("student", "teacher")},
            }
        )
        examples = AnnotatedExamples(table, **(self._examples | {"granularities": ()}))
        return examples.batch(np.arange(len(generated)))

    # ------------------------------------------------------------------ the run around it

    def update_threshold(self, dev_cross_entropy: float) -> None:
        """After a dev evaluation: DistiLLM's threshold rule on the dev cross-entropy."""
        self.state = policy.update_threshold(self.state, self.spec, policy.agreed_dev_loss(dev_cross_entropy))

    def log_fields(self) -> dict[str, float]:
        """The generation fields of a train record, for the window since the last one: τ (in
        adaptive mode), the micro batches of each source, generated tokens per second of generation, and the seconds
        the process waited for spans."""
        self.settle()
        counts = self.state.micro_batches
        fields = {
            **({"off_policy/threshold": self.state.threshold} if self.spec.mode == "adaptive" else {}),
            **{f"off_policy/{source}": float(counts[source] - self._counted[source]) for source in counts},
            "off_policy/tokens_per_s": self.window["generated_tokens"] / max(self.window["generation_s"], 1e-9),
            "off_policy/span_wait_s": self.window["span_wait_s"],
        }
        self._counted = dict(counts)
        self.window = {"generated_tokens": 0, "generation_s": 0.0, "span_wait_s": 0.0}
        return fields

    def write_generated(self, output_dir: Path, step: int) -> None:
        """``train.save_generated``: this rank's generated and replayed rows of ``step``."""
        self.settle()
        if not self._saved:
            return
        rows = [row for sampled, _, _ in self._saved for row in sampled]
        extra: dict[str, list[int] | list[str]] = {
            "micro_batch": [k for sampled, k, _ in self._saved for _ in sampled],
            "source": [source for sampled, _, source in self._saved for _ in sampled],
        }
        path = output_dir / GENERATED_DIR / f"step-{step:06d}-rank-{distributed.rank()}.parquet"
        write_generated_rows(path, rows, [step] * len(rows), extra=extra)
        self._saved = []

    def save(self, checkpoint: Path) -> None:
        """Into a checkpoint being written (every rank calls): the state and this rank's buffer."""
        self.settle()
        if distributed.is_main():
            policy.write_state(checkpoint / policy.STATE_FILE, self.state)
        if self.buffer is not None:
            self.buffer.write(checkpoint / buffer_file(distributed.rank()))

    def restore(self, checkpoint: Path) -> None:
        """The state and this rank's buffer as ``save`` wrote them into ``checkpoint``."""
        self.state = policy.read_state(checkpoint / policy.STATE_FILE)
        self._counted = dict(self.state.micro_batches)
        if self.buffer is not None:
            self.buffer = ReplayBuffer.read(checkpoint / buffer_file(distributed.rank()), self.spec.buffer_size)


def _check_same_tokens(parsed: TrainBatch, trained: TrainBatch) -> None:
    """The parsed rows must hold exactly the ids the models were given (a tokenizer mismatch
    between the trainer and the span workers would misplace every span)."""
    sides = [("student", parsed.student, trained.student)]
    if parsed.teacher is not None and trained.teacher is not None:  # both or neither: the same ExampleOptions
        sides.append(("teacher", parsed.teacher, trained.teacher))
    for side, a, b in sides:
        if (
            a.input_ids.shape != b.input_ids.shape
            or not torch.equal(a.input_ids, b.input_ids)
            or not torch.equal(a.labels, b.labels)
        ):
            raise MtaError(
                f"the span workers returned {side} ids that differ from the ids generated for rows "
                f"{trained.row_ids}; the workers' tokenizer is not the trainer's (report this as a bug)"
            )


@torch.no_grad()
def dev_cross_entropy(student: torch.nn.Module, batches: list[TrainBatch], device: torch.device) -> float:
    """The student's token-mean cross-entropy on the dev reference responses (what DistiLLM's
    threshold rule reads), over ``batches``, summed over ranks."""
    total, tokens = 0.0, 0
    for batch in batches:
        batch = batch.to(device)
        logits = student(input_ids=batch.student.input_ids, attention_mask=batch.student.attention_mask).logits
        labels = batch.student.labels[:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        ).item()
        tokens += int((labels != -100).sum())
    summed_total, summed_tokens = distributed.sum_over_ranks([total, float(tokens)])
    return summed_total / max(summed_tokens, 1.0)
