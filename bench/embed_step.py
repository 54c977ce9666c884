"""Benchmark: TALAS's costs. Two halves, one JSON (bench/results/embed_step.json):

    python bench/embed_step.py [--quick] [--only throughput|step] [--teacher minilm|mpnet|DIR]
                               [--texts N] [--rounds R] [--batch-size B] [--max-length L]

**throughput** (``mta embed``): texts/s of the teacher-embedding stage against a bare
``model(**batch)`` loop over the same texts, same batch size and length limit, one process,
one model already loaded (the stage's loader is handed the loaded encoder, so the figures
compare the per-text work, not a model load every loop pays once; the load is timed apart):

- ``stage``: :func:`mta.embedding.embed.run_embed` into a fresh directory: read
  and hash the input, tokenise for the length plan, length-sorted batches, pooling, journalled
  Parquet chunks, the part, the manifest;
- ``bare_input_order``: ``tokenizer(batch, padding=True, truncation=True)`` then
  ``model(**batch)``, batches in file order: what one writes by hand (target: stage >= 0.9x);
- ``bare_length_sorted``: the same loop over the stage's own length-sorted batches: the
  stage's overhead alone.

**step** (TALAS training steps, ``Trainer.step`` through DeepSpeed ZeRO-1 as ``mta distill``
runs it, on a MiniLM-L6-H384-shaped student with stored 1024-wide teacher embeddings):

- ``cosine_last``: (a) ``1 − cos(W e_L, e_T)`` on the last layer only;
- ``talas``: (b) 0.001·SimCSE + 0.75·TAMD (K 2) + 1·LASD (two student forwards: SimCSE's dropout pass);
- ``talas_asam``: (c) the same under ASAM (ρ 0.05): the window twice, a copy of the weights;

medians per step and ASAM's cost as the paired ratio talas_asam / talas (target <= 2.0; the
paper reports 375 / 195 ms). On a CPU the ratios use the process's CPU time (one torch thread),
on a GPU the synchronised wall time, with each variant's peak memory.

Variants are interleaved over rounds (bench/interleaving.py); medians and paired ratios go to
the JSON with the machine's load. ``--only`` reruns one half and keeps the other's last
results. Texts: Dolly **dev** (``../shared``), by ``mta embed``'s text rule.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interleaving import interleaved_rounds, paired_ratio  # noqa: E402
from machine import created, describe_machine  # noqa: E402
from mta.embedding import embed as stage  # noqa: E402
from mta.embedding.encoder import load_encoder  # noqa: E402
from mta.files import atomic_write_json  # noqa: E402
from paths import portable  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MTA_SHARED_DIR", REPO.parent / "shared"))
DEFAULT_DATA = SHARED / "data" / "instruct" / "dolly" / "dev.jsonl"
RESULTS = REPO / "bench" / "results" / "embed_step.json"


# --------------------------------------------------------------------------- throughput cases


def measure_stage(encoder, data: Path, args, scratch: Path) -> int:
    """``mta embed`` end to end on ``data`` (the loaded ``encoder`` stands in for the load)."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    original = stage.load_encoder
    stage.load_encoder = lambda *a, **k: encoder
    try:
        outcome = stage.run_embed(
            args.teacher_dir,
            data,
            out / "emb",
            batch_size=args.batch_size,
            max_length=args.max_length,
            dtype="fp32",
            device="cpu",
            shard=(0, 1),
        )
    finally:
        stage.load_encoder = original
    return outcome.rows


@torch.inference_mode()
def measure_bare_input_order(encoder, texts: list[str], args) -> int:
    """``tokenizer(...)`` + ``model(**batch)`` over batches in file order."""
    for start in range(0, len(texts), args.batch_size):
        batch = encoder.tokenizer(
            texts[start : start + args.batch_size],
            padding=True,
            truncation=True,
            max_length=encoder.max_length,
            return_tensors="pt",
        )
        encoder.model(**batch)
    return len(texts)


@torch.inference_mode()
def measure_bare_length_sorted(encoder, texts: list[str], args) -> int:
    """The same loop over the stage's own length-sorted batches."""
    lengths = encoder.lengths(texts)
    for batch in stage.plan_batches(lengths, list(range(len(texts))), args.batch_size):
        encoded = encoder.tokenizer(
            [texts[i] for i in batch], padding=True, truncation=True, max_length=encoder.max_length, return_tensors="pt"
        )
        encoder.model(**encoded)
    return len(texts)


