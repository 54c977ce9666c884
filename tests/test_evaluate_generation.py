"""Sampling, batched generation and teacher-forced perplexity against plain references."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mta.evaluation.datasets import EvalRow, load_rows
from mta.generation.generator import HFGenerator, length_sorted_batches, left_pad
from mta.evaluation.perplexity import response_perplexity
from mta.generation.sampling import KeyedGumbelNoise, row_seed
from mta.models.tokenizers import load_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "tiny.jsonl"


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, load_tokenizer(tiny_model_dir)


def test_gumbel_noise_samples_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    rows = 20_000
    noisy = KeyedGumbelNoise(range(rows))(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, 4))
    frequencies = torch.bincount(noisy.argmax(-1), minlength=4).double() / rows
    # Binomial std at p = 0.64 and 20k draws is 0.0034: 0.015 is over 4 sigma.
    assert torch.allclose(frequencies, torch.softmax(logits.double(), 0), atol=0.015)


def test_a_rows_noise_does_not_depend_on_its_batch():
    scores = torch.zeros(3, 50)
    alone = KeyedGumbelNoise([7])(None, scores[:1])
    in_batch = KeyedGumbelNoise([3, 7, 9])(None, scores)
    assert torch.equal(alone[0], in_batch[1])
    assert not torch.equal(in_batch[0], in_batch[1])
    assert row_seed(10, "dolly", 3) == row_seed(10, "dolly", 3) != row_seed(20, "dolly", 3)


def test_batches_group_similar_lengths_longest_first():
    assert length_sorted_batches([3, 9, 1, 7, 5], 2) == [[1, 3], [4, 0], [2]]
    input_ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batched_generation_equals_one_prompt_at_a_time(model_and_tokenizer):
    """Left padding, position ids and the KV cache are right when batch composition changes
    nothing: each row keeps its own noise, so its sample is the same alone or in a batch."""
    model, tokenizer = model_and_tokenizer
    rows, _ = load_rows(EXAMPLES, limit=5)
    prompts = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"][: 24 + 4 * r.index] for r in rows]
    seeds = [row_seed(10, "test", r.index) for r in rows]

    def run(batch_size: int) -> dict:
        generator = HFGenerator(model, tokenizer, batch_size=batch_size, max_new_tokens=8)
        return {c.position: (c.token_ids, c.finished) for batch in generator.generate(prompts, seeds) for c in batch}

    batched, single = run(3), run(1)
    assert batched == single
    assert len({tuple(ids) for ids, _ in batched.values()}) > 1


def test_generation_ignores_settings_saved_with_the_model(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer("Give three tips.", add_special_tokens=False)["input_ids"]]
    first = next(HFGenerator(model, tokenizer, max_new_tokens=10).generate(prompts, [1]))[0]
    saved = model.generation_config
    model.generation_config = saved.__class__(**{**saved.to_dict(), "repetition_penalty": 50.0, "top_k": 1})
    try:
        again = next(HFGenerator(model, tokenizer, max_new_tokens=10).generate(prompts, [1]))[0]
    finally:
        model.generation_config = saved
    assert again.token_ids == first.token_ids


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
