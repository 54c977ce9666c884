"""``train.select_by`` against a plain restatement (README, "LoRA students and picking the
checkpoint"; ``mta.training.lifecycle.selection``): ``loss`` keeps the lowest dev loss, ``rouge``
the highest ``dev/rougeL``; step 0 is a baseline, a tie keeps the earlier step. The last test
fails when the schema gains a ``select_by`` goal this table does not restate."""

from __future__ import annotations

import json
from typing import Any, get_args

import numpy as np
import pytest

from fixtures.selection import Tokenizer, dev_table, recipe
from mta.training.config.schema import TrainSpec
from mta.training.lifecycle import checkpointing, selection

# select_by -> (the metric selection.json names, the dev record key holding it, the goal).
GOALS = {
    "loss": ("dev/loss", "loss", "lowest"),
    "rouge": ("dev/rougeL", "dev/rougeL", "highest"),
}


def restated_best(records: list[dict[str, Any]], select_by: str, up_to: int | None = None):
    """The first dev record after step 0 (up to ``up_to``) whose value no other one beats."""
    _, key, goal = GOALS[select_by]
    candidates = [
        (r["step"], float(r[key]))
        for r in records
        if r.get("split") == "dev" and r["step"] > 0 and (up_to is None or r["step"] <= up_to) and key in r
    ]
    if not candidates:
        return None
    target = (min if goal == "lowest" else max)(value for _, value in candidates)
    return next(candidate for candidate in candidates if candidate[1] == target)


def records_for(select_by: str, values: list[float]) -> list[dict[str, Any]]:
    _, key, _ = GOALS[select_by]
    dev = [{"split": "dev", "step": 2 * i, key: value} for i, value in enumerate(values)]
    train = [{"split": "train", "step": 2 * i + 1, key: -1e9 if key == "loss" else 1e9} for i in range(len(values))]
    return [record for pair in zip(dev, train, strict=True) for record in pair]


@pytest.mark.parametrize("select_by", sorted(GOALS))
def test_the_best_step_is_the_restated_one_with_ties_to_the_earlier_step(select_by):
    rng = np.random.default_rng(3)
    for trial in range(200):
        values = rng.integers(0, 5, size=rng.integers(1, 9)).astype(float).tolist()  # small ints: many ties
        records = records_for(select_by, values)
        up_to = None if trial % 3 else int(rng.integers(0, 2 * len(values)))
        assert selection.best_step_of(records, select_by, up_to=up_to) == restated_best(records, select_by, up_to)


@pytest.mark.parametrize("select_by", sorted(GOALS))
def test_the_criterion_names_the_restated_metric_key_and_goal(select_by):
    rule = selection.criterion(select_by)
    assert (rule.select_by, (rule.metric, rule.key, rule.goal)) == (select_by, GOALS[select_by])
    lower, higher = 1.0, 2.0
    assert rule.better(lower, higher) is (GOALS[select_by][2] == "lowest")
    assert rule.better(higher, lower) is (GOALS[select_by][2] == "highest")
    assert rule.better(lower, lower) is False and rule.better(lower, None) is True  # a tie is no improvement


@pytest.mark.parametrize("select_by", sorted(GOALS))
def test_best_is_written_at_each_strict_improvement_after_step_0_with_its_selection(select_by, tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(checkpointing, "save_best", lambda *args: written.append(dict(args[-1])))
    selector = selection.Selector(recipe(select_by), tmp_path, "run-1", dev_table=dev_table(), tokenizer=Tokenizer())
    metric, key, goal = GOALS[select_by]
    sign = 1 if goal == "lowest" else -1
    values = [0.0, 5.0, 3.0, 3.0, 4.0, 2.0]  # as losses; negated for rouge
    for step, value in enumerate(values):
        selector.consider(step, {"split": "dev", "step": step, key: sign * value}, engine=None)
    assert [(chosen["step"], chosen["value"]) for chosen in written] == [
        (1, sign * 5.0),
        (2, sign * 3.0),
        (5, sign * 2.0),
    ]
    last = written[-1]
    assert {k: last[k] for k in ("select_by", "metric", "goal", "run_id")} == {
        "select_by": select_by,
        "metric": metric,
        "goal": goal,
        "run_id": "run-1",
    }
    assert ("rows" in last) is (select_by == "rouge")
    json.dumps(last)  # selection.json is plain JSON


def test_rouge_samples_the_first_rows_but_never_the_rejected_half_of_a_pair():
    prompts = selection.DevPrompts.from_table(dev_table(), Tokenizer(), count=3, max_prompt_length=2)
    assert prompts.rows == [0, 1, 3]
    assert prompts.references == ["a0", "b1", "d2"]
    assert prompts.prompts == [[ord("Q"), ord("0")], [ord("Q"), ord("1")], [ord("Q"), ord("2")]]


def test_every_select_by_of_the_schema_is_restated():
    assert set(get_args(TrainSpec.model_fields["select_by"].annotation)) == set(GOALS)
