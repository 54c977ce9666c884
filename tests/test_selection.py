"""Checkpoints chosen the way the published numbers were (``train.select_by``, ``OUT/best/``),
evaluation on any JSONL set (``dolly-dev``, a file named by its stem), and the differences to the
first checkpoint in results.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fixtures.distill import LENGTHS, write_recipe
from fixtures.evaluate import write_jsonl
from mta.data.annotations import read_annotations
from mta.errors import MtaError
from mta.evaluation import EvalSettings, evaluate_checkpoints
from mta.evaluation.datasets import resolve_benchmarks
from mta.evaluation.report import results_markdown
from mta.generation import HFGenerator, SamplingParams, sampling_seed
from mta.hashing import directory_checksums, read_checksums
from mta.models.tokenizers import load_tokenizer
from mta.scoring import completion_text, rouge_l
from mta.training.config.loading import load_recipe
from mta.training.lifecycle import checkpointing, selection
from mta.training.lifecycle.metrics import read_metrics
from mta.training.trainer import run_distillation

pytestmark = pytest.mark.usefixtures("one_thread")

SELECT_ROWS = 3


def dev_values(out: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every dev evaluation after step 0 in the run's metrics.jsonl."""
    return [(r["step"], r[key]) for r in read_metrics(out / "metrics.jsonl") if r["split"] == "dev" and r["step"] > 0]


def expected_best(values: list[tuple[int, float]], highest: bool) -> tuple[int, float]:
    """The first step holding the best value (the earlier one wins a tie)."""
    target = max(v for _, v in values) if highest else min(v for _, v in values)
    return next((step, value) for step, value in values if value == target)


def selection_run(tmp_path: Path, name: str, teacher, student, annotations, select_by: str) -> Path:
    return write_recipe(
        tmp_path / f"{name}.yaml",
        teacher=teacher,
        student=student,
        annotations=annotations,
        output_dir=tmp_path / name,
        train={
            "lr": 1e-2,
            "max_steps": 4,
            "eval_interval": 1,
            "save_interval": 1,
            "keep_checkpoints": 10,
            "select_by": select_by,
            "select_rows": SELECT_ROWS,
            # The premises below (the steps score differently, the best after step 2) hold on
            # this trajectory, 0.2.0's reduction's; another reduction trains other weights.
            "loss_reduction": "micro_batch",
        },
    )


def check_best(out: Path, metric: str, key: str, highest: bool) -> dict:
    """best/ holds the weights of the step metrics.jsonl makes best, names it, and loads."""
    best = out / checkpointing.BEST_DIR
    chosen = json.loads((best / checkpointing.SELECTION_FILE).read_text())
    step, value = expected_best(dev_values(out, key), highest)
    assert (chosen["metric"], chosen["step"], chosen["value"]) == (metric, step, value)
    assert chosen["run_id"] == json.loads((out / "run.json").read_text())["run_id"]
    weights, at_step = (load_file(str(d / "model.safetensors")) for d in (best, out / "checkpoints" / f"step-{step}"))
    assert all(torch.equal(weights[k], at_step[k]) for k in at_step) and weights.keys() == at_step.keys()
    assert read_checksums(best) == directory_checksums(best)
    assert f"{metric} = {value:.4f} at step {step}" in (best / "README.md").read_text()
    AutoModelForCausalLM.from_pretrained(best)
    return chosen


@pytest.mark.slow
def test_select_by_rouge_keeps_the_best_logged_step_and_a_resume_keeps_best(
    tmp_path, teacher_dir, tiny_model_dir, same_data
):
    recipe_path = selection_run(tmp_path, "rouge", teacher_dir, tiny_model_dir, same_data, "rouge")
    run_distillation(load_recipe(recipe_path))
    out = tmp_path / "rouge"
    values = dev_values(out, selection.ROUGE_KEY)
    assert [step for step, _ in values] == [1, 2, 3, 4]
    assert len({value for _, value in values}) > 1  # the premise: the steps score differently
    chosen = check_best(out, "dev/rougeL", selection.ROUGE_KEY, highest=True)
    assert chosen["rows"] == SELECT_ROWS

    # dev/rougeL is what the documented protocol gives the selected weights: the first dev rows'
    # prompts (tokenized as mta evaluate does, data.max_prompt_length kept), one keyed sample each
    # (top_k 0, top_p 1, T 1, up to max_length - max_prompt_length new tokens), ROUGE-L to the response.
    table = read_annotations(same_data).table
    texts, cuts = table.column("text").to_pylist(), table.column("prompt_chars").to_pylist()
    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(out / "best")
    limit = LENGTHS["max_prompt_length"]
    prompts = [
        tokenizer(texts[i][: cuts[i]], add_special_tokens=False)["input_ids"][:limit] for i in range(SELECT_ROWS)
    ]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=LENGTHS["max_length"] - limit)
    seeds = [sampling_seed(3, "select/dev-rouge", 0, i) for i in range(SELECT_ROWS)]
    scores = {}
    for batch in HFGenerator(model, tokenizer, params, batch_size=1).generate(prompts, seeds):
        for c in batch:
            scores[c.position] = rouge_l(
                completion_text(tokenizer, c.token_ids), [texts[c.position][cuts[c.position] :].strip()]
            )
    assert sum(scores.values()) / SELECT_ROWS == pytest.approx(chosen["value"], abs=1e-6)

    # A resume from step 2 keeps best/ consistent: the best so far comes back from metrics.jsonl, a
    # best/ from after step 2 is discarded with that part of the run and written again when the
    # replayed steps reach it, so the run ends with the same choice and the same weights.
    assert chosen["step"] > 2  # the premise: best/ comes from after the step resumed from
    before = load_file(str(out / "best" / "model.safetensors"))
    run_distillation(load_recipe(recipe_path), resume=str(out / "checkpoints" / "step-2"))
    again = check_best(out, "dev/rougeL", selection.ROUGE_KEY, highest=True)
    assert (again["step"], again["value"]) == (chosen["step"], chosen["value"])
    after = load_file(str(out / "best" / "model.safetensors"))
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow
def test_select_by_loss_keeps_the_lowest_dev_loss(tmp_path, teacher_dir, tiny_model_dir, same_data):
    recipe_path = selection_run(tmp_path, "loss", teacher_dir, tiny_model_dir, same_data, "loss")
    run_distillation(load_recipe(recipe_path))
    out = tmp_path / "loss"
    check_best(out, "dev/loss", "loss", highest=False)
    assert all(selection.ROUGE_KEY not in r for r in read_metrics(out / "metrics.jsonl"))  # nothing sampled


