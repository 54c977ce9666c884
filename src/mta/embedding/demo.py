"""`make demo-embed`: TALAS on real sentence encoders, three objectives from the same start.

all-mpnet-base-v2 teaches all-MiniLM-L6-v2 pruned to 3 layers on Dolly texts, three ways
(``VARIANTS``: ``cosine``, plain 1 − cos on the last layer; ``talas``, 0.001·SimCSE + 0.75·TAMD +
1·LASD; ``talas+asam``), scored by teacher agreement on held-out Dolly texts. The student pools
with mean (MiniLM's own), and the learning rates are above the author's 2e-5 because the demo
trains a few dozen steps, not 5 epochs. Every stage is reused when complete; each run trains in a
process of its own. The directory and what is timed: ARCHITECTURE.md, "4. demo".
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mta.demo.report import (
    RESULTS_JSON,
    bar_positions,
    plot_training_losses,
    pyplot,
    report_heading,
    save_figure,
    train_records,
    write_report_files,
)
from mta.errors import MtaError
from mta.evaluation.results import mean_std
from mta.files import atomic_write_json
from mta.reporting import Reporter, SilentReporter
from mta.tables import markdown_table
from mta.training.config.catalog import SHIPPED_DIR

TALAS_RECIPE = SHIPPED_DIR / "talas-minilm.yaml"
START_LABEL = "pruned start"  # the students' common initialisation, untrained
DEMO_LAYOUT = 1


@dataclass(frozen=True)
class EmbedVariant:
    name: str  # directory and label
    overrides: tuple[str, ...]
    description: str


VARIANTS = (
    EmbedVariant(
        "cosine",
        ("loss.simcse_weight=0", "loss.lasd_weight=0", "loss.tamd_weight=1.0", "loss.tamd_layers=1", "train.asam=null"),
        "1 − cos(W·e_L, e_teacher) on the last layer only, AdamW",
    ),
    EmbedVariant("talas", ("train.asam=null",), "0.001·SimCSE + 0.75·TAMD (top 2 layers) + 1·LASD, AdamW"),
    EmbedVariant("talas+asam", (), "the same under ASAM (ρ 0.05, T_w = |w|)"),
)


@dataclass(frozen=True)
class EmbedDemoSettings:
    """Sizes of one demo run: ``full()`` is ``make demo-embed``, ``quick()`` its check."""

    name: str
    train_texts: int = 400  # 24 steps x 16 texts: each text at most once
    held_out_texts: int = 200
    steps: int = 24
    batch_size: int = 16
    max_length: int = 64
    seeds: tuple[int, ...] = (1, 2)
    student_layers: int = 3
    lr: float = 1.0e-4
    projector_lr: float = 1.0e-3
    precision: str = "auto"  # training and the teacher's embedding: bf16 where the device has it
    max_pairs: int = 1_000_000

    @classmethod
    def full(cls) -> EmbedDemoSettings:
        return cls(name="full")

    @classmethod
    def quick(cls) -> EmbedDemoSettings:
        return cls(name="quick", train_texts=32, held_out_texts=40, steps=2, batch_size=8, max_length=32, seeds=(1,))


class _StepClock:
    """A reporter that forwards everything and notes when each training step ends."""

    def __init__(self, inner: Reporter):
        self.inner = inner
        self.times: list[float] = []
        self._steps = False

    def message(self, text: str) -> None:
        self.inner.message(text)

    def start(self, description, total, *, completed: int = 0, unit: str = "rows") -> None:
        self._steps = unit == "steps"
        if self._steps:
            self.times.append(time.perf_counter())
        self.inner.start(description, total, completed=completed, unit=unit)

    def advance(self, amount: int = 1, **counters) -> None:
        if self._steps:
            self.times.append(time.perf_counter())
        self.inner.advance(amount, **counters)

    def record(self, record) -> None:
        self.inner.record(record)

    def stop(self) -> None:
        self._steps = False
        self.inner.stop()

    def step_seconds(self) -> float | None:
        """The median step time, the first step (warm-up, first allocations) left out."""
        intervals = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]  # consecutive pairs
        intervals = intervals[1:] if len(intervals) > 1 else intervals
        return statistics.median(intervals) if intervals else None


class _PeakMemory:
    """The run's peak memory: CUDA's allocator peak, or the process's resident-set peak."""

    def __init__(self, device):
        self.device = device
        self.how = ""

    def __enter__(self) -> _PeakMemory:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.how = "torch.cuda.max_memory_allocated"
            return self
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current resident set
            self.how = "peak resident set of the run (VmHWM, reset before it)"
        except OSError:
            self.how = "peak resident set of the process so far (VmHWM could not be reset)"
        return self

    def __exit__(self, *exc) -> None:
        pass

    def current_mib(self) -> float | None:
        import torch

        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**20
        return _status_mib("VmRSS")

    def peak_mib(self) -> float | None:
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        found = _status_mib("VmHWM")
        if found is not None:
            return found
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mib(key: str) -> float | None:
    """A ``/proc/self/status`` size (``VmRSS``, ``VmHWM``) in MiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_embedding_demo(
    settings: EmbedDemoSettings,
    out_dir: str | Path = "runs/demo-embed",
    *,
    data_dir: str | Path | None = None,
    teacher: str | Path | None = None,
    student_source: str | Path | None = None,
    recipe_path: str | Path = TALAS_RECIPE,
    reporter: Reporter | None = None,
) -> dict:
    """Run (or finish) the demo; returns what results.json holds (the report draws it).

    teacher / student_source: encoder directories to use instead of the converted mpnet and
    MiniLM (tests pass tiny random ones).
    """
    from mta.distributed import available_cores, local_device
    from mta.dtypes import resolve_precision
    from mta.embedding.evaluation import EmbeddingEvalSettings, evaluate_embedding_checkpoints
    from mta.embedding.sentence_encoders import convert_packaged_encoder
    from mta.evaluation.datasets import default_data_dir

    reporter = reporter or SilentReporter()
    root = Path(out_dir)
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    device = local_device()
    precision = resolve_precision(settings.precision, device)
    _claim(root, settings, precision, reporter)

    teacher = (
        Path(teacher)
        if teacher is not None
        else convert_packaged_encoder("mpnet", report=lambda line: reporter.message(f"teacher: {line}"))
    )
    source = (
        Path(student_source)
        if student_source is not None
        else convert_packaged_encoder("minilm", report=lambda line: reporter.message(f"student: {line}"))
    )
    start = pruned_start(source, root, settings, reporter)

    rows = _sample_dolly(data_dir, root, settings)
    embeddings = embed_rows(teacher, rows, root, settings, reporter)

    finals: dict[str, Path] = {}
    runs: dict[str, dict] = {}
    for variant in VARIANTS:
        for seed in settings.seeds:
            label = f"{variant.name}/seed-{seed}"
            finals[label], runs[label] = _distill(
                recipe_path, variant, seed, settings, start, embeddings["train"], root, device, reporter
            )

    checkpoints = {START_LABEL: start, f"{source.name} (unpruned)": source, **finals}
    names = [_directory_name(label) for label in checkpoints]
    reporter.message(f"evaluate: teacher agreement on {settings.held_out_texts} held-out Dolly dev texts")
    evaluation = evaluate_embedding_checkpoints(
        list(checkpoints.values()),
        out_dir=root / "eval",
        names=names,
        teacher_embeddings=embeddings["held-out"],
        settings=EmbeddingEvalSettings(
            max_length=settings.max_length, batch_size=32, dtype="fp32", tasks=("none",), max_pairs=settings.max_pairs
        ),
        reporter=reporter,
    )
    by_label = {label: evaluation["checkpoints"][name] for label, name in zip(checkpoints, names, strict=True)}
    return {
        "settings": {
            "demo": asdict(settings),
            "recipe": str(recipe_path),
            "precision": precision,
            "teacher": str(teacher),
            "student_source": str(source),
        },
        "held_out": evaluation["sets"]["proxy"],
        "checkpoints": {
            label: {"checkpoint": str(path), **by_label[label]["sets"]["proxy"]} for label, path in checkpoints.items()
        },
        "runs": runs,
        "variants": {v.name: v.description for v in VARIANTS},
        "summary": summarise(by_label, runs, settings),
        "memory_measure": next(iter(runs.values()))["memory_measure"] if runs else None,
        "cores": available_cores(),
    }


def _directory_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-+=@" else "-" for c in label).strip("-")


def _claim(root: Path, settings: EmbedDemoSettings, precision: str, reporter: Reporter) -> None:
    """Start over when the directory holds a demo of other settings (quick and full overwrite
    each other)."""
    from mta.demo.pipeline import claim_demo_directory

    claim_demo_directory(root, {**asdict(settings), "layout": DEMO_LAYOUT, "resolved_precision": precision}, reporter)


def _sample_dolly(data_dir: Path, root: Path, settings: EmbedDemoSettings) -> dict[str, Path]:
    """A seeded sample of Dolly train rows (training) and the first Dolly dev rows (held out;
    the MiniLLM protocol's test set, dolly/valid.jsonl, is never read)."""
    from mta.demo.pipeline import copy_dolly_rows

    wanted = {
        "train": (data_dir / "dolly" / "train.jsonl", settings.train_texts, True),
        "held-out": (data_dir / "dolly" / "dev.jsonl", settings.held_out_texts, False),
    }
    paths = {}
    for split, (source, count, sample) in wanted.items():
        paths[split] = root / "data" / f"{split}.jsonl"
        copy_dolly_rows(source, paths[split], count, sample=sample, demo="the embedding demo")
    return paths


def pruned_start(source: Path, root: Path, settings: Any, reporter: Reporter) -> Path:
    """``root/student-init``: ``source`` with ``settings.student_layers`` of its layers, pruned once
    (the start of every demo-embed and ablation-embed run)."""
    from mta.embedding.sentence_encoders import prune_encoder

    start = root / "student-init"
    if not (start / "mta_init.json").is_file():
        reporter.message(f"student: keeping {settings.student_layers} of {source.name}'s layers")
        prune_encoder(source, start, num_layers=settings.student_layers, force=True)
    return start


def embed_rows(teacher: Path, rows: dict[str, Path], root: Path, settings: Any, reporter: Reporter) -> dict[str, Path]:
    """Each split's texts embedded by ``teacher`` into ``root/embeddings/<split>`` (``mta embed``'s
    stage, reused when complete), at ``settings``' length and precision."""
    from mta.embedding.embed import build_teacher_embeddings

    embeddings = {}
    for split, path in rows.items():
        reporter.message(f"embed: {split} texts with {teacher.name} (max {settings.max_length} tokens)")
        embeddings[split] = build_teacher_embeddings(
            teacher,
            path,
            root / "embeddings" / split,
            max_length=settings.max_length,
            batch_size=32,
            dtype=settings.precision,
            reporter=reporter,
            shard=(0, 1),
        )
    return embeddings


def student_run_overrides(
    settings: Any, *, seed: int, start: str | Path, train: str | Path, output_dir: str | Path, log_interval: int
) -> list[str]:
    """The overrides of TALAS's recipe that every demo-embed and ablation-embed run shares: the
    pruned start, the stored teacher embeddings, no dev split, and ``settings``' steps, batch,
    rates and precision (``settings``: an ``EmbedDemoSettings`` or ``AblationSettings``)."""
    return [
        "teacher=null",
        f"student.path={start}",
        "student.tokenizer=null",
        "student.config=null",
        "student.pooling=mean",
        f"data.train={train}",
        "data.dev=null",
        f"data.max_length={settings.max_length}",
        f"seed={seed}",
        f"output_dir={output_dir}",
        "train.epochs=null",
        f"train.max_steps={settings.steps}",
        f"train.batch_size={settings.batch_size}",
        f"train.micro_batch_size={settings.batch_size}",
        f"train.lr={settings.lr}",
        f"train.projector_lr={settings.projector_lr}",
        "train.warmup_steps=0",
        f"train.precision={settings.precision}",
        f"train.log_interval={log_interval}",
        f"train.save_interval={settings.steps}",
        f"train.eval_interval={settings.steps}",
        "train.keep_checkpoints=1",
    ]


def _distill(
    recipe_path,
    variant: EmbedVariant,
    seed: int,
    settings: EmbedDemoSettings,
    start: Path,
    train_embeddings: Path,
    root: Path,
    device,
    reporter: Reporter,
) -> tuple[Path, dict]:
    """One training run, in a child process of its own (spawned), so its step times and peak
    memory are its own and not the previous runs' leftovers; its progress is forwarded here."""
    import multiprocessing
    import queue as queues

    output_dir = root / "runs" / variant.name / f"seed-{seed}"
    final, record_path = output_dir / "final", output_dir / "demo-run.json"
    if (final / "config.json").exists() and record_path.exists():
        reporter.message(f"{variant.name} seed {seed}: already trained ({final})")
        return final, json.loads(record_path.read_text())
    overrides = [
        *student_run_overrides(
            settings, seed=seed, start=start, train=train_embeddings, output_dir=output_dir, log_interval=1
        ),
        *variant.overrides,
    ]
    from mta.training.config.loading import load_recipe

    load_recipe(recipe_path, overrides)  # a bad override fails here, before a process starts
    reporter.message(f"distill: {variant.name}, seed {seed}")
    context = multiprocessing.get_context("spawn")
    channel = context.Queue()
    process = context.Process(target=_train_in_child, args=(str(recipe_path), overrides, channel), daemon=True)
    began = time.perf_counter()
    process.start()
    outcome = None
    try:
        while outcome is None:
            try:
                kind, payload = channel.get(timeout=1.0)
            except queues.Empty:
                if not process.is_alive():
                    raise MtaError(
                        f"the training process of {variant.name} seed {seed} exited with code "
                        f"{process.exitcode} without a result; its run directory is {output_dir}"
                    ) from None
                continue
            if kind == "report":
                method, args, kwargs = payload
                getattr(reporter, method)(*args, **kwargs)
            elif kind == "error":
                raise MtaError(payload)
            else:
                outcome = payload
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    record = {
        **outcome,
        "seconds": time.perf_counter() - began,
        "final_loss": _final_loss(output_dir / "metrics.jsonl"),
        "metrics": str(output_dir / "metrics.jsonl"),
    }
    atomic_write_json(record_path, record)
    return Path(outcome["final"]), record


class _ForwardingReporter:
    """A child's reporter: every call goes to the parent's queue."""

    def __init__(self, channel):
        self.channel = channel

    def __getattr__(self, method):
        return lambda *args, **kwargs: self.channel.put(("report", (method, args, kwargs)))


def _train_in_child(recipe_path: str, overrides: list[str], channel) -> None:
    """The child process: train, then send step times, peak memory and the final directory."""
    try:
        from mta.distributed import local_device
        from mta.training.config.loading import load_recipe
        from mta.training.lifecycle.checkpointing import latest_checkpoint
        from mta.training.trainer import run_distillation

        recipe = load_recipe(recipe_path, overrides)
        output_dir = recipe.resolve(recipe.output_dir, "output_dir")
        clock = _StepClock(_ForwardingReporter(channel))
        resumed = latest_checkpoint(output_dir) is not None
        with _PeakMemory(local_device()) as memory:
            before = memory.current_mib()
            final = run_distillation(recipe, resume="auto", reporter=clock)
            peak = memory.peak_mib()
        channel.put(
            (
                "done",
                {
                    "final": str(final),
                    "step_seconds": clock.step_seconds(),
                    "steps_timed": max(len(clock.times) - 1, 0),
                    "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                    "peak_memory_mib": peak,
                    "memory_at_start_mib": before,
                    "memory_measure": memory.how,
                    "resumed": resumed,
                },
            )
        )
    except MtaError as error:
        channel.put(("error", str(error)))
    except BaseException as error:  # the parent says what went wrong; the traceback is in stderr
        import traceback

        traceback.print_exc()
        channel.put(("error", f"training failed: {type(error).__name__}: {error}"))


def _train_records(metrics: Path) -> list[dict]:
    """A run's training records; none before its metrics.jsonl exists."""
    return train_records(metrics) if metrics.is_file() else []


def _final_loss(metrics: Path) -> float | None:
    train = _train_records(metrics)
    return train[-1]["loss"] if train else None


def _mean_std(values: list[float | None]) -> dict:
    """mean, population std and count of the values that are there (None: missing)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {**mean_std(values), "n": len(values)}


def summarise(by_label: dict, runs: dict, settings: EmbedDemoSettings) -> dict:
    """Per variant: the proxy's mean ± population std over seeds, step time, memory."""
    summary = {}
    ks = [key for key in next(iter(by_label.values()))["sets"]["proxy"] if key.startswith("recall@")]
    for variant in VARIANTS:
        labels = [f"{variant.name}/seed-{seed}" for seed in settings.seeds]
        proxies = [by_label[label]["sets"]["proxy"] for label in labels]
        summary[variant.name] = {
            "spearman": _mean_std([p["spearman"] for p in proxies]),
            **{k: _mean_std([p[k] for p in proxies]) for k in ks},
            "step_seconds": _mean_std([runs[label]["step_seconds"] for label in labels]),
            "peak_memory_mib": _mean_std([runs[label]["peak_memory_mib"] for label in labels]),
            "memory_increase_mib": _mean_std(
                [
                    None
                    if runs[label].get("memory_at_start_mib") is None or runs[label]["peak_memory_mib"] is None
                    else runs[label]["peak_memory_mib"] - runs[label]["memory_at_start_mib"]
                    for label in labels
                ]
            ),
            "train_seconds": _mean_std([runs[label]["seconds"] for label in labels]),
        }
    return summary


# --------------------------------------------------------------------------- report


def _cell(stat: dict, digits: int = 3) -> str:
    if stat.get("mean") is None:
        return "-"
    return f"{stat['mean']:.{digits}f}" + (f" ± {stat['std']:.{digits}f}" if stat.get("n", 0) > 1 else "")


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the references (start, unpruned source), then each variant over seeds."""
    ks = [key for key in next(iter(results["checkpoints"].values())) if key.startswith("recall@")]
    header = ["model", "agreement ρ", *(f"NN {k}" for k in ks), "s / step", "peak memory", "train time"]
    body = []
    for label, run in results["checkpoints"].items():
        if "/seed-" in label:
            continue
        body.append([label, f"{run['spearman']:.3f}", *(f"{run[k]:.3f}" for k in ks), "-", "-", "-"])
    for name, stats in results["summary"].items():
        memory = stats["peak_memory_mib"]
        body.append(
            [
                name,
                _cell(stats["spearman"]),
                *(_cell(stats[k]) for k in ks),
                _cell(stats["step_seconds"], 2),
                "-"
                if memory["mean"] is None
                else f"{memory['mean']:.0f} MiB"
                + (
                    ""
                    if stats["memory_increase_mib"]["mean"] is None
                    else f" (+{stats['memory_increase_mib']['mean']:.0f})"
                ),
                "-" if stats["train_seconds"]["mean"] is None else f"{stats['train_seconds']['mean']:.0f} s",
            ]
        )
    return header, body


def reading(results: dict) -> str:
    """What the figures say, computed from them (no claim the numbers do not carry)."""
    summary = results["summary"]
    start = results["checkpoints"][START_LABEL]
    parts = []
    for name, stats in summary.items():
        mean = stats["spearman"]["mean"]
        if mean is None:
            continue
        change = mean - start["spearman"]
        parts.append(f"{name} {mean:.3f} ({'+' if change >= 0 else ''}{change:.3f} vs the start)")
    sentence = "Teacher agreement ρ after training: " + "; ".join(parts) + "."
    talas, cosine = summary.get("talas", {}).get("spearman", {}), summary.get("cosine", {}).get("spearman", {})
    if talas.get("mean") is not None and cosine.get("mean") is not None:
        gap = talas["mean"] - cosine["mean"]
        seeds, steps = len(results["settings"]["demo"]["seeds"]), results["settings"]["demo"]["steps"]
        if seeds < 2:
            sentence += f" TALAS − cosine: {gap:+.3f} from one seed, which has no spread to weigh it against."
        else:
            spread = max(talas.get("std") or 0.0, cosine.get("std") or 0.0)
            verdict = "more than" if abs(gap) > 2 * spread else "within"
            sentence += f" TALAS − cosine: {gap:+.3f}, {verdict} twice the larger spread over seeds ({spread:.3f})."
        sentence += (
            f" {seeds} seed(s) of {steps} steps from a pruned start: a small-scale comparison "
            "on one proxy, not the paper's nine tasks."
        )
    asam, plain = (
        summary.get("talas+asam", {}).get("step_seconds", {}),
        summary.get("talas", {}).get("step_seconds", {}),
    )
    if asam.get("mean") and plain.get("mean"):
        loads = [run.get("load_average") for run in results["runs"].values()]
        cores = results.get("cores") or 0
        shared = any(load is not None and cores and load > cores for load in loads)
        sentence += (
            f" Step times: ASAM's {asam['mean']:.2f} s against {plain['mean']:.2f} s without it "
            f"({asam['mean'] / plain['mean']:.2f}x; paper: 375 / 195 ms ≈ 1.9x); the runs are sequential, so "
            "these follow the machine's load while each ran"
            + (" (it exceeded the core count here: the ratio is not a measurement)" if shared else "")
            + "; bench/embed_step.py interleaves the three steps for the figure to cite."
        )
    return sentence


def write_report(results: dict, out_dir: str | Path, elapsed_seconds: float) -> tuple[Path, Path]:
    """results.json, results.md and summary.png in ``out_dir``; returns the two last paths."""
    out_dir = Path(out_dir)
    header, body = table(results)
    demo = results["settings"]["demo"]
    held = results["held_out"]
    lines = [
        *report_heading(f"mta demo-embed ({demo['name']})", results["settings"]["precision"], elapsed_seconds),
        *markdown_table(header, body),
        "",
        f"Teacher: {Path(results['settings']['teacher']).name}; students: {demo['student_layers']} of "
        f"{Path(results['settings']['student_source']).name}'s layers, {demo['steps']} steps of {demo['batch_size']} "
        f"texts ({demo['train_texts']} Dolly train texts, max {demo['max_length']} tokens), lr {demo['lr']} "
        f"(projections {demo['projector_lr']}), seeds {', '.join(map(str, demo['seeds']))}. Agreement on "
        f"{held['rows']} held-out Dolly dev texts: Spearman ρ between the model's and the teacher's cosine "
        f"similarities over {held['pairs']} pairs; NN recall@k: share of texts whose teacher nearest "
        "neighbour is among the model's k nearest. mean ± population std over seeds.",
        "",
        "; ".join(f"{name}: {text}" for name, text in results["variants"].items()) + ".",
        "",
        f"Memory: {results.get('memory_measure') or '-'} of each run's own process (in brackets: its growth "
        "while training, over the libraries and data loaded before). s / step: median step time after the first.",
        "",
        reading(results),
        "",
    ]
    atomic_write_json(out_dir / RESULTS_JSON, results)
    return write_report_files(out_dir, lines, lambda picture: plot_summary(results, picture))


def plot_summary(results: dict, path: Path) -> None:
    """Left: training loss per run. Middle: agreement ρ and NN recall (mean ± std over seeds,
    references as lines). Right: seconds per step."""
    figure, (curves, bars, steps) = pyplot().subplots(1, 3, figsize=(16, 4.6))
    plot_training_losses(
        curves, {label: _train_records(Path(run["metrics"])) for label, run in results["runs"].items()}, fontsize=7
    )

    summary = results["summary"]
    metrics = ["spearman", *[k for k in next(iter(summary.values())) if k.startswith("recall@")]]
    width, positions = bar_positions(len(summary), len(metrics))
    for (name, stats), at in zip(summary.items(), positions, strict=True):
        bars.bar(
            at,
            [stats[m]["mean"] or 0 for m in metrics],
            width,
            yerr=[stats[m]["std"] or 0 for m in metrics],
            label=name,
            capsize=2,
        )
    for (label, run), style in zip(
        ((name, scores) for name, scores in results["checkpoints"].items() if "/seed-" not in name),
        ("--", ":"),
        strict=True,
    ):
        for x, metric in enumerate(metrics):
            bars.hlines(
                run[metric],
                x - 0.45,
                x + 0.45,
                colors="black",
                linestyles=style,
                linewidth=1,
                label=label if x == 0 else None,
            )
    bars.set_xticks(range(len(metrics)), ["agreement ρ" if m == "spearman" else f"NN {m}" for m in metrics])
    bars.set(title="teacher agreement on held-out texts", ylim=(0, 1))
    bars.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)

    names = list(summary)
    steps.bar(
        names,
        [summary[n]["step_seconds"]["mean"] or 0 for n in names],
        yerr=[summary[n]["step_seconds"]["std"] or 0 for n in names],
        capsize=3,
        color="tab:gray",
    )
    steps.set(title="seconds per training step", ylabel="s")
    save_figure(figure, path)


def estimated_seconds(settings: EmbedDemoSettings) -> float:
    """A rough figure for the start line, from the 2-core development machine (fp32, loaded)."""
    embed = (settings.train_texts + settings.held_out_texts) / 5.0 * (settings.max_length / 64)
    per_step = {"cosine": 1.5, "talas": 2.0, "talas+asam": 4.5}  # batch 16 x 64 tokens
    training = (
        sum(per_step.values())
        * settings.steps
        * len(settings.seeds)
        * (settings.batch_size / 16)
        * (settings.max_length / 64)
    )
    return 60 + embed + training + 12 * len(VARIANTS) * len(settings.seeds)


__all__ = ["EmbedDemoSettings", "VARIANTS", "run_embedding_demo", "table", "write_report", "estimated_seconds"]
