"""DistiLLM's adaptive off-policy sampling: which micro batches train on the student's own text.

The recipe's ``off_policy:`` section picks the mode (``off``, ``always``, ``adaptive``). The rule,
its threshold update and how it differs from the published code: docs/method.md §5 and §8. Every
draw is keyed by ``(seed, step, k)`` (the buffer's by rank too), never a global stream, so all
ranks take the same branch (a ZeRO-3 forward needs them all) and a resumed run makes the
uninterrupted run's decisions. State is stored as JSON (``write_state``), never pickled.
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