def test_best_is_kept_only_when_it_is_the_best_up_to_the_resumed_step(tmp_path, monkeypatch):
    """Selector.consider and .restore on records alone (the export replaced by a recorder)."""
    recipe = load_recipe(selection_run(tmp_path, "unit", "t", "s", tmp_path, "loss"))
    saved = []

    def save_best(engine, tokenizer, recipe, output_dir, chosen):
        (output_dir / "best").mkdir(exist_ok=True)
        (output_dir / "best" / "selection.json").write_text(json.dumps(chosen))
        saved.append((chosen["step"], chosen["value"]))

    monkeypatch.setattr(checkpointing, "save_best", save_best)
    out = tmp_path / "unit"
    out.mkdir()
    selector = selection.Selector.__new__(selection.Selector)
    selector.recipe, selector.output_dir, selector.run_id, selector.tokenizer = recipe, out, "r1", None
    selector.criterion, selector.best, selector.prompts = selection.criterion("loss"), None, None
    losses = [(0, 1.0), (1, 5.0), (2, 3.0), (3, 3.0), (4, 4.0), (5, 2.0)]
    for step, loss in losses:
        selector.consider(step, {"split": "dev", "step": step, "loss": loss}, engine=None)
    assert saved == [(1, 5.0), (2, 3.0), (5, 2.0)]  # never step 0; a tie keeps the earlier step

    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({"split": "dev", "step": s, "loss": v}) + "\n" for s, v in losses)
    )
    # Resumed at step 4: best/ (step 5) is from the discarded part: removed; the best so far is step 2.
    selector.restore(4)
    assert selector.best == (2, 3.0) and not (out / "best").exists()
    # Resumed at step 5 with best/ of step 5: kept.
    save_best(None, None, recipe, out, {"metric": "dev/loss", "step": 5, "value": 2.0, "run_id": "r1"})
    selector.restore(5)
    assert selector.best == (5, 2.0) and (out / "best").exists()
    # Another run's best/, or one whose value is not the logged one: removed.
    save_best(None, None, recipe, out, {"metric": "dev/loss", "step": 5, "value": 2.0, "run_id": "other"})
    selector.restore(5)
    assert not (out / "best").exists()


def test_rouge_selection_needs_a_dev_split(tmp_path):
    with pytest.raises(MtaError, match="select_by=rouge samples responses to dev prompts: set data.dev"):
        load_recipe(
            Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml", ["train.select_by=rouge", "data.dev=null"]
        )


