"""`mta evaluate` end to end on tiny random models: outputs, resume, several checkpoints, bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from rouge_score import rouge_scorer
from transformers import AutoModelForCausalLM

from conftest import torchrun
from fixtures.evaluate import FAST, run_cli
from fixtures.perplexity import loop_sums
from mta.errors import MtaError
from mta.evaluation import EvalSettings, evaluate_checkpoints
from mta.evaluation import runner as runner_module
from mta.evaluation.datasets import load_rows
from mta.evaluation.models_under_test import checkpoint_labels
from mta.generation import HFGenerator, SamplingParams, sampling_seed
from mta.models.tiny import build_tiny_model
from mta.models.tokenizers import load_tokenizer
from mta.scoring import completion_text

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "recipes" / "examples" / "tiny.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


COMMON_WORDS = [" the", " a", " of", " and", " to", " is", " in", " that", " for", " it", " with"]


def context_free(model_dir: Path, out: Path, logits: dict[int, float]) -> Path:
    """The tiny model with fixed next-token logits whatever the context (``{token: logit}``, 0
    elsewhere), saved with its tokenizer into ``out``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        # Blocks add nothing and every embedding is 1, so the final hidden state is the norm
        # weight (all ones): a head row of value/hidden_size gives its token logit ``value``.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for token, logit in logits.items():
            model.lm_head.weight[token] = logit / model.config.hidden_size
    model.save_pretrained(out)
    load_tokenizer(model_dir).save_pretrained(out)
    return out


def wordy(model_dir: Path, out: Path) -> Path:
    """The tiny model made to say common English words whatever the context: its predictions
    overlap the references partly, so their ROUGE-L scores spread instead of being all 0."""
    tokenizer = load_tokenizer(model_dir)
    words = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in COMMON_WORDS]
    assert all(len(ids) == 1 for ids in words)
    return context_free(model_dir, out, {token: 7.0 for (token,) in words})