def throughput(args) -> dict:
    rows = [json.loads(line) for line in DEFAULT_DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[: args.texts]
    texts = [stage.embedding_text(row) for row in rows]
    started = time.perf_counter()
    encoder = load_encoder(args.teacher_dir, max_length=args.max_length, dtype=torch.float32, device="cpu")
    load_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        data = scratch / "texts.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        cases = {
            "stage": lambda: measure_stage(encoder, data, args, scratch),
            "bare_input_order": lambda: measure_bare_input_order(encoder, texts, args),
            "bare_length_sorted": lambda: measure_bare_length_sorted(encoder, texts, args),
        }
        rates: dict[str, list[float]] = {name: [] for name in cases}

        def measure(name: str) -> None:
            begin = time.perf_counter()
            done = cases[name]()
            rates[name].append(done / (time.perf_counter() - begin))

        interleaved_rounds(
            list(cases),
            args.rounds,
            measure,
            warm_up=lambda name: cases[name](),
            describe=lambda name: f"{name} {rates[name][-1]:.1f} texts/s",
        )
    return {
        "teacher": portable(args.teacher_dir),
        "texts": len(texts),
        "batch_size": args.batch_size,
        "max_length": encoder.max_length,
        "rounds": args.rounds,
        "load_s": round(load_s, 3),
        "texts_per_s": {name: {"median": statistics.median(v), "per_round": v} for name, v in rates.items()},
        "ratio_stage_over_bare_input_order": paired_ratio(rates["stage"], rates["bare_input_order"]),
        "ratio_stage_over_bare_length_sorted": paired_ratio(rates["stage"], rates["bare_length_sorted"]),
        "target": "stage >= 0.9 x bare_input_order",
    }


# --------------------------------------------------------------------------- step cases

STEP_VARIANTS = {
    # (a) cosine to the teacher on the last layer only (TAMD with K = 1, nothing else)
    "cosine_last": {
        "loss": {"simcse_weight": 0.0, "tamd_weight": 1.0, "lasd_weight": 0.0, "tamd_layers": 1},
        "asam": None,
    },
    # (b) TALAS's objective: 0.001·SimCSE + 0.75·TAMD (K 2) + 1·LASD, the recipe defaults
    "talas": {"loss": {}, "asam": None},
    # (c) the same under ASAM (rho 0.05, the author's)
    "talas_asam": {"loss": {}, "asam": {"rho": 0.05}},
}


def _step_trainer(variant: dict, student, args, device: torch.device):
    """``Trainer.step`` as ``mta distill`` runs it (DeepSpeed ZeRO-1, AdamW, clipping, the
    objective, ASAM) over ``student`` with one micro batch per step, its batches supplied here."""
    from types import SimpleNamespace

    from mta.embedding.objective import EmbeddingDistillationModel, EmbeddingObjective
    from mta.embedding.recipe import EmbeddingLossSpec
    from mta.training import engine as engines
    from mta.training.config.schema import AsamSpec, TrainSpec
    from mta.training.trainer import Trainer

    asam = AsamSpec(**variant["asam"]) if variant["asam"] is not None else None
    train = TrainSpec(
        lr=2e-5,
        projector_lr=1e-4,
        batch_size=args.step_batch,
        micro_batch_size=args.step_batch,
        max_steps=10**6,
        precision=args.step_precision,
        zero_stage=1,
        asam=asam,
    )
    torch.manual_seed(0)
    objective = EmbeddingObjective(
        EmbeddingLossSpec(**variant["loss"]),
        num_layers=student.config.num_hidden_layers,
        student_dim=student.config.hidden_size,
        teacher_dim=args.teacher_width,
        pooling="cls_attention",
    )
    model = EmbeddingDistillationModel(student, objective, max_seq_length=args.step_length)
    engine = engines.initialize(model, model.projector_parameters(), train, {}, 10**6, 1)
    precision = engines.resolve_training_precision(train, device)
    run = SimpleNamespace(
        engine=engine,
        device=device,
        teacher=None,
        schedule=SimpleNamespace(accumulation=1),
        recipe=SimpleNamespace(train=train, task="embedding"),
        precision=precision,
        flops=SimpleNamespace(count=lambda batch: None, take=lambda: 0.0),
        output_dir=Path("."),
    )
    trainer = Trainer(run, reporter=None)
    engine.train()
    return trainer