def test_evaluate_takes_dolly_dev_and_jsonl_files_named_by_their_stem(tiny_model_dir, data_dir, tmp_path):
    mine = write_jsonl(tmp_path / "sets" / "mine.jsonl", [{"instruction": "Name a colour.", "output": "Blue."}] * 3)
    settings = EvalSettings(
        benchmarks=["dolly", "dolly-dev", str(mine)], seeds=[10], max_new_tokens=4, max_prompt_length=48, limit=2
    )
    out = tmp_path / "eval"
    results = evaluate_checkpoints([tiny_model_dir], ["tiny"], data_dir, out, settings)
    assert list(results["sets"]) == ["dolly", "dolly-dev", "mine"]
    assert results["sets"]["dolly-dev"]["path"] == str(data_dir / "dolly" / "dev.jsonl")
    assert results["sets"]["mine"]["path"] == str(mine) and results["sets"]["mine"]["rows_in_file"] == 3
    predictions = out / "predictions" / "tiny" / "mine" / "seed-10.jsonl"
    assert [json.loads(line)["references"] for line in predictions.read_text().splitlines()] == [["Blue."]] * 2
    run = results["checkpoints"]["tiny"]
    means = {name: s["rougeL"]["mean"] for name, s in run["sets"].items()}
    assert run["avg4"] is None  # dolly-dev and a file never make the published average
    assert run["avg"] == pytest.approx(sum(means.values()) / 3)
    assert run["avg_ood"] == pytest.approx(means["mine"])  # Dolly's dev split is in distribution
    header = (out / "results.md").read_text().splitlines()[4]
    assert "| Dolly | Dolly (dev) | mine |" in header

    for requested, message in (
        ([str(tmp_path / "dolly.jsonl")], "named by its file stem, and 'dolly' is the built-in set"),
        (
            [str(mine), str(write_jsonl(tmp_path / "other" / "mine.jsonl", [{"prompt": "p", "output": "o"}]))],
            "are both 'mine'",
        ),
        ([str(tmp_path / "absent.jsonl")], r"benchmark '.*absent.jsonl' is missing"),
        (["mmlu"], "unknown benchmark 'mmlu'.*dolly-dev"),
    ):
        with pytest.raises(MtaError, match=message):
            resolve_benchmarks(data_dir, requested)


def _population_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def test_results_md_shows_each_checkpoint_minus_the_first_with_its_spread_over_seeds():
    seeds = ["10", "20", "30"]
    sets = ["dolly", "self-inst", "vicuna", "sinst"]
    # ROUGE-L per checkpoint, set and seed: mta beats base on seeds where base is also high, so the
    # paired spread differs from what the two unpaired stds would suggest.
    scores = {
        "base": {
            "dolly": [20.0, 24.0, 22.0],
            "self-inst": [10.0, 11.0, 12.0],
            "vicuna": [15.0, 16.0, 14.5],
            "sinst": [30.0, 31.0, 29.0],
        },
        "mta": {
            "dolly": [21.5, 25.0, 23.5],
            "self-inst": [10.5, 10.0, 12.5],
            "vicuna": [15.0, 17.0, 15.5],
            "sinst": [29.0, 31.5, 30.0],
        },
        "worse": {
            "dolly": [19.0, 23.0, 22.0],
            "self-inst": [9.0, 11.0, 11.0],
            "vicuna": [14.0, 16.0, 14.0],
            "sinst": [30.0, 30.0, 28.0],
        },
    }

    def summary(values):
        mean = sum(values) / len(values)
        return {"mean": mean, "std": _population_std(values), "per_seed": dict(zip(seeds, values, strict=True))}

    checkpoints = {}
    for label, by_set in scores.items():
        means = {name: sum(v) / 3 for name, v in by_set.items()}
        checkpoints[label] = {
            "sets": {name: {"rougeL": summary(by_set[name])} for name in sets},
            "avg4": sum(means.values()) / 4,
            "avg": sum(means.values()) / 4,
            "avg_ood": sum(means[s] for s in sets[1:]) / 3,
        }
    results = {
        "settings": {"seeds": [10, 20, 30], "perplexity": None},
        "sets": {name: {} for name in sets},
        "checkpoints": checkpoints,
    }
    markdown = results_markdown(results)
    assert "## Difference to base" in markdown and "paired by seed" in markdown
    table = markdown.split("## Difference to base")[1]
    rows = {
        line.split(" | ")[0].strip("| "): [c.strip(" |") for c in line.split(" | ")[1:]]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| checkpoint")
    }
    assert list(rows) == ["mta", "worse"]

    def cell(differences: list[float]) -> str:
        mean = sum(differences) / len(differences)
        return f"{'+' if mean >= 0 else '-'}{abs(mean):.2f} ± {_population_std(differences):.2f}"

    for label in ("mta", "worse"):
        expected = []
        for name in sets:
            expected.append(cell([a - b for a, b in zip(scores[label][name], scores["base"][name], strict=True)]))
        for group in (sets, sets, sets[1:]):  # avg4, avg, avg w/o Dolly: per-seed averages, then differenced
            per_seed = [sum(scores[label][s][i] - scores["base"][s][i] for s in group) / len(group) for i in range(3)]
            expected.append(cell(per_seed))
        assert rows[label] == expected
    assert rows["worse"][0].startswith("-")  # the sign of a loss is shown
    dolly_paired = [a - b for a, b in zip(scores["mta"]["dolly"], scores["base"]["dolly"], strict=True)]
    unpaired = math.hypot(_population_std(scores["mta"]["dolly"]), _population_std(scores["base"]["dolly"]))
    assert abs(_population_std(dolly_paired) - unpaired) > 0.5  # pairing by seed changes the spread

    one_seed = json.loads(json.dumps(results))
    one_seed["settings"]["seeds"] = [10]
    for run in one_seed["checkpoints"].values():
        for summary_ in run["sets"].values():
            summary_["rougeL"]["per_seed"] = {"10": summary_["rougeL"]["per_seed"]["10"]}
    single = results_markdown(one_seed).split("## Difference to base")[1]
    assert "±" not in single and "| mta | +1.50 |" in single
