"""Teacher-forced perplexity against a plain loop straight from docs/method.md §1."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import EXAMPLES
from fixtures.perplexity import loop_sums
from mta import distributed
from mta.evaluation.datasets import EvalRow, load_rows
from mta.evaluation.perplexity import response_perplexity
from mta.models.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, load_tokenizer(tiny_model_dir)


def loop_perplexity(model, tokenizer, rows, max_prompt_length, max_response_length) -> float:
    total, count, _, _ = loop_sums(model, tokenizer, rows, max_prompt_length, max_response_length)
    return math.exp(total / count)


@pytest.mark.parametrize("max_prompt_length, max_response_length", [(256, 256), (20, 8)])
def test_perplexity_matches_a_plain_loop(model_and_tokenizer, max_prompt_length, max_response_length):
    model, tokenizer = model_and_tokenizer
    rows, _ = load_rows(EXAMPLES)
    rows = rows[:6] + [r for r in rows if r.references[0] == ""]  # the empty response: EOS only
    result = response_perplexity(
        model,
        tokenizer,
        rows,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
        batch_size=3,
    )
    total, count, prompts_cut, responses_cut = loop_sums(model, tokenizer, rows, max_prompt_length, max_response_length)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-4)
    assert result.nll == pytest.approx(total / count, rel=1e-4)
    assert (result.tokens, result.rows) == (count, len(rows))
    assert (result.prompts_truncated, result.responses_truncated) == (prompts_cut, responses_cut)
    if max_prompt_length == 20:
        assert result.prompts_truncated == len(rows)  # every Alpaca prompt is over 20 tokens
        assert result.responses_truncated > 0


def test_a_token_straddling_the_prompt_end_is_a_prompt_token_and_eos_is_scored(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt, response = "Q: sky?\nA: th", "e response"
    encoded = tokenizer(prompt + response, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    # The premise: one token runs across the boundary (" the", chars 10-14 with the prompt ending at 13).
    (straddling,) = [i for i, (a, b) in enumerate(offsets) if a < len(prompt) < b]
    scored = ids[straddling + 1 :] + [tokenizer.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([ids + [tokenizer.eos_token_id]])).logits[0].double()
    log_probs = torch.log_softmax(logits, -1)
    nll = -sum(
        log_probs[t - 1, token].item() for t, token in enumerate(ids + [tokenizer.eos_token_id]) if t > straddling
    )
    row = EvalRow(index=0, line=1, prompt=prompt, references=(response,))
    result = response_perplexity(model, tokenizer, [row])
    assert result.tokens == len(scored)
    assert result.nll == pytest.approx(nll / len(scored), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / len(scored)), rel=1e-5)
    assert (result.rows, result.prompts_truncated, result.responses_truncated) == (1, 0, 0)


def test_ranks_score_their_share_and_the_sums_give_the_whole_set(model_and_tokenizer, monkeypatch):
    """Two simulated ranks: rank r scores rows[r::2] (as the plain loop does on those rows), and
    with the all-reduce adding both, each returns the plain loop's result on every row."""
    model, tokenizer = model_and_tokenizer
    rows, _ = load_rows(EXAMPLES)
    rows = rows[:7]
    limits = dict(max_prompt_length=100, max_response_length=50)
    local: dict[int, list[float]] = {}
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(distributed, "world_size", lambda: 2)
        monkeypatch.setattr(
            distributed, "sum_over_ranks", lambda values, rank=rank: local.setdefault(rank, list(values))
        )
        response_perplexity(model, tokenizer, rows, batch_size=2, **limits)
        expected = loop_sums(model, tokenizer, rows[rank::2], *limits.values())
        assert local[rank] == pytest.approx(list(expected), rel=1e-5)

    whole = [a + b for a, b in zip(local[0], local[1], strict=True)]
    monkeypatch.setattr(distributed, "sum_over_ranks", lambda values: whole)
    result = response_perplexity(model, tokenizer, rows, batch_size=2, **limits)
    total, count, prompts_cut, responses_cut = loop_sums(model, tokenizer, rows, *limits.values())
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)
    assert (result.tokens, result.rows, result.prompts_truncated, result.responses_truncated) == (
        count,
        7,
        prompts_cut,
        responses_cut,
    )
    assert 0 < prompts_cut < 7 and 0 < responses_cut < 7  # both limits matter on these rows
