"""What a run records: ``metrics.jsonl``, one line per log step (people see it through a ``Reporter``).

``metrics.jsonl`` holds one JSON object per log step::

    {"split": "train", "step": 20, "loss": 3.1, "loss/base": 2.9, "loss/dsa": 0.05,
     "loss/hra": 0.4, "lr": 9.8e-05, "grad_norm": 0.83, "tokens_per_s": 5120.0,
     "flops_per_s": 1.9e11, "mfu": null}
    {"split": "dev", "step": 100, "loss": ..., "loss/base": ..., "samples": [{"prompt": ..., "generation": ...}]}

On resume the lines past the checkpoint's step are dropped, so the file never describes steps
twice.

``grad_norm`` is the gradient's 2-norm before clipping (``mta.training.engine.step_gradient_norm``:
the same on every process), averaged over the steps since the last line like the losses; null
when a step's norm is unknown or not finite (an fp16 step that overflowed and was skipped).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mta.files import atomic_write_text


def loss_record(split: str, step: int, losses: dict[str, float]) -> dict[str, Any]:
    """``{"split", "step", "loss": total, "loss/<component>": ...}`` from ``{"total", ...}``."""
    record: dict[str, Any] = {"split": split, "step": step, "loss": losses["total"]}
    record.update({f"loss/{name}": value for name, value in losses.items() if name != "total"})
    return record


class LossWindow:
    """Loss components, gradient norms, tokens and model FLOPs since the last log line; losses and
    norms averaged per step when logged, tokens and FLOPs per second
    (``mta.training.lifecycle.utilisation`` counts the FLOPs)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = 0
        self.tokens: float = 0
        self.flops = 0.0
        self.grad_norms: list[float] = []
        self.since = time.perf_counter()

    def add(self, step_losses: dict[str, float]) -> None:
        """One step's ``{"total", components..., "tokens"}`` (and ``"flops"`` and ``"grad_norm"``,
        when measured)."""
        self.tokens += step_losses["tokens"]
        self.flops += step_losses.get("flops", 0.0)
        if "grad_norm" in step_losses:
            self.grad_norms.append(step_losses["grad_norm"])
        self.steps += 1
        for name, value in step_losses.items():
            if name not in ("tokens", "flops", "grad_norm"):
                self.sums[name] = self.sums.get(name, 0.0) + value

    def record(
        self,
        step: int,
        *,
        lr: float,
        sum_over_processes: Callable[[dict[str, float]], dict[str, float]] = dict,
        world_size: int = 1,
    ) -> dict[str, Any]:
        """The train line for ``step``: losses averaged over steps and processes, tokens summed."""
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        totals = sum_over_processes({**self.sums, "tokens": float(self.tokens), "flops": self.flops})
        tokens, flops = totals.pop("tokens"), totals.pop("flops")
        record = loss_record("train", step, {k: v / (self.steps * world_size) for k, v in totals.items()})
        record["lr"] = lr
        if self.grad_norms:  # one norm for all processes: not summed over them
            norm = sum(self.grad_norms) / len(self.grad_norms)
            record["grad_norm"] = norm if math.isfinite(norm) else None
        record["tokens_per_s"] = tokens / elapsed
        record["flops_per_s"] = flops / elapsed
        return record


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (flushed per line, so a crash loses at most one)."""

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            path.unlink(missing_ok=True)
        elif path.exists():
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and (record := _parse(line)) is not None and record["step"] <= step
        ]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def _parse(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:  # the half-written last line of a killed run
        return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a ``metrics.jsonl``."""
    return [
        record
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and (record := _parse(line)) is not None
    ]