def _step_batches(args, vocab: int, count: int):
    """Right-padded random token batches, lengths between half the limit and the limit (CLS first)."""
    from mta.embedding.training_data import EmbeddingBatch

    g = torch.Generator().manual_seed(1)
    batches = []
    for index in range(count):
        lengths = torch.randint(args.step_length // 2, args.step_length + 1, (args.step_batch,), generator=g)
        mask = (torch.arange(args.step_length)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1000, vocab, (args.step_batch, args.step_length), generator=g) * mask
        ids[:, 0] = 101
        teacher = torch.randn(args.step_batch, args.teacher_width, generator=g)
        batches.append(
            EmbeddingBatch(ids, mask, teacher, list(range(index * args.step_batch, (index + 1) * args.step_batch)))
        )
    return batches


def talas_step_times(args) -> dict:
    """Seconds per optimizer step of (a), (b), (c) on a MiniLM-L6-H384-shaped student (random
    weights: the cost does not depend on them) with stored 1024-wide teacher embeddings
    (Qwen3-Embedding-0.6B's width; the teacher never runs in a step), interleaved rounds of
    ``--step-repeats`` steps each; medians, and ASAM's cost as the paired ratio (c) / (b)
    (target <= 2.0; the paper: 375 / 195 ms = 1.92)."""
    import copy

    from transformers import BertConfig, BertModel

    from mta.training import engine as engines

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(1)  # as bench/distill_step.py: CPU time on a shared machine
    engines.init_distributed()
    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    base = BertModel(config)
    trainers = {
        name: _step_trainer(variant, copy.deepcopy(base).to(device), args, device)
        for name, variant in STEP_VARIANTS.items()
    }
    batches = _step_batches(args, config.vocab_size, args.step_repeats)
    seconds: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in trainers}
    peak: dict[str, int] = {}
    steps = {name: 0 for name in trainers}

    def run_steps(name: str, record: bool) -> None:
        trainer = trainers[name]
        if not cpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        wall, spent = time.perf_counter(), time.process_time()
        for batch in batches:
            trainer.micro_batches = lambda _step, batch=batch: iter([batch])
            trainer.step(steps[name])
            steps[name] += 1
        if not cpu:
            torch.cuda.synchronize(device)
            peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated(device))
        if record:
            seconds[name]["wall"].append((time.perf_counter() - wall) / len(batches))
            seconds[name]["cpu"].append((time.process_time() - spent) / len(batches))

    interleaved_rounds(
        list(trainers),
        args.rounds,
        lambda name: run_steps(name, True),
        warm_up=lambda name: run_steps(name, False),
        describe=lambda name: f"{name} {1000 * seconds[name]['wall'][-1]:.0f} ms",
    )
    for trainer in trainers.values():
        trainer.run.engine.destroy()
    clock = "cpu" if cpu else "wall"
    result = {
        "student": "MiniLM-L6-H384 (BertModel, random weights)",
        "teacher_width": args.teacher_width,
        "batch_size": args.step_batch,
        "max_length": args.step_length,
        "precision": args.step_precision,
        "zero_stage": 1,
        "rounds": args.rounds,
        "steps_per_round": args.step_repeats,
        "clock_for_ratios": clock,
        "seconds_per_step": {
            name: {
                "median_wall": statistics.median(v["wall"]),
                "median_cpu": statistics.median(v["cpu"]),
                "per_round_wall": v["wall"],
                "per_round_cpu": v["cpu"],
            }
            for name, v in seconds.items()
        },
        "ratio_talas_over_cosine_last": paired_ratio(seconds["talas"][clock], seconds["cosine_last"][clock]),
        "ratio_asam_over_talas": paired_ratio(seconds["talas_asam"][clock], seconds["talas"][clock]),
        "target": "ratio_asam_over_talas <= 2.0 (paper: 375 / 195 ms = 1.92)",
    }
    if peak:
        result["peak_memory_bytes"] = peak
    return result


# name -> function(args) -> dict: the training half of the benchmark.
STEP_CASES: dict = {"talas": talas_step_times}


def step(args) -> dict:
    if not STEP_CASES:
        return {"skipped": "no step cases yet (STEP_CASES is empty)"}
    return {name: case(args) for name, case in STEP_CASES.items()}


# --------------------------------------------------------------------------- the command


def teacher_directory(name: str) -> Path:
    from mta.embedding.sentence_encoders import ENCODERS, convert_packaged_encoder

    if name in ENCODERS:
        return convert_packaged_encoder(name)
    return Path(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="96 texts, 2 rounds: checks that it runs")
    parser.add_argument("--only", choices=("throughput", "step"), default=None)
    parser.add_argument("--teacher", default="minilm", help="minilm, mpnet (the packaged encoders) or a directory")
    parser.add_argument("--texts", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--device", default="auto", help="step half: auto (a GPU when there is one), cpu, cuda")
    parser.add_argument("--step-batch", type=int, default=None, help="step half: texts per step (default 32; quick 8)")
    parser.add_argument("--step-repeats", type=int, default=None, help="step half: steps per variant per round")
    parser.add_argument(
        "--step-length", type=int, default=None, help="step half: tokens per text (default 128; quick 64)"
    )
    parser.add_argument("--step-precision", default="fp32", choices=("fp32", "bf16"), help="step half: train.precision")
    parser.add_argument("--teacher-width", type=int, default=1024, help="step half: the stored embeddings' width")
    args = parser.parse_args()
    args.texts = args.texts or (96 if args.quick else 1000)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.step_batch = args.step_batch or (8 if args.quick else 32)
    args.step_repeats = args.step_repeats or (1 if args.quick else 3)
    args.step_length = args.step_length or (64 if args.quick else 128)
    if args.only != "step":
        if not DEFAULT_DATA.is_file():
            sys.exit(f"skipped: {DEFAULT_DATA} is absent (../shared); set MTA_SHARED_DIR")
        args.teacher_dir = teacher_directory(args.teacher)
    previous = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.is_file() else {}
    results = {"created": created(), "quick": args.quick, "machine": describe_machine(torch.device("cpu"))}
    results["throughput"] = throughput(args) if args.only in (None, "throughput") else previous.get("throughput")
    results["step"] = step(args) if args.only in (None, "step") else previous.get("step")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS, results)
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=2)[:3000])


if __name__ == "__main__":
    main()
