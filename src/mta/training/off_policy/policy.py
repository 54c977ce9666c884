"""DistiLLM's adaptive off-policy sampling: which micro batches train on the student's own text.

The recipe's ``off_policy:`` section (``mta.training.config.schema.OffPolicySpec``) picks a mode:

- ``off`` (the default): every micro batch is the reference ("gold") micro batch.
- ``always``: every micro batch is generated: the student samples responses for the micro
  batch's prompts and trains on them (on-policy distillation; tests). The buffer is not used.
- ``adaptive``: DistiLLM's adaptive student-generated-output (SGO) scheduler, below.

**Adaptive.** State (``OffPolicyState``): a threshold τ (``init_threshold``, 0.0), the reference
dev loss L₀ and a FIFO replay buffer of generated rows (``replay_buffer.ReplayBuffer``,
``buffer_size`` rows, 1000). For micro batch ``k`` of optimizer step ``step`` (0-based, as
``Trainer.step`` gets it) of
``T`` steps, with ``t = step + 1`` (the published 1-based ``global_step``):

1. draw ``r ~ U[0, 1)`` (``draw``) and take the schedule value ``s`` (``schedule_value``):
   ``τ·(1 − t/T)`` (``decreasing``, the default), ``τ/2`` (``constant``) or ``τ·t/T``
   (``increasing``);
2. if ``r < s``, or ``r < τ`` while the buffer is not full: generate responses for the micro
   batch's prompts, push them into the buffer and train on them (``"generated"``);
3. else if ``r < τ``: train on ``micro_batch_size`` rows drawn uniformly, without replacement,
   from the buffer (``"buffer"``);
4. else: the reference micro batch (``"gold"``).

At each dev evaluation (``update_threshold``) with dev loss L (the student's cross-entropy on the
dev reference responses): the first evaluation sets L₀ = L; afterwards, if L ≥ L₀ + ``loss_eps``
then τ ← min(τ + ``threshold_step``, 1) and L₀ ← L (L₀ moves only when τ is raised). So τ, and
with it the share of generated text, grows while the student gets worse on the reference.

**Ranks.** ``r`` is a pure function of ``(seed, step, k)``, the same on every rank, so under
ZeRO-3 every rank generates in the same micro batches (a forward needs all ranks). Each rank keeps
its own buffer (its own generated rows); a draw from it uses a stream keyed by
``(seed, step, k, rank)`` (``buffer_generator``). ``decide``'s ``buffer_full`` / ``buffer_empty``
must also be the same on every rank (agreed over ranks by the caller): then every rank takes the
same branch. Everything is keyed, nothing reads a global random stream, so a resumed run makes
exactly the decisions an uninterrupted one makes (given the saved state and buffers).

**Stored state** is never pickled: ``OffPolicyState.to_json`` (``write_state`` / ``read_state``)
and the buffer as a Parquet file of the annotate artefact's columns plus ``step``
(``replay_buffer``: ``ReplayBuffer.write`` / ``read``; ``write_generated_rows`` /
``read_generated_rows`` for any generated rows).

**Where the published code differs** (``jongwooko/distillm`` ``finetune.py``,
``distillm/buffer.py``, ``distillm/sampler.py``; ``wind123mountain/MTA``
``distillm-master/span_finetune.py`` repeats the same loop), and what is done here:

- *The draw.* Published: ``np.random.uniform(0, 1)`` from the global NumPy stream, seeded with
  ``seed + rank`` (``utils.set_random_seed``), so ranks draw different ``r`` and may take
  different branches in the same micro batch; the stream also depends on everything drawn
  before. Here: keyed, the same on every rank, independent of history.
- *The buffer condition* is "not full" (``len(replay_buffer) < args.capacity``) there and here.
  ``buffer_empty`` is only a guard (the published rule never draws from an unfilled buffer).
- *The buffer draw* is ``random.sample(replay_memory, k=batch_size)`` there: uniform, without
  replacement, from Python's global stream. Here: without replacement, from the keyed stream.
- *The buffer* holds padded tensors (ids, attention mask, position ids, labels; MTA's copy also
  the prompt) in memory only there, so a restarted run starts with an empty buffer, τ back at
  ``init_threshold`` and L₀ measured again. Here: annotate rows (spans included), saved with
  each checkpoint together with τ and L₀.
- *L₀* is the dev loss evaluated at step 0, before training, in both. It is updated only when τ
  is raised (``prev_avg_loss = curr_avg_loss`` inside the ``if``), also when τ is already capped
  at 1; the same here. Here the first ``update_threshold`` call sets it (the trainer's step-0 dev
  evaluation, or the first one after a resume that added ``data.dev``).
- *The step of τ* is hard-coded there (``adaptive_threshold += 0.1``); here ``threshold_step``
  (default 0.1). The sum is rounded to 12 decimals so ten steps of 0.1 reach exactly 1.0
  (floating point sums reach 0.9999999999999999).
- *The schedule's step* is the published 1-based ``global_step``; with gradient accumulation
  it advances one micro batch early there (``step`` starts at 1 and is incremented before the
  accumulation check), so one micro batch per optimizer step sees the next step's ``t``. Here
  every micro batch of optimizer step ``step`` uses ``t = step + 1``.
- *The dev loss* there is the CE over the whole dev set (mean of per-batch token means, averaged
  over ranks), every ``eval_interval`` steps (the scripts: once per epoch). Here it is what the
  caller passes; it must be the same number on every rank.
- *``mode: always``* does not exist there. The nearest is the ``mixed`` type (with probability
  ``mixed_alpha`` generate, push, then train on a buffer draw), not implemented here. ``off`` is
  a run without ``--student-gen`` or without ``adaptive`` in ``--type``.
- *Sampling* there: ``do_sample``, top_k 0, top_p 1 (``--gen-top-p``), temperature 1, at most
  ``max_length - max_prompt_length`` new tokens; the same here (``generation_params``), through
  the keyed sampler of ``mta.generation``. The published sampler drops every pad id from the
  response and its tokenizers use EOS as pad, so its generated responses never end in EOS.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from mta import distributed
from mta.errors import MtaError
from mta.files import atomic_write_json
from mta.generation.sampling import SamplingParams, sampling_seed
from mta.training.config.schema import OffPolicySchedule, OffPolicySpec, Recipe

Source = Literal["gold", "generated", "buffer"]
SOURCES: tuple[str, ...] = get_args(Source)

# sampling_seed purposes: no other stream shares them.
DRAW_PURPOSE = "off-policy/draw"  # r of micro batch k of a step, the same on every rank
BUFFER_PURPOSE = "off-policy/buffer/rank-{rank}"  # a rank's draw of rows from its buffer
GENERATE_PURPOSE = "off-policy/generate"  # the noise of a generated response, keyed by its row id

STATE_FORMAT = "mta.off_policy.state/1"

_UNIT = 2.0**-53

# The suggested name inside a checkpoint directory (the checkpoint's owner decides where it goes).
STATE_FILE = "off_policy_state.json"  # written by rank 0: the state is the same on every rank


# --------------------------------------------------------------------------- the decision


def draw(seed: int, step: int, micro_batch: int) -> float:
    """``r ~ U[0, 1)`` of micro batch ``micro_batch`` of optimizer step ``step`` (0-based).

    The top 53 bits of ``sampling_seed(seed, DRAW_PURPOSE, step, micro_batch)`` over ``2**53``:
    a pure function of its arguments, the same on every rank, machine and resume.
    """
    return (sampling_seed(seed, DRAW_PURPOSE, step, micro_batch) >> 10) * _UNIT


def schedule_value(schedule: OffPolicySchedule, threshold: float, step: int, total_steps: int) -> float:
    """``s``: the part of ``threshold`` below which a draw generates even with a full buffer.

    ``t = step + 1`` (the optimizer step being trained, 1-based as the published ``global_step``)
    of ``total_steps``: ``decreasing`` τ·(1 − t/T), ``constant`` τ/2, ``increasing`` τ·t/T.
    """
    if total_steps < 1 or not 0 <= step < total_steps:
        raise ValueError(f"step {step} is not a step of a {total_steps}-step run")
    progress = (step + 1) / total_steps
    if schedule == "decreasing":
        return threshold * (1 - progress)
    if schedule == "constant":
        return threshold * 0.5
    if schedule == "increasing":
        return threshold * progress
    raise ValueError(f"unknown off_policy.schedule {schedule!r}")


def choose(r: float, threshold: float, generate_below: float, buffer_full: bool) -> Source:
    """The adaptive rule for one draw ``r``: generate if ``r < generate_below`` (the schedule
    value) or ``r < threshold`` with the buffer not full; a buffer draw if ``r < threshold``;
    else the reference micro batch."""
    if r < generate_below or (r < threshold and not buffer_full):
        return "generated"
    if r < threshold:
        return "buffer"
    return "gold"


def decide(
    state: OffPolicyState,
    spec: OffPolicySpec,
    step: int,
    total_steps: int,
    micro_batch: int,
    buffer_full: bool,
    buffer_empty: bool,
    seed: int,
) -> Source:
    """What micro batch ``micro_batch`` of optimizer step ``step`` (0-based) trains on.

    ``off``: ``"gold"``; ``always``: ``"generated"``; ``adaptive``: ``choose`` on
    ``draw(seed, step, micro_batch)`` with τ = ``state.threshold``. ``buffer_full`` /
    ``buffer_empty`` must be the same on every rank (full on every rank / empty on some rank), so
    every rank decides the same; a ``"buffer"`` decision on an empty buffer becomes
    ``"generated"``. Pure: the same arguments give the same answer everywhere.
    """
    if spec.mode == "off":
        return "gold"
    if spec.mode == "always":
        return "generated"
    threshold = state.threshold
    source = choose(
        draw(seed, step, micro_batch),
        threshold,
        schedule_value(spec.schedule, threshold, step, total_steps),
        buffer_full,
    )
    if source == "buffer" and buffer_empty:
        return "generated"
    return source


# --------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class OffPolicyState:
    """What the adaptive scheduler carries from step to step (the same on every rank).

    threshold: τ. reference_loss: L₀, None until the first dev loss. dev_evaluations: dev losses
    seen. threshold_raises: how often τ rose. micro_batches: micro batches trained per source
    (``count``), for the log.
    """

    threshold: float
    reference_loss: float | None = None
    dev_evaluations: int = 0
    threshold_raises: int = 0
    micro_batches: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0), hash=False)

    @classmethod
    def initial(cls, spec: OffPolicySpec) -> OffPolicyState:
        """The state at step 0: τ = ``init_threshold``, no L₀ yet."""
        return cls(threshold=spec.init_threshold)

    def count(self, source: Source) -> OffPolicyState:
        """This state with one more micro batch trained on ``source``."""
        if source not in SOURCES:
            raise ValueError(f"unknown source {source!r}; one of {SOURCES}")
        counts = dict(self.micro_batches)
        counts[source] += 1
        return replace(self, micro_batches=counts)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready mapping; ``from_json`` reads it back to an equal state (floats exactly)."""
        return {
            "format": STATE_FORMAT,
            "threshold": self.threshold,
            "reference_loss": self.reference_loss,
            "dev_evaluations": self.dev_evaluations,
            "threshold_raises": self.threshold_raises,
            "micro_batches": {source: self.micro_batches[source] for source in SOURCES},
        }

    @classmethod
    def from_json(cls, payload: Any) -> OffPolicyState:
        """The state ``to_json`` wrote; ``ValueError`` naming the first thing that is not."""
        if not isinstance(payload, dict) or payload.get("format") != STATE_FORMAT:
            found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(f"not an off-policy sampling state of format {STATE_FORMAT} (found {found!r})")
        expected = set(cls(0.0).to_json())
        if set(payload) != expected:
            raise ValueError(f"has the keys {sorted(payload)}, expected {sorted(expected)}")
        threshold = _finite(payload["threshold"], "threshold")
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold {threshold} is outside [0, 1]")
        reference = payload["reference_loss"]
        counts = payload["micro_batches"]
        if not isinstance(counts, dict) or set(counts) != set(SOURCES):
            raise ValueError(f"micro_batches must map {list(SOURCES)} to counts, got {counts!r}")
        return cls(
            threshold=threshold,
            reference_loss=None if reference is None else _finite(reference, "reference_loss"),
            dev_evaluations=_count(payload["dev_evaluations"], "dev_evaluations"),
            threshold_raises=_count(payload["threshold_raises"], "threshold_raises"),
            micro_batches={source: _count(counts[source], f"micro_batches.{source}") for source in SOURCES},
        )


