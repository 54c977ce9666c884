"""Teacher-forced perplexity against a plain loop straight from METHOD section 1."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from mta.evaluation.datasets import EvalRow, load_rows
from mta.evaluation.perplexity import response_perplexity
from mta.models.tokenizers import load_tokenizer

from conftest import EXAMPLES


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, load_tokenizer(tiny_model_dir)


def loop_perplexity(model, tokenizer, rows, max_prompt_length, max_response_length) -> float:
    """One sequence at a time, one token at a time, straight from METHOD section 1."""
    total, count = 0.0, 0
    for row in rows:
        prompt, response = row.prompt, row.references[0]
        encoded = tokenizer(prompt + response, add_special_tokens=False, return_offsets_mapping=True)
        prompt_ids, response_ids = [], []
        for token, (start, _) in zip(encoded["input_ids"], encoded["offset_mapping"]):
            (prompt_ids if start < len(prompt) else response_ids).append(token)
        prompt_ids = prompt_ids[:max_prompt_length]
        if len(response_ids) + 1 <= max_response_length:
            response_ids = response_ids + [tokenizer.eos_token_id]
        else:
            response_ids = response_ids[:max_response_length]
        ids = prompt_ids + response_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        for t in range(len(prompt_ids), len(ids)):
            total -= torch.log_softmax(logits[t - 1], -1)[ids[t]].item()
            count += 1
    return math.exp(total / count)


@pytest.mark.parametrize("max_prompt_length, max_response_length", [(256, 256), (20, 8)])
def test_perplexity_matches_a_plain_loop(model_and_tokenizer, max_prompt_length, max_response_length):
    model, tokenizer = model_and_tokenizer
    rows, _ = load_rows(EXAMPLES)
    rows = rows[:6] + [r for r in rows if r.references[0] == ""]  # the empty response: EOS only
    result = response_perplexity(
        model, tokenizer, rows, max_prompt_length=max_prompt_length,
        max_response_length=max_response_length, batch_size=3,
    )
    expected = loop_perplexity(model, tokenizer, rows, max_prompt_length, max_response_length)
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert result.rows == len(rows)
    if max_prompt_length == 20:
        assert result.prompts_truncated == len(rows)  # every Alpaca prompt is over 20 tokens
        assert result.responses_truncated > 0


def test_perplexity_of_a_single_row_is_exp_of_its_nll(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    row = EvalRow(index=0, line=1, prompt="Q: sky?\nA:", references=(" blue",))
    result = response_perplexity(model, tokenizer, [row])
    assert result.perplexity == pytest.approx(math.exp(result.nll))
    assert result.tokens == len(tokenizer(" blue", add_special_tokens=False)["input_ids"]) + 1
