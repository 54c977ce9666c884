"""Generation from a model in the middle of ZeRO-3 training, over two CPU processes (gloo).

The ranks get different numbers of prompts, so one of them must run dummy batches and keep
stepping while the other still generates, or the run hangs. Each rank's completions must equal
a single-process run of the same model with the same seeds, and the engine must come back in
train mode with its settings.

Run as a script (under torchrun), this file is the worker.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from conftest import EXAMPLES, torchrun
from mta.evaluation.datasets import load_rows
from mta.generation import HFGenerator, SamplingParams, sampling_seed
from mta.models.tokenizers import load_tokenizer

PARAMS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_new_tokens=6)
BATCH_SIZE = 2
SHARES = {0: [0, 1, 2, 3, 4], 1: [5]}  # row numbers per rank: 3 batches against 1
TIMEOUT_S = 120


def prompts_and_seeds(tokenizer, rows: list[int]) -> tuple[list[list[int]], list[int]]:
    """The prompts (cut to different lengths) and seeds of the example ``rows``."""
    examples, _ = load_rows(EXAMPLES, limit=max(rows) + 1)
    prompts = [tokenizer(examples[i].prompt, add_special_tokens=False)["input_ids"][: 16 + 3 * i] for i in rows]
    return prompts, [sampling_seed(7, "test/zero3", 0, i) for i in rows]


def completions(generator: HFGenerator, prompts, seeds) -> list[list]:
    """``[[token ids, finished], ...]`` in prompt order."""
    by_position = {c.position: [c.token_ids, c.finished] for batch in generator.generate(prompts, seeds) for c in batch}
    return [by_position[i] for i in range(len(prompts))]


def zero3_engine(model: torch.nn.Module):
    """A training engine (AdamW, ZeRO-3) that partitions every weight, however small."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def worker(model_dir: Path, out_dir: Path) -> None:
    from mta.training.engine import init_distributed

    torch.set_num_threads(1)
    rank, _ = init_distributed()
    tokenizer = load_tokenizer(model_dir)
    engine = zero3_engine(AutoModelForCausalLM.from_pretrained(model_dir))
    engine.train()
    engine.module.config.use_cache = False  # as gradient checkpointing leaves it
    config = engine.module.generation_config
    partitioned = all(p.data.numel() == 0 for p in engine.module.parameters())
    prompts, seeds = prompts_and_seeds(tokenizer, SHARES[rank])
    result = completions(HFGenerator(engine, tokenizer, PARAMS, batch_size=BATCH_SIZE), prompts, seeds)
    state = {
        "partitioned": partitioned,
        "training": engine.training and all(m.training for m in engine.module.modules()),
        "use_cache": engine.module.config.use_cache,
        "generation_config_kept": engine.module.generation_config is config,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"completions": result, "state": state}))
    # Leave together: a rank exiting with the group alive aborts ("terminate called ...").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def sharpened_copy(model_dir: Path, out_dir: Path) -> Path:
    """The model with its logits scaled up (a random init samples nearly uniformly), saved."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(out_dir)
    load_tokenizer(model_dir).save_pretrained(out_dir)
    return out_dir


def test_zero3_ranks_with_unequal_shares_finish_and_match_one_process(tiny_model_dir, tmp_path):
    model_dir = sharpened_copy(tiny_model_dir, tmp_path / "model")
    torchrun([__file__, "--model", model_dir, "--out", tmp_path], timeout=TIMEOUT_S)

    # One process, no partitioning, every row in one request (so in other batches).
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    rows = [row for share in SHARES.values() for row in share]
    generator = HFGenerator(model, tokenizer, PARAMS, batch_size=BATCH_SIZE)
    expected = completions(generator, *prompts_and_seeds(tokenizer, rows))
    by_row = dict(zip(rows, expected, strict=True))
    assert len({tuple(ids) for ids, _ in expected}) == len(rows)
    for rank, share in SHARES.items():
        written = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert written["state"] == {
            "partitioned": True,
            "training": True,
            "use_cache": False,
            "generation_config_kept": True,
        }
        assert written["completions"] == [by_row[row] for row in share]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args()
    worker(arguments.model, arguments.out)
