"""Edges of ``mta.generation`` that mutation testing (bench/mutation.py) found unchecked.

The EOS ids of a model or of its generation config, padding and stop ids on the tokens' device,
the generator's first sampled token against the sampler applied by hand, generation that stops
once every row has stopped, the dummy batches of a ZeRO-3 rank (scheduled, not run), the nucleus
at its boundary and the messages of refused input. Expected values come from plain loops and
``SamplingParams``' documented rules.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from fixtures.generation import completions, model_and_tokenizer, prompts  # noqa: F401  (fixtures)
from mta import distributed
from mta.generation import HFGenerator, KeyedGumbelSampler, SamplingParams
from mta.generation.generator import Completion, cut_at_stop, eos_token_ids, left_pad
from mta.generation.sampling import restricted_logits


def test_eos_ids_join_the_tokenizers_and_the_configs_own():
    tokenizer = SimpleNamespace(eos_token_id=2)
    assert eos_token_ids(SimpleNamespace(generation_config=GenerationConfig(eos_token_id=[7, 3])), tokenizer) == [
        2,
        3,
        7,
    ]
    assert eos_token_ids(GenerationConfig(eos_token_id=9), tokenizer) == [2, 9]
    assert eos_token_ids(GenerationConfig(), tokenizer) == [2]
    with pytest.raises(ValueError, match="^neither the tokenizer nor the model names an EOS token$"):
        eos_token_ids(GenerationConfig(), SimpleNamespace(eos_token_id=None))


def test_left_padding_is_long_and_lands_on_the_asked_device():
    prompts_ = [[5, 6, 7], [8]]
    input_ids, attention_mask = left_pad(prompts_, 0, torch.device("meta"))
    assert input_ids.device.type == attention_mask.device.type == "meta"
    input_ids, attention_mask = left_pad(prompts_, 0, torch.device("cpu"))
    assert input_ids.dtype == attention_mask.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]] and attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_stop_ids_are_built_on_the_tokens_device_not_the_default_one():
    new_tokens = torch.tensor([[4, 3, 1], [5, 6, 7]])
    with torch.device("meta"):  # whatever is built without a device lands here
        kept, finished = cut_at_stop(new_tokens, [3])
    assert kept == [[4], [5, 6, 7]] and finished == [True, False]


def test_gumbel_noise_is_drawn_on_the_scores_device_not_the_default_one():
    scores = torch.tensor([[0.5, 0.1, -0.2]])
    with torch.device("meta"):
        noisy = KeyedGumbelSampler(SamplingParams(), [3])(torch.zeros(1, 1, dtype=torch.long), scores)
    assert noisy.device.type == "cpu" and torch.isfinite(noisy).all()


def test_the_sampler_refuses_a_batch_of_another_size():
    with pytest.raises(ValueError, match="^KeyedGumbelSampler got 2 rows for 1 seeds$"):
        KeyedGumbelSampler(SamplingParams(), [3])(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 4))


def test_top_k_below_the_vocabulary_applies_to_a_single_row():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(restricted_logits(logits, SamplingParams(top_k=2))).tolist()
    assert kept == [[True, True, False, False]]


def test_the_nucleus_keeps_tokens_whose_mass_before_is_below_top_p():
    uniform = torch.zeros(1, 4)  # probabilities exactly 1/4: the mass before them 0, 1/4, 1/2, 3/4
    assert torch.isfinite(restricted_logits(uniform, SamplingParams(top_p=0.5))).sum() == 2
    assert torch.isfinite(restricted_logits(uniform, SamplingParams(top_p=0.51))).sum() == 3
    peaked = torch.tensor([[30.0, 0.0, 0.0]])  # float32 mass before the tail tokens rounds to 1
    assert torch.isfinite(restricted_logits(peaked, SamplingParams(top_p=1.0))).all()


def test_sampling_params_normalise_stop_ids_and_take_the_boundaries():
    params = SamplingParams(stop_token_ids=[3, np.int64(4)], max_new_tokens=1, top_p=1.0)  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 4) and all(type(i) is int for i in params.stop_token_ids)
    hash(params)  # frozen and hashable: the ids are a tuple
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_the_first_sampled_token_is_the_samplers_argmax_over_the_models_logits(model_and_tokenizer, prompts):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    params = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=2)
    for seed, prompt in zip((11, 12, 13), prompts[:3], strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[:, -1]
        want = KeyedGumbelSampler(params, [seed])(torch.tensor([prompt]), logits).argmax(dim=1).item()
        (completion,) = next(iter(HFGenerator(model, tokenizer, params).generate([prompt], [seed])))
        assert completion.token_ids[0] == want


def forward_calls(model) -> tuple[list[int], object]:
    widths: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return widths, handle


def test_generation_stops_when_every_row_has_stopped_and_reuses_the_cache(model_and_tokenizer, prompts):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    free = completions(HFGenerator(model, tokenizer, SamplingParams(max_new_tokens=12)), prompts[:1], [5])[0][0]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(free[1],))
    widths, handle = forward_calls(model)
    try:
        stopped = completions(HFGenerator(model, tokenizer, params), prompts[:1], [5])[0]
    finally:
        handle.remove()
    assert stopped == (free[:1], True)
    assert widths == [len(prompts[0]), 1]  # the prompt, then one cached token: no 12-token run


def test_min_new_tokens_holds_back_the_stop_token_the_same_seed_draws(model_and_tokenizer, prompts):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    free = completions(HFGenerator(model, tokenizer, SamplingParams(max_new_tokens=6)), prompts[:1], [5])[0][0]
    stop = free[1]
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(stop,), min_new_tokens=3)
    held, finished = completions(HFGenerator(model, tokenizer, params), prompts[:1], [5])[0]
    assert held[0] == free[0] and held[1] != stop and len(held) >= 3


def test_the_pad_id_is_the_tokenizers_or_else_the_first_eos(model_and_tokenizer):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    saved_config, saved_pad = model.generation_config, tokenizer.pad_token
    try:
        model.generation_config = GenerationConfig(
            eos_token_id=[tokenizer.eos_token_id + 1, tokenizer.eos_token_id + 2]
        )
        tokenizer.pad_token = None
        generator = HFGenerator(model, tokenizer, SamplingParams())
        assert generator.pad_id == tokenizer.eos_token_id == generator.stop_ids[0]
        assert generator.config.pad_token_id == generator.pad_id and generator.config.eos_token_id == generator.stop_ids
    finally:
        model.generation_config, tokenizer.pad_token = saved_config, saved_pad
    saved_pad = tokenizer.pad_token
    try:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id + 5)
        assert HFGenerator(model, tokenizer, SamplingParams()).pad_id == tokenizer.eos_token_id + 5
    finally:
        tokenizer.pad_token = saved_pad
    assert HFGenerator(model, tokenizer, SamplingParams()).batch_size == 16  # the documented default


def test_a_zero3_rank_runs_as_many_batches_as_the_busiest_rank(model_and_tokenizer, monkeypatch):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    generator = HFGenerator(model, tokenizer, SamplingParams(), batch_size=2)
    assert generator.synced is False  # several processes, but the weights are whole: no lockstep
    ran: list[list[int]] = []
    monkeypatch.setattr(
        generator,
        "_complete",
        lambda positions, p, s: ran.append(positions) or [Completion(i, [], True) for i in positions],
    )
    list(generator.generate([[1], [2, 3], [4]], [0, 1, 2]))
    assert ran == [[1, 0], [2]]  # no dummy batch
    generator.synced = True
    monkeypatch.setattr(distributed, "max_over_ranks", lambda count: count + 3)
    ran.clear()
    list(generator.generate([[1], [2, 3], [4]], [0, 1, 2]))
    assert ran == [[1, 0], [2], [0], [0], [0]]  # three dummy batches after the two real ones
    with pytest.raises(ValueError, match="^3 prompts but 2 seeds$"):
        list(generator.generate([[1], [2], [3]], [0, 1]))


def test_a_dummy_batch_runs_one_pad_token_prompt_and_drops_it(model_and_tokenizer, monkeypatch):  # noqa: F811
    model, tokenizer = model_and_tokenizer
    generator = HFGenerator(model, tokenizer, SamplingParams(max_new_tokens=2))
    seen = []
    real = generator._sample
    monkeypatch.setattr(
        generator, "_sample", lambda ids, mask, seeds: seen.append((ids.tolist(), seeds)) or real(ids, mask, seeds)
    )
    assert generator._dummy_batch() is None
    assert seen == [([[generator.pad_id]], [0])]


def test_the_sampler_is_described_as_artefacts_record_it():
    key = "{seed}/{purpose}/{step}/{row}"
    assert SamplingParams(temperature=0, stop_token_ids=(4,)).describe() == "greedy decoding, stop ids [4]"
    assert SamplingParams(temperature=0.7, top_k=5, top_p=0.9).describe() == (
        f"keyed Gumbel-max, seed key {key}: temperature 0.7, top_k 5, top_p 0.9"
    )
    assert SamplingParams(top_k=3).describe(engine="vllm") == (
        f"vLLM's sampler, per-request seed from the key {key}: temperature 1.0, top_k 3, top_p 1.0"
    )