def update_threshold(state: OffPolicyState, spec: OffPolicySpec, dev_loss: float) -> OffPolicyState:
    """The state after a dev evaluation with loss ``dev_loss`` (the same value on every rank).

    The first call sets L₀; later, ``dev_loss >= L₀ + loss_eps`` raises τ by ``threshold_step``
    (at most to 1, rounded to 12 decimals) and sets L₀ to ``dev_loss``; otherwise τ and L₀ stay.
    Outside ``adaptive`` the state is returned unchanged. A non-finite ``dev_loss`` is a
    ``ValueError``: NaN must never steer the threshold.
    """
    if spec.mode != "adaptive":
        return state
    if not math.isfinite(dev_loss):
        raise ValueError(f"the dev loss {dev_loss} is not finite; it cannot move the off-policy threshold")
    seen = replace(state, dev_evaluations=state.dev_evaluations + 1)
    if state.reference_loss is None:
        return replace(seen, reference_loss=float(dev_loss))
    if dev_loss >= state.reference_loss + spec.loss_eps:
        return replace(
            seen,
            threshold=min(round(state.threshold + spec.threshold_step, 12), 1.0),
            reference_loss=float(dev_loss),
            threshold_raises=state.threshold_raises + 1,
        )
    return seen


def write_state(path: str | Path, state: OffPolicyState) -> None:
    """Write ``state`` as JSON, atomically (``mta.files``)."""
    atomic_write_json(path, state.to_json())


