"""The generation engine: keyed sampling against a plain implementation, batching, stop tokens,
and a model borrowed from training given back exactly as it was."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from fixtures.generation import completions, model_and_tokenizer, prompts  # noqa: F401  (fixtures)
from mta.generation import HFGenerator, KeyedGumbelSampler, SamplingParams, sampling_seed
from mta.generation.generator import cut_at_stop, left_pad, length_sorted_batches

# Two rows of distinct logits, not sorted alike, so a mask computed across rows would show.
LOGITS = (
    [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0],
    [-1.0, 0.3, 1.7, -0.2, 0.9, -2.5, 0.1, 1.2],
)


def plain_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(logits / T) over the top-k, renormalised, then over the top-p nucleus, renormalised:
    one token at a time, most likely first."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k else order
    total = sum(math.exp(scaled[i]) for i in kept)
    probs = {i: math.exp(scaled[i]) / total for i in kept}
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += probs[i]
    return [probs[i] / mass if i in nucleus else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.5, 0, 0.8), (1.0, 5, 0.7), (2.0, 4, 0.55)],
)
def test_keyed_draws_follow_the_restricted_softmax(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    draws = 20_000  # per row of LOGITS, interleaved in one batch
    scores = torch.tensor(LOGITS).repeat(draws, 1)  # [2 * draws, 8]: rows A, B, A, B, ...
    sampler = KeyedGumbelSampler(params, [sampling_seed(1, "test", 0, row) for row in range(2 * draws)])
    tokens = sampler(None, scores).argmax(-1)
    for which, logits in enumerate(LOGITS):
        counts = torch.bincount(tokens[which::2], minlength=len(logits)).double()
        expected = torch.tensor(plain_distribution(logits, temperature, top_k, top_p), dtype=torch.float64)
        assert counts[expected == 0].sum() == 0  # a token outside the top-k / nucleus never appears
        # Binomial std is at most 0.0035 at 20k draws: 0.015 is over 4 sigma.
        assert torch.allclose(counts / draws, expected, atol=0.015)


def test_temperature_zero_is_greedy():
    scores = torch.tensor(LOGITS)
    greedy = KeyedGumbelSampler(SamplingParams(temperature=0), [1, 2])(None, scores)
    assert torch.equal(greedy, scores)


def test_a_rows_draw_does_not_depend_on_its_batch():
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone = KeyedGumbelSampler(params, [7])(None, scores[1:2])
    in_batch = KeyedGumbelSampler(params, [3, 7, 9])(None, scores)
    assert torch.equal(alone[0], in_batch[1])


def test_the_seed_key_is_the_documented_hash():
    digest = hashlib.sha256(b"10/evaluate/dolly/0/3").digest()
    assert sampling_seed(10, "evaluate/dolly", 0, 3) == int.from_bytes(digest[:8], "little") & (2**63 - 1)
    keys = {sampling_seed(10, p, s, r) for p in ("evaluate/dolly", "dev-samples") for s in (0, 1) for r in (3, 4)}
    assert len(keys) == 8


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens"),
    ],
)
def test_sampling_params_refuse_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_batches_group_similar_lengths_longest_first():
    assert length_sorted_batches([3, 9, 1, 7, 5], 2) == [[1, 3], [4, 0], [2]]
    input_ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_completions_end_before_their_first_stop_token():
    new_tokens = torch.tensor([[4, 5, 2, 0, 0], [4, 9, 5, 6, 7], [3, 0, 0, 0, 0]])
    kept, finished = cut_at_stop(new_tokens, [3, 9])
    assert kept == [[4, 5, 2, 0, 0], [4], []]
    assert finished == [False, True, True]


def test_batched_generation_equals_one_prompt_at_a_time(model_and_tokenizer, prompts):  # noqa: F811
    """Left padding, position ids and the KV cache are right when batch composition changes
    nothing: each row keeps its own noise, so its sample is the same alone or in a batch."""
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8)
    seeds = [sampling_seed(10, "test", 0, row) for row in range(len(prompts))]
    batched = completions(HFGenerator(model, tokenizer, params, batch_size=3), prompts, seeds)
    single = completions(HFGenerator(model, tokenizer, params, batch_size=1), prompts, seeds)
    assert batched == single
    assert len({tuple(ids) for ids, _ in batched.values()}) > 1


def test_top_k_one_is_greedy_decoding(model_and_tokenizer, prompts):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    seeds = list(range(len(prompts)))
    top_1 = completions(HFGenerator(model, tokenizer, SamplingParams(top_k=1, max_new_tokens=6)), prompts, seeds)
    greedy = completions(HFGenerator(model, tokenizer, SamplingParams(temperature=0, max_new_tokens=6)), prompts, seeds)
    assert top_1 == greedy


def test_a_stop_token_ends_the_completion_where_it_first_appears(model_and_tokenizer, prompts):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=12)
    free = completions(HFGenerator(model, tokenizer, params), prompts[:1], [5])[0][0]
    stop = free[4]
    stopped = completions(
        HFGenerator(model, tokenizer, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))), prompts[:1], [5]
    )
    assert stopped[0] == (free[: free.index(stop)], True)


def test_min_new_tokens_holds_every_stop_token_back(model_and_tokenizer, prompts):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    stop = completions(HFGenerator(model, tokenizer, SamplingParams(max_new_tokens=12)), prompts[:1], [5])[0][0][1]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), min_new_tokens=12)
    held = completions(HFGenerator(model, tokenizer, params), prompts, list(range(len(prompts))))
    stops = {stop, tokenizer.eos_token_id}
    assert all(len(ids) == 12 and not finished and not stops & set(ids) for ids, finished in held.values())


def test_generation_ignores_settings_saved_with_the_model(model_and_tokenizer, prompts):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(max_new_tokens=10)
    first = completions(HFGenerator(model, tokenizer, params), prompts[:1], [1])
    saved = model.generation_config
    model.generation_config = saved.__class__(**{**saved.to_dict(), "repetition_penalty": 50.0, "top_k": 1})
    try:
        again = completions(HFGenerator(model, tokenizer, params), prompts[:1], [1])
    finally:
        model.generation_config = saved
    assert again == first


def borrowed_state(model) -> dict:
    """What generation may touch and must give back."""
    return {
        "modes": {name: module.training for name, module in model.named_modules()},
        "generation_config": id(model.generation_config),
        "use_cache": model.config.use_cache,
        "rng": torch.get_rng_state(),
    }


def test_a_model_in_training_is_given_back_as_it_was(model_and_tokenizer, prompts, monkeypatch):  # noqa: F811
    """Train/eval flag of every module, generation config, use_cache and the global RNG, after a
    normal run and after a failing one; the samples are those of the model in eval mode."""
    model, tokenizer = model_and_tokenizer
    seeds = list(range(len(prompts)))
    generator = HFGenerator(model, tokenizer, SamplingParams(max_new_tokens=4), batch_size=2)
    in_eval_mode = completions(generator, prompts, seeds)
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back module by module
    model.config.use_cache = False
    before = borrowed_state(model)
    try:
        assert completions(generator, prompts, seeds) == in_eval_mode
        after = borrowed_state(model)
        assert after.pop("rng").equal(before["rng"]) and after == {k: v for k, v in before.items() if k != "rng"}

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(model, "forward", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            completions(generator, prompts, seeds)
        monkeypatch.undo()
        after = borrowed_state(model)
        assert after.pop("rng").equal(before["rng"]) and after == {k: v for k, v in before.items() if k != "rng"}
    finally:
        model.eval()
        model.config.use_cache = True
