"""Edges of best-checkpoint selection that mutation testing (bench/mutation.py) found unchecked.

Dev prompts without pair roles and without special tokens, what a Selector keeps and hands to the
export, ``dev_rouge`` against one prompt at a time, what a non-main rank restores, the resume log
lines word for word, and records without a step. Expected values are restated, not computed by
the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from transformers import AutoModelForCausalLM

from fixtures.selection import dev_table, recipe
from mta import distributed
from mta.errors import MtaError
from mta.generation import HFGenerator, SamplingParams, sampling_seed
from mta.generation.generator import Completion
from mta.models.tokenizers import load_tokenizer
from mta.scoring import completion_text, rouge_l
from mta.training.config.schema import Recipe
from mta.training.lifecycle import checkpointing, selection


class MarkingTokenizer:
    """Characters as ids, with a BOS id 1 unless ``add_special_tokens=False`` (the default adds it)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}


def test_dev_prompts_of_rows_without_roles_take_every_row_without_special_tokens():
    table = dev_table().drop_columns(["role"])
    prompts = selection.DevPrompts.from_table(table, MarkingTokenizer(), count=4, max_prompt_length=3)
    assert prompts.rows == [0, 1, 2, 3]
    assert prompts.prompts[0] == [ord("Q"), ord("0"), ord("?")]


def test_a_selector_keeps_its_recipe_directory_and_tokenizer_and_hands_them_to_the_export(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(checkpointing, "save_best", lambda *args: calls.append(args) or tmp_path / "best")
    the_recipe, tokenizer = recipe("rouge"), MarkingTokenizer()
    selector = selection.Selector(the_recipe, str(tmp_path), "run-7", dev_table=dev_table(), tokenizer=tokenizer)
    assert selector.recipe is the_recipe and selector.tokenizer is tokenizer and selector.output_dir == tmp_path
    assert selector.prompts is not None and selector.prompts.rows == [0, 1, 3][: the_recipe.train.select_rows]
    assert all(len(p) <= the_recipe.data.max_prompt_length for p in selector.prompts.prompts)
    engine = object()
    assert selector.consider(1, {"step": 1, selection.ROUGE_KEY: 12.5}, engine) == tmp_path / "best"
    (args,) = calls
    assert args[:4] == (engine, tokenizer, the_recipe, tmp_path)
    assert args[4] == selector.selection() and args[4]["rows"] == len(selector.prompts.rows)


def test_a_selection_before_any_best_is_refused_with_the_reason(tmp_path):
    selector = selection.Selector(recipe("loss"), tmp_path, "r", dev_table=dev_table(), tokenizer=MarkingTokenizer())
    with pytest.raises(MtaError, match="^no dev evaluation has been the best yet: there is no selection to record$"):
        selector.selection()


def test_dev_rouge_is_the_mean_over_rows_of_each_rows_keyed_sample(tiny_model_dir):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    rows = [("Name a colour: ", "red"), ("Count to two: ", "one two"), ("Say hi: ", "hi there")]
    table = pa.table({"text": [p + r for p, r in rows], "prompt_chars": [len(p) for p, _ in rows]})
    prompts = selection.DevPrompts.from_table(table, tokenizer, count=3, max_prompt_length=16)
    got = selection.dev_rouge(model, tokenizer, prompts, seed=5, max_new_tokens=6, batch_size=2)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6)
    scores = []
    for row, (prompt, reference) in enumerate(zip(prompts.prompts, prompts.references, strict=True)):
        seed = sampling_seed(5, "select/dev-rouge", 0, row)
        (completion,) = next(iter(HFGenerator(model, tokenizer, params, batch_size=1).generate([prompt], [seed])))
        scores.append(rouge_l(completion_text(tokenizer, completion.token_ids), [reference]))
    assert got == pytest.approx(sum(scores) / 3)


def test_a_rank_other_than_main_restores_nothing_and_takes_the_broadcast_best(tmp_path, monkeypatch):
    selector = selection.Selector(recipe("loss"), tmp_path, "r", dev_table=dev_table(), tokenizer=MarkingTokenizer())
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    assert selector.restore(3) == [] and selector.best is None


def write_metrics(out: Path, records: list[dict]) -> None:
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_the_resume_log_lines_name_what_was_removed_and_the_best_so_far(tmp_path):
    selector = selection.Selector(recipe("rouge"), tmp_path, "r", dev_table=dev_table(), tokenizer=MarkingTokenizer())
    best = tmp_path / "best"
    # No metrics.jsonl and a best/ without its selection.json: removed, and no best so far.
    best.mkdir()
    assert selector.restore(4) == [
        f"removed {best} (no readable selection.json): it is not the best dev evaluation up to the resumed step 4"
    ]
    assert selector.best is None and not best.exists()
    # ROUGE (highest) and loss (lowest) pick different steps here: the selector's own criterion counts.
    write_metrics(
        tmp_path,
        [
            {"split": "dev", "step": 2, "loss": 1.0, "dev/rougeL": 10.0},
            {"split": "dev", "step": 3, "loss": 2.0, "dev/rougeL": 30.25},
        ],
    )
    best.mkdir()
    (best / "selection.json").write_text(json.dumps({"step": 9, "metric": "dev/rougeL"}), encoding="utf-8")
    assert selector.restore(4) == [
        f"removed {best} (step 9): it is not the best dev evaluation up to the resumed step 4 (dev/rougeL 30.2500 at "
        "step 3); the next evaluation that beats it writes best/ again",
        "best so far: dev/rougeL 30.2500 at step 3",
    ]
    assert selector.best == (3, 30.25)


def test_a_selection_file_that_is_not_an_object_reads_as_none(tmp_path):
    (tmp_path / "selection.json").write_text("[1, 2]", encoding="utf-8")
    assert selection.read_selection(tmp_path) is None