def read_state(path: str | Path) -> OffPolicyState:
    """The state ``write_state`` wrote; ``MtaError`` naming the file if it is not one."""
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
        return OffPolicyState.from_json(payload)
    except FileNotFoundError as error:
        raise MtaError(f"{path}: the off-policy sampling state is missing") from error
    except (ValueError, UnicodeDecodeError) as error:
        raise MtaError(f"{path}: not a readable off-policy sampling state: {error}") from error


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a count (an integer >= 0), got {value!r}")
    return value


# --------------------------------------------------------------------------- keyed streams


def buffer_generator(seed: int, step: int, micro_batch: int, rank: int) -> np.random.Generator:
    """The stream rank ``rank`` draws micro batch ``micro_batch`` of step ``step`` from its buffer
    with: ``sampling_seed(seed, "off-policy/buffer/rank-<rank>", step, micro_batch)``."""
    return np.random.default_rng(sampling_seed(seed, BUFFER_PURPOSE.format(rank=rank), step, micro_batch))


def generation_seeds(seed: int, step: int, row_ids: Iterable[int | str]) -> list[int]:
    """The keyed-sampler seed of each generated response: ``sampling_seed(seed,
    "off-policy/generate", step, row id)``, so a row's sample does not depend on its batch."""
    return [sampling_seed(seed, GENERATE_PURPOSE, step, int(row_id)) for row_id in row_ids]


def generation_params(recipe: Recipe) -> SamplingParams:
    """How training responses are sampled: temperature 1, top_k 0, top_p 1 (the published
    ``SampleGenerator`` with the published scripts' flags), ``Recipe.off_policy_max_new_tokens``."""
    return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=recipe.off_policy_max_new_tokens)


# --------------------------------------------------------------------------- agreement over ranks


def agreed_dev_loss(dev_loss: float) -> float:
    """Rank 0's dev loss on every rank, for ``update_threshold``: every rank moves τ the same."""
    return float(distributed.broadcast_from_main(float(dev_loss)))