def test_the_whole_command_twice_with_consistent_outputs(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    out = tmp_path / "eval"
    model_dir = wordy(tiny_model_dir, tmp_path / "wordy")
    result = run_cli([str(model_dir), "-o", str(out), "--data-dir", str(data_dir), *FAST, "--perplexity", "dolly-dev"])
    (label,) = checkpoint_labels([str(model_dir)])
    assert "Dolly" in result.output and "S-NI" in result.output
    results = json.loads((out / "results.json").read_text())
    assert list(results["sets"]) == ["dolly", "sinst"]  # vicuna etc. absent: skipped
    run = results["checkpoints"][label]

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    discriminating = {"scores": set(), "max_is_not_mean": 0, "f_is_neither_p_nor_r": 0}
    for set_name in ("dolly", "sinst"):
        seed_means = []
        for seed in (10, 20):
            records = read_jsonl(out / "predictions" / label / set_name / f"seed-{seed}.jsonl")
            assert [r["index"] for r in records] == [0, 1, 2]
            # Re-score from the file alone, as someone without mta would.
            rescored = [
                100 * max(scorer.score(ref, r["prediction"])["rougeL"].fmeasure for ref in r["references"])
                for r in records
            ]
            assert [r["rougeL"] for r in records] == pytest.approx(rescored)
            for r in records:
                scores = [scorer.score(ref, r["prediction"])["rougeL"] for ref in r["references"]]
                discriminating["scores"].add(round(100 * max(s.fmeasure for s in scores), 6))
                fmeasures = [s.fmeasure for s in scores]
                discriminating["max_is_not_mean"] += max(fmeasures) - sum(fmeasures) / len(fmeasures) > 1e-3
                discriminating["f_is_neither_p_nor_r"] += any(
                    min(abs(s.fmeasure - s.precision), abs(s.fmeasure - s.recall)) > 1e-3 for s in scores
                )
            seed_means.append(sum(rescored) / len(rescored))
            assert run["sets"][set_name]["rougeL"]["per_seed"][str(seed)] == pytest.approx(seed_means[-1])
            assert all(r["prompt_truncated"] for r in records)  # every Alpaca prompt is over 48 tokens
            assert all(1 <= r["new_tokens"] <= 6 for r in records)
        mean = sum(seed_means) / 2
        assert run["sets"][set_name]["rougeL"]["mean"] == pytest.approx(mean)
        assert run["sets"][set_name]["rougeL"]["std"] == pytest.approx(abs(seed_means[0] - seed_means[1]) / 2)
        assert run["sets"][set_name]["prompts_truncated"] == 3
    # The premise of the re-scoring: the scores spread, and scoring the mean over references or
    # the precision or recall instead of the F-measure would have changed some of them.
    assert len(discriminating["scores"] - {0.0}) >= 4, discriminating
    assert discriminating["max_is_not_mean"] >= 2 and discriminating["f_is_neither_p_nor_r"] >= 4, discriminating
    assert records[0]["references"][1] == "yes"  # S-NI keeps its list of references
    assert run["avg4"] is None  # SelfInst and Vicuna did not run
    assert run["avg"] == pytest.approx(
        (run["sets"]["dolly"]["rougeL"]["mean"] + run["sets"]["sinst"]["rougeL"]["mean"]) / 2
    )
    assert run["avg_ood"] == pytest.approx(run["sets"]["sinst"]["rougeL"]["mean"])
    assert results["sets"]["dolly"]["references_without_rouge_tokens"] == 1  # the CJK row
    # Perplexity on dolly-dev (6 rows) at the run's limits (prompt 48, response 6 = max new tokens),
    # as the plain one-row-at-a-time loop of test_evaluate_perplexity computes it.
    dev_rows, _ = load_rows(data_dir / "dolly" / "dev.jsonl")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count, prompts_cut, responses_cut = loop_sums(model, load_tokenizer(model_dir), dev_rows, 48, 6)
    assert run["perplexity"]["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-4)
    assert (run["perplexity"]["rows"], run["perplexity"]["tokens"]) == (6, count)
    assert (run["perplexity"]["prompts_truncated"], run["perplexity"]["responses_truncated"]) == (
        prompts_cut,
        responses_cut,
    )
    assert results["settings"]["seeds"] == [10, 20] and results["versions"]["torch"]
    manifest = json.loads((out / "predictions" / label / "generation.json").read_text())
    assert run["fingerprint"] == manifest["checkpoint_fingerprint"] and run["fingerprint"].startswith("sha256:")
    markdown = (out / "results.md").read_text()
    assert f"| {label} |" in markdown and "ppl (dolly-dev)" in markdown

    # Second run: everything is complete, so no model may even be loaded.
    before = {p: p.read_bytes() for p in (out / "predictions").rglob("*.jsonl")}
    monkeypatch.setattr(runner_module, "loaded_checkpoint", _must_not_load)
    run_cli([str(model_dir), "-o", str(out), "--data-dir", str(data_dir), *FAST, "--perplexity", "dolly-dev"])
    assert {p: p.read_bytes() for p in (out / "predictions").rglob("*.jsonl")} == before
    again = json.loads((out / "results.json").read_text())
    assert again["checkpoints"] == results["checkpoints"]


def _must_not_load(*args, **kwargs):
    raise AssertionError("a complete run loaded a model again")


def test_an_interrupted_set_resumes_from_its_journal(tiny_model_dir, data_dir, tmp_path):
    settings = EvalSettings(
        benchmarks=["dolly"], seeds=[10], max_new_tokens=6, max_prompt_length=48, limit=5, batch_size=2
    )
    out = tmp_path / "eval"
    evaluate_checkpoints([tiny_model_dir], ["tiny"], data_dir, out, settings)
    final = out / "predictions" / "tiny" / "dolly" / "seed-10.jsonl"
    complete = read_jsonl(final)

    # A crash after two rows: the file was never written, the journal has two rows and a torn line.
    final.unlink()
    journal = final.with_name("seed-10.rank0.journal.jsonl")
    kept = [
        {k: r[k] for k in ("index", "prompt", "prediction", "prompt_truncated", "new_tokens", "finished")}
        for r in complete[3:5]
    ]
    kept[0]["prediction"] = "from the journal"  # proves the row is reused, not regenerated
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"index": 0, "pre', encoding="utf-8")

    evaluate_checkpoints([tiny_model_dir], ["tiny"], data_dir, out, settings)
    resumed = read_jsonl(final)
    assert not journal.exists()
    assert resumed[3]["prediction"] == "from the journal"
    # Rows 0-2 and 4 are regenerated in other batches with the same per-row noise: same text.
    assert [r["prediction"] for i, r in enumerate(resumed) if i != 3] == [
        r["prediction"] for i, r in enumerate(complete) if i != 3
    ]


def sharpened(model_dir: Path, factor: float = 30.0) -> Path:
    """The random model with its logits scaled up: a random init is so near uniform that two
    of them sample the same tokens from the same noise."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    model.save_pretrained(model_dir)
    return model_dir


def test_several_checkpoints_with_the_same_basename_side_by_side(tiny_tokenizer_dir, data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = sharpened(build_tiny_model(tiny_tokenizer_dir, tmp_path / "runs" / "a" / "final", seed=1))
    second = sharpened(build_tiny_model(tiny_tokenizer_dir, tmp_path / "runs" / "b" / "final", seed=2))
    settings = EvalSettings(benchmarks=["sinst"], seeds=[10], max_new_tokens=4, max_prompt_length=48, limit=2)
    results = evaluate_checkpoints([first, second], None, data_dir, tmp_path / "eval", settings)
    assert list(results["checkpoints"]) == ["a", "b"]  # each run directory's name
    predictions = [
        read_jsonl(tmp_path / "eval" / "predictions" / label / "sinst" / "seed-10.jsonl")
        for label in results["checkpoints"]
    ]
    assert [r["prediction"] for r in predictions[0]] != [r["prediction"] for r in predictions[1]]
    markdown = (tmp_path / "eval" / "results.md").read_text()
    assert "| a |" in markdown and "| b |" in markdown


def test_a_model_that_only_says_eos_scores_zero(tiny_model_dir, data_dir, tmp_path):
    """Empty predictions are scored 0 and counted, not a crash."""
    eos = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.eos_token_id
    silent = context_free(tiny_model_dir, tmp_path / "silent", {eos: 50.0})
    settings = EvalSettings(benchmarks=["dolly"], seeds=[10], max_new_tokens=4, max_prompt_length=48, limit=3)
    results = evaluate_checkpoints([silent], ["silent"], data_dir, tmp_path / "eval", settings)
    stats = results["checkpoints"]["silent"]["sets"]["dolly"]
    assert stats["rougeL"]["mean"] == 0.0
    assert stats["per_seed"]["10"]["empty_predictions"] == 3
    records = read_jsonl(tmp_path / "eval" / "predictions" / "silent" / "dolly" / "seed-10.jsonl")
    assert all(r["prediction"] == "" and r["finished"] and r["new_tokens"] == 1 for r in records)


@pytest.fixture
def broken_checkpoints(tiny_model_dir, tmp_path):
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in os.listdir(tiny_model_dir):
        if not name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(tiny_model_dir / name, no_tokenizer / name)
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("hello")
    return {"no_tokenizer": no_tokenizer, "not_a_model": not_a_model}


@pytest.mark.parametrize(
    "which, message",
    [("no_tokenizer", r"no-tokenizer has no tokenizer"), ("not_a_model", r"not-a-model is not a model directory")],
)
def test_bad_checkpoints_fail_before_anything_runs(
    tiny_model_dir, broken_checkpoints, data_dir, tmp_path, which, message
):
    with pytest.raises(MtaError, match=message):
        # The good checkpoint comes first: the check must still happen before it is evaluated.
        evaluate_checkpoints([tiny_model_dir, broken_checkpoints[which]], None, data_dir, tmp_path / "eval")
    assert not (tmp_path / "eval").exists()


def test_bad_arguments_are_one_clear_error(tiny_model_dir, data_dir, tmp_path):
    with pytest.raises(MtaError, match="does not exist"):
        evaluate_checkpoints([tmp_path / "runs" / "x" / "final"], None, data_dir, tmp_path / "eval")
    with pytest.raises(MtaError, match="2 labels for 1 checkpoints"):
        evaluate_checkpoints([tiny_model_dir], ["a", "b"], data_dir, tmp_path / "eval")
    with pytest.raises(MtaError, match="share the label"):
        evaluate_checkpoints([tiny_model_dir, tiny_model_dir], None, data_dir, tmp_path / "eval")
    with pytest.raises(MtaError, match="cannot name a directory"):
        evaluate_checkpoints([tiny_model_dir], ["a/b"], data_dir, tmp_path / "eval")
    with pytest.raises(MtaError, match="benchmark 'vicuna' is missing"):
        evaluate_checkpoints([tiny_model_dir], None, data_dir, tmp_path / "eval", EvalSettings(benchmarks=["vicuna"]))
    (data_dir / "dolly" / "valid.jsonl").write_text('{"prompt": "p", "output": "o"}\n{"prompt": \n')
    with pytest.raises(MtaError, match=r"dolly/valid\.jsonl:2: not valid JSON"):
        evaluate_checkpoints([tiny_model_dir], None, data_dir, tmp_path / "eval")


def test_rerunning_with_other_settings_into_the_same_directory_is_refused(tiny_model_dir, data_dir, tmp_path):
    settings = EvalSettings(benchmarks=["sinst"], seeds=[10], max_new_tokens=3, max_prompt_length=48, limit=1)
    evaluate_checkpoints([tiny_model_dir], ["tiny"], data_dir, tmp_path / "eval", settings)
    changed = settings.model_copy(update={"max_new_tokens": 5})
    with pytest.raises(MtaError, match=r"max_new_tokens: 3 -> 5"):
        evaluate_checkpoints([tiny_model_dir], ["tiny"], data_dir, tmp_path / "eval", changed)
    # Predictions of an earlier sampler (another seed key) are not mixed with new ones either.
    manifest = tmp_path / "eval" / "predictions" / "tiny" / "generation.json"
    earlier = "per-row Gumbel-max sampling: top_k 0, top_p 1.0, temperature 1.0"  # keyed by row_seed
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "sampling": earlier}))
    with pytest.raises(MtaError, match=r"sampling: 'per-row Gumbel-max"):
        evaluate_checkpoints([tiny_model_dir], ["tiny"], data_dir, tmp_path / "eval", settings)


def test_each_row_is_sampled_from_its_documented_key(tiny_model_dir, data_dir, tmp_path):
    """A prediction is the protocol's sampler on the row's prompt with
    sampling_seed(seed, "evaluate/<set>", 0, index), decoded by completion_text."""
    settings = EvalSettings(benchmarks=["dolly"], seeds=[20], max_new_tokens=5, max_prompt_length=48, limit=3)
    evaluate_checkpoints([tiny_model_dir], ["tiny"], data_dir, tmp_path / "eval", settings)
    records = read_jsonl(tmp_path / "eval" / "predictions" / "tiny" / "dolly" / "seed-20.jsonl")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][:48] for r in records]
    seeds = [sampling_seed(20, "evaluate/dolly", 0, r["index"]) for r in records]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=5)
    generator = HFGenerator(model, tokenizer, params)
    generated = {c.position: c for batch in generator.generate(prompts, seeds) for c in batch}
    assert [r["prediction"] for r in records] == [completion_text(tokenizer, generated[i].token_ids) for i in range(3)]
    assert [r["new_tokens"] for r in records] == [generated[i].num_tokens for i in range(3)]


@pytest.mark.slow
def test_the_shared_instruction_sets(tiny_model_dir, shared, tmp_path):
    out = tmp_path / "eval"
    settings = EvalSettings(seeds=[10], max_new_tokens=4, max_prompt_length=64, limit=2)
    results = evaluate_checkpoints([tiny_model_dir], ["tiny"], shared / "data" / "instruct", out, settings)
    assert list(results["sets"]) == ["dolly", "self-inst", "vicuna", "sinst"]  # UnNI is absent
    run = results["checkpoints"]["tiny"]
    assert run["avg4"] == pytest.approx(sum(run["sets"][s]["rougeL"]["mean"] for s in results["sets"]) / 4)
    sinst = read_jsonl(out / "predictions" / "tiny" / "sinst" / "seed-10.jsonl")
    assert all(isinstance(r["references"], list) and r["references"] for r in sinst)


@pytest.mark.slow
def test_torchrun_ranks_share_the_rows_and_match_one_process(tiny_model_dir, data_dir, tmp_path):
    args = [
        str(tiny_model_dir),
        "--names",
        "tiny",
        "--data-dir",
        str(data_dir),
        "--benchmarks",
        "dolly",
        "--seeds",
        "10",
        "--max-new-tokens",
        "4",
        "--max-prompt-length",
        "48",
        "--limit",
        "4",
        "--batch-size",
        "2",
        "--perplexity",
        "dolly-dev",
        "--perplexity-limit",
        "5",
    ]
    torchrun(["-m", "mta_cli.main", "evaluate", *args, "-o", tmp_path / "two"])
    evaluate_checkpoints(
        [tiny_model_dir],
        ["tiny"],
        data_dir,
        tmp_path / "one",
        EvalSettings(
            benchmarks=["dolly"],
            seeds=[10],
            max_new_tokens=4,
            max_prompt_length=48,
            limit=4,
            batch_size=2,
            perplexity="dolly-dev",
            perplexity_limit=5,
        ),
    )
    two = read_jsonl(tmp_path / "two" / "predictions" / "tiny" / "dolly" / "seed-10.jsonl")
    one = read_jsonl(tmp_path / "one" / "predictions" / "tiny" / "dolly" / "seed-10.jsonl")
    assert [r["prediction"] for r in two] == [r["prediction"] for r in one]
    assert not list((tmp_path / "two").rglob("*.journal.jsonl"))
    # Perplexity: 5 rows over 2 ranks (3 + 2), the sums added up: the one-process numbers.
    ppl_two = json.loads((tmp_path / "two" / "predictions" / "tiny" / "perplexity.json").read_text())
    ppl_one = json.loads((tmp_path / "one" / "predictions" / "tiny" / "perplexity.json").read_text())
    assert ppl_two["rows"] == ppl_one["rows"] == 5 and ppl_two["tokens"] == ppl_one["tokens"]
    assert ppl_two["perplexity"] == pytest.approx(ppl_one["perplexity"], rel=1e-5)