def test_records_without_a_step_are_not_dev_evaluations_and_step_1_is(tmp_path):
    records = [{"split": "dev", "loss": 0.1}, {"split": "dev", "step": 1, "loss": 0.5}]
    assert selection.best_step_of(records, "loss") == (1, 0.5)


def test_measuring_samples_the_dev_rows_with_the_runs_seed_lengths_and_batch(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(selection, "dev_rouge", lambda *args, **kwargs: calls.append((args, kwargs)) or 41.5)
    by_loss = selection.Selector(recipe("loss"), tmp_path, "r", dev_table=dev_table(), tokenizer=MarkingTokenizer())
    assert by_loss.measure("model") == {} and calls == []
    the_recipe = recipe("rouge")
    by_rouge = selection.Selector(the_recipe, tmp_path, "r", dev_table=dev_table(), tokenizer=MarkingTokenizer())
    assert by_rouge.measure("model") == {selection.ROUGE_KEY: 41.5}
    ((args, kwargs),) = calls
    assert args == ("model", by_rouge.tokenizer, by_rouge.prompts)
    assert kwargs == {
        "seed": the_recipe.seed,
        "max_new_tokens": the_recipe.data.max_length - the_recipe.data.max_prompt_length,
        "batch_size": 4 * the_recipe.train.micro_batch_size,
    }


def test_the_closing_note_says_why_there_is_no_best(tmp_path):
    selector = selection.Selector(recipe("loss"), tmp_path, "r", dev_table=dev_table(), tokenizer=MarkingTokenizer())
    assert selector.closing_note() == (
        f"no best/: no dev evaluation after step 0 (train.eval_interval={selector.recipe.train.eval_interval} "
        "is longer than the run)"
    )
    selector.best = (6, 1.23456)
    assert selector.closing_note() == (
        "no best/: the best dev evaluation (dev/loss 1.2346 at step 6) was in a part of the run a resume "
        "discarded, and none after it beat it"
    )
    selector.directory.mkdir()
    assert selector.closing_note() is None


class Decoding(MarkingTokenizer):
    """MarkingTokenizer that decodes its ids back to characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


ANSWERS = {"Name a colour: ": "red blue", "Count to two: ": "one", "Say hi: ": "hi there you"}


def test_dev_rouge_scores_each_rows_keyed_sample_against_its_reference_and_averages(monkeypatch):
    """A fake engine that answers with words of the references, so every score is above 0 (a tiny
    random model's samples score 0, where a sum and a difference look alike)."""
    requests = []

    class Engine:
        def __init__(self, model, tokenizer, params, batch_size):
            requests.append((model, params, batch_size))

        def generate(self, prompts, seeds):
            texts = [
                ANSWERS["".join(map(chr, prompt))] + " w" * (seed % 4)
                for prompt, seed in zip(prompts, seeds, strict=True)
            ]
            answers = [[ord(c) for c in text] for text in texts]
            for start in range(0, len(prompts), 2):
                yield [Completion(i, answers[i], True) for i in range(start, min(start + 2, len(prompts)))]

    monkeypatch.setattr(selection, "HFGenerator", Engine)
    rows = [("Name a colour: ", "red"), ("Count to two: ", "one two"), ("Say hi: ", "hi there")]
    table = pa.table({"text": [p + r for p, r in rows], "prompt_chars": [len(p) for p, _ in rows]})
    prompts = selection.DevPrompts.from_table(table, Decoding(), count=3, max_prompt_length=16)
    got = selection.dev_rouge("model", Decoding(), prompts, seed=5, max_new_tokens=6, batch_size=2)
    expected = [
        rouge_l(ANSWERS[prompt[:16]] + " w" * (sampling_seed(5, "select/dev-rouge", 0, row) % 4), [reference])
        for row, (prompt, reference) in enumerate(rows)
    ]
    assert min(expected) > 0 and got == pytest.approx(sum(expected) / 3)
    assert len({sampling_seed(5, "select/dev-rouge", 0, row) % 4 for row in range(3)}) > 1  # the seeds matter
    assert requests == [("model", SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6), 2)]
    # One dev row: its own score, not a share of it.
    one = selection.DevPrompts.from_table(table.slice(0, 1), Decoding(), count=1, max_prompt_length=16)
    assert selection.dev_rouge("model", Decoding(), one, seed=5, max_new_tokens=6, batch_size=2) == expected[0]


def test_a_selector_takes_the_recipes_row_count_and_prompt_length(tmp_path):
    raw = recipe("rouge").model_dump(mode="json")
    raw["train"]["select_rows"], raw["data"]["max_prompt_length"] = 2, 2
    few = selection.Selector(
        Recipe.model_validate(raw), tmp_path, "r", dev_table=dev_table(), tokenizer=MarkingTokenizer()
    )
    assert few.prompts.rows == [0, 1] and all(len(p) == 2 for p in few.prompts.prompts)


def test_dev_rouge_of_one_row_is_that_rows_score(monkeypatch):
    class Engine:
        def __init__(self, *args, **kwargs):
            pass

        def generate(self, prompts, seeds):
            yield [Completion(0, [ord(c) for c in "red blue"], True)]

    monkeypatch.setattr(selection, "HFGenerator", Engine)
    table = pa.table({"text": ["Name a colour: red"], "prompt_chars": [len("Name a colour: ")]})
    prompts = selection.DevPrompts.from_table(table, Decoding(), count=1, max_prompt_length=16)
    score = selection.dev_rouge("model", Decoding(), prompts, seed=5, max_new_tokens=6, batch_size=2)
    assert score == pytest.approx(rouge_l("red blue", ["red"])) and score > 0
