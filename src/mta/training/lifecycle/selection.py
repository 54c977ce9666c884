"""Which student ``OUT/best/`` keeps: the best dev evaluation by ``train.select_by`` (``loss``:
the lowest dev loss; ``rouge``: the highest ``dev/rougeL`` of sampled responses on the first
``train.select_rows`` dev rows, the rows split over the ranks). The rule, ``best/selection.json``
and what a resume keeps: ARCHITECTURE.md, "2. distill". The main process decides, so every rank
exports together.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from mta import distributed
from mta.data.artefact_schema import PROMPT_CHARS, ROLE, TEXT
from mta.errors import MtaError
from mta.generation import HFGenerator, SamplingParams, sampling_seed
from mta.scoring import completion_text, rouge_l
from mta.training.config.schema import Recipe
from mta.training.lifecycle import checkpointing
from mta.training.lifecycle.metrics import read_metrics

log = logging.getLogger(__name__)

ROUGE_KEY = "dev/rougeL"
SAMPLING_PURPOSE = "select/dev-rouge"
GENERATION_BATCH_FACTOR = 4  # prompts per generation batch, in micro batches: no gradients kept


@dataclass(frozen=True)
class Criterion:
    """How a dev record is judged: ``select_by``, the metric's name (in selection.json), the
    record key holding it, and whether lower or higher is better."""

    select_by: str
    metric: str
    key: str
    goal: str  # "lowest" or "highest"

    def better(self, value: float, than: float | None) -> bool:
        if than is None:
            return True
        return value < than if self.goal == "lowest" else value > than


def criterion(select_by: str) -> Criterion:
    if select_by == "rouge":
        return Criterion("rouge", ROUGE_KEY, ROUGE_KEY, "highest")
    return Criterion("loss", "dev/loss", "loss", "lowest")


@dataclass(frozen=True)
class DevPrompts:
    """The dev rows ``select_by: rouge`` samples: prompt ids, references, their row positions."""

    prompts: list[list[int]]
    references: list[str]
    rows: list[int]

    @classmethod
    def from_table(cls, table: pa.Table, tokenizer: Any, *, count: int, max_prompt_length: int) -> DevPrompts:
        texts = table.column(TEXT).to_pylist()
        prompt_chars = table.column(PROMPT_CHARS).to_pylist()
        roles = table.column(ROLE).to_pylist() if ROLE in table.column_names else [None] * len(texts)
        rows = [i for i, role in enumerate(roles) if role != "rejected"][:count]
        prompts = [
            tokenizer(texts[i][: prompt_chars[i]], add_special_tokens=False)["input_ids"][:max_prompt_length]
            for i in rows
        ]
        references = [texts[i][prompt_chars[i] :].strip() for i in rows]
        return cls(prompts, references, rows)


def dev_rouge(
    model: Any, tokenizer: Any, prompts: DevPrompts, *, seed: int, max_new_tokens: int, batch_size: int
) -> float:
    """Mean ROUGE-L (x 100) of one sampled response per dev row, over every rank's share; every
    rank must call it (under ZeRO-3 each forward gathers from all ranks) and gets the same value."""
    rank, world = distributed.rank(), distributed.world_size()
    mine = list(range(rank, len(prompts.rows), world))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens)
    generator = HFGenerator(model, tokenizer, params, batch_size=batch_size)
    seeds = [sampling_seed(seed, SAMPLING_PURPOSE, 0, prompts.rows[i]) for i in mine]
    total = 0.0
    for batch in generator.generate([prompts.prompts[i] for i in mine], seeds):
        for completion in batch:
            index = mine[completion.position]
            total += rouge_l(completion_text(tokenizer, completion.token_ids), [prompts.references[index]])
    summed, count = distributed.sum_over_ranks([total, float(len(mine))])
    return summed / max(count, 1.0)


class Selector:
    """The run's best dev evaluation so far and ``OUT/best/``; built when the run has ``data.dev``."""

    def __init__(self, recipe: Recipe, output_dir: Path, run_id: str, *, dev_table: pa.Table, tokenizer: Any):
        self.recipe = recipe
        self.output_dir = Path(output_dir)
        self.run_id = run_id
        self.criterion = criterion(recipe.train.select_by)
        self.tokenizer = tokenizer
        self.best: tuple[int, float] | None = None  # (step, value)
        self.prompts = (
            DevPrompts.from_table(
                dev_table,
                tokenizer,
                count=recipe.train.select_rows,
                max_prompt_length=recipe.data.max_prompt_length,
            )
            if self.criterion.select_by == "rouge"
            else None
        )

    @property
    def directory(self) -> Path:
        return self.output_dir / checkpointing.BEST_DIR

    def measure(self, model: Any) -> dict[str, float]:
        """What the dev record adds for the criterion: ``{"dev/rougeL": ...}`` for rouge (every
        rank calls it), nothing for loss (the record's ``loss`` is the metric)."""
        if self.prompts is None:
            return {}
        data = self.recipe.data
        value = dev_rouge(
            model,
            self.tokenizer,
            self.prompts,
            seed=self.recipe.seed,
            max_new_tokens=data.max_length - data.max_prompt_length,
            batch_size=GENERATION_BATCH_FACTOR * self.recipe.train.micro_batch_size,
        )
        return {ROUGE_KEY: value}

    def consider(self, step: int, record: dict[str, Any], engine: Any) -> Path | None:
        """Export ``best/`` when the dev ``record`` of ``step`` beats the best so far; every rank
        calls it (the export gathers ZeRO-3 shards). Returns ``best/`` when written."""
        value = record.get(self.criterion.key)
        improved = step > 0 and value is not None and self.criterion.better(value, self.best and self.best[1])
        improved = distributed.broadcast_from_main(bool(improved))
        if not improved:
            return None
        value = float(distributed.broadcast_from_main(value))
        self.best = (step, value)
        return checkpointing.save_best(engine, self.tokenizer, self.recipe, self.output_dir, self.selection())

    def selection(self) -> dict[str, Any]:
        """What ``best/selection.json`` records for the best so far."""
        if self.best is None:
            raise MtaError("no dev evaluation has been the best yet: there is no selection to record")
        step, value = self.best
        payload = {
            "select_by": self.criterion.select_by,
            "metric": self.criterion.metric,
            "goal": self.criterion.goal,
            "value": value,
            "step": step,
            "run_id": self.run_id,
        }
        if self.prompts is not None:
            payload["rows"] = len(self.prompts.rows)
        return payload

    def restore(self, step: int) -> list[str]:
        """After a resume at ``step``: the best so far from ``metrics.jsonl`` (steps 1..step), and
        ``best/`` kept only when it is that evaluation's. Returns lines for the log."""
        messages: list[str] = []
        best: tuple[int, float] | None = None
        if distributed.is_main():
            best, messages = self._restore_on_main(step)
        self.best = distributed.broadcast_from_main(best)
        return messages

    def _restore_on_main(self, step: int) -> tuple[tuple[int, float] | None, list[str]]:
        metrics = self.output_dir / "metrics.jsonl"
        records = read_metrics(metrics) if metrics.is_file() else []
        best = best_step_of(records, self.criterion.select_by, up_to=step)
        stored = read_selection(self.directory)
        kept = (
            stored is not None
            and best is not None
            and stored.get("run_id") == self.run_id
            and stored.get("metric") == self.criterion.metric
            and stored.get("step") == best[0]
            and stored.get("value") == best[1]
        )
        messages = []
        if self.directory.exists() and not kept:
            shutil.rmtree(self.directory)
            what = f"step {stored.get('step')}" if stored else "no readable selection.json"
            messages.append(
                f"removed {self.directory} ({what}): it is not the best dev evaluation up to the resumed step {step}"
                + (
                    f" ({self.criterion.metric} {best[1]:.4f} at step {best[0]}); the next evaluation that "
                    "beats it writes best/ again"
                    if best
                    else ""
                )
            )
        if best is not None:
            messages.append(f"best so far: {self.criterion.metric} {best[1]:.4f} at step {best[0]}")
        return best, messages

    def closing_note(self) -> str | None:
        """A warning for the end of the run when no ``best/`` exists (None when it does)."""
        if self.directory.is_dir():
            return None
        if self.best is None:
            return (
                f"no {checkpointing.BEST_DIR}/: no dev evaluation after step 0 (train.eval_interval="
                f"{self.recipe.train.eval_interval} is longer than the run)"
            )
        return (
            f"no {checkpointing.BEST_DIR}/: the best dev evaluation ({self.criterion.metric} {self.best[1]:.4f} "
            f"at step {self.best[0]}) was in a part of the run a resume discarded, and none after it beat it"
        )


def read_selection(directory: Path) -> dict[str, Any] | None:
    """``directory/selection.json`` (a ``best/``), or None when absent or unreadable."""
    try:
        payload = json.loads((Path(directory) / checkpointing.SELECTION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def best_step_of(
    records: list[dict[str, Any]],
    select_by: str,
    *,
    up_to: int | None = None,
) -> tuple[int, float] | None:
    """The step and value ``select_by`` picks among the dev records of a ``metrics.jsonl``
    (steps after 0, up to ``up_to``; the earlier of a tie), or None."""
    rule, best = criterion(select_by), None
    for record in records:
        value, step = record.get(rule.key), record.get("step", 0)
        if (
            record.get("split") == "dev"
            and step > 0
            and (up_to is None or step <= up_to)
            and isinstance(value, (int, float))
        ):
            if rule.better(value, best and best[1]):
                best = (record["step"], float(value))
    return best


__all__ = ["Criterion", "DevPrompts", "Selector", "best_step_of", "criterion", "dev_rouge", "read_selection"]
