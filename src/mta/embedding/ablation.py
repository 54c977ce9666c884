"""`make ablation-embed`: which of TALAS's parts matter, on `make demo-embed`'s pair (issue 35).

Every student starts from the demo's start (all-MiniLM-L6-v2 pruned to 3 of its 6 layers) and
learns all-mpnet-base-v2's embeddings of the same Dolly texts, with the demo's lr, batch, length
and precision, AdamW without ASAM. ``talas`` is the demo's ``talas`` student (0.001·SimCSE +
0.75·TAMD on the top two layers + 1·LASD, mean pooling); each other variant (``VARIANTS``)
changes one thing of it:

- ``no-simcse``: SimCSE off (λ1 = 0, one student pass a step);
- ``tamd-top1``: TAMD on the top layer only (K = 1 instead of 2);
- ``lasd-detached``: LASD with the upper layer's matrix detached (the guide gets no gradient);
- ``lasd-0.1``: LASD at weight 0.1 instead of 1;
- ``cls-attention``: the author's CLS-query attention pooling for the student instead of mean.

Three splits of Dolly, none shared: ``train`` (``train_texts`` rows of dolly/train.jsonl drawn
with seed 0; each text seen at most once), ``dev`` (dolly/dev.jsonl rows ``held_out_texts`` ..
``held_out_texts + dev_texts − 1``) and ``held-out`` (its first ``held_out_texts`` rows: the
demo's held-out set). Every final student is scored on dev and on held-out (teacher agreement:
Spearman ρ of the pairwise cosines, NN recall@k). The choices are made on dev only: for each
factor, the setting (the full objective's or the variant's) with the higher mean dev ρ over the
seeds; held-out numbers are reported for every variant, the dev choices marked, so the
held-out texts choose nothing.

:func:`plan_lines` prints the plan and :func:`estimated_seconds` its time (``bench/ablation_embed.py
--plan``); :func:`run_ablation` runs it (every finished stage is reused, the runs resume) and
:func:`write_report` writes results.json and results.md.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from mta.embedding.demo import START_LABEL, TALAS_RECIPE, embed_rows, pruned_start, student_run_overrides
from mta.errors import MtaError
from mta.files import atomic_write_json, atomic_write_text
from mta.reporting import Reporter, SilentReporter
from mta.tables import markdown_table

FULL = "talas"
LAYOUT = 1


@dataclass(frozen=True)
class AblationVariant:
    name: str  # directory and label
    factor: str  # the part it ablates; "" for the full objective
    overrides: tuple[str, ...]  # on top of the full objective's
    description: str


VARIANTS = (
    AblationVariant(
        FULL, "", (), "0.001·SimCSE + 0.75·TAMD (top 2 layers) + 1·LASD, mean pooling (demo-embed's talas)"
    ),
    AblationVariant("no-simcse", "SimCSE", ("loss.simcse_weight=0",), "SimCSE off"),
    AblationVariant("tamd-top1", "TAMD layers", ("loss.tamd_layers=1",), "TAMD on the top layer only"),
    AblationVariant("lasd-detached", "LASD guide", ("loss.lasd_detach=true",), "LASD, the upper layer detached"),
    AblationVariant("lasd-0.1", "LASD weight", ("loss.lasd_weight=0.1",), "LASD at weight 0.1"),
    AblationVariant("cls-attention", "student pooling", ("student.pooling=cls_attention",), "CLS-attention pooling"),
)

# Seconds on the 2-core development machine, loaded by other jobs (demo-embed's README run:
# 115 s for 24 talas steps of 16 x 64 tokens in a process of its own, start-up included).
SECONDS_PER_STEP = {"talas": 3.5, "no-simcse": 2.5}  # one student pass fewer without SimCSE
SECONDS_PER_RUN = 15.0  # load, DeepSpeed, export
TEXTS_PER_SECOND = 5.0  # the mpnet teacher embedding Dolly texts of 64 tokens
SECONDS_PER_SCORE = 3.0  # one student scored on one split of 200 texts
START_SECONDS = 60.0  # imports, encoder conversion, pruning


@dataclass(frozen=True)
class AblationSettings:
    """The ablation's sizes: the demo's pair, lr, batch and length; fewer steps, three seeds."""

    train_texts: int = 256  # steps x batch: each text at most once
    dev_texts: int = 200
    held_out_texts: int = 200
    steps: int = 16
    batch_size: int = 16
    max_length: int = 64
    seeds: tuple[int, ...] = (1, 2, 3)
    student_layers: int = 3
    lr: float = 1.0e-4
    projector_lr: float = 1.0e-3
    precision: str = "auto"
    max_pairs: int = 1_000_000


def run_overrides(
    variant: AblationVariant, seed: int, settings: AblationSettings, *, start: str, train: str, output_dir: str
) -> list[str]:
    """The recipe overrides of one run, on TALAS's recipe (recipes/talas-minilm.yaml)."""
    shared = student_run_overrides(
        settings, seed=seed, start=start, train=train, output_dir=output_dir, log_interval=settings.steps
    )
    return [*shared, "train.asam=null", *variant.overrides]


def planned_runs(settings: AblationSettings, root: str | Path = "runs/ablation-embed") -> list[tuple[str, list[str]]]:
    """``(label, overrides)`` of every run, variant by variant, seed by seed."""
    root = Path(root)
    return [
        (
            f"{variant.name}/seed-{seed}",
            run_overrides(
                variant,
                seed,
                settings,
                start=str(root / "student-init"),
                train=str(root / "embeddings" / "train"),
                output_dir=str(root / "runs" / variant.name / f"seed-{seed}"),
            ),
        )
        for variant in VARIANTS
        for seed in settings.seeds
    ]


def estimated_seconds(settings: AblationSettings) -> float:
    """A rough figure for the whole ablation on the 2-core machine (see the constants)."""
    scale = settings.batch_size / 16 * settings.max_length / 64
    training = sum(
        SECONDS_PER_RUN + settings.steps * SECONDS_PER_STEP.get(variant.name, SECONDS_PER_STEP[FULL]) * scale
        for variant in VARIANTS
        for _ in settings.seeds
    )
    texts = settings.train_texts + settings.dev_texts + settings.held_out_texts
    scoring = 2 * (len(VARIANTS) * len(settings.seeds) + 1) * SECONDS_PER_SCORE
    return START_SECONDS + texts / TEXTS_PER_SECOND * settings.max_length / 64 + training + scoring


def plan_lines(settings: AblationSettings, root: str | Path = "runs/ablation-embed") -> list[str]:
    """What the ablation runs, in words, with its time estimate."""
    runs = planned_runs(settings, root)
    lines = [
        f"ablation-embed: {len(VARIANTS)} variants x {len(settings.seeds)} seeds = {len(runs)} runs of "
        f"{settings.steps} steps ({settings.batch_size} texts of <= {settings.max_length} tokens, lr {settings.lr:g}, "
        f"projections {settings.projector_lr:g}, precision {settings.precision}, no ASAM) from demo-embed's start "
        f"({settings.student_layers} of all-MiniLM-L6-v2's layers), teacher all-mpnet-base-v2",
        f"data: train {settings.train_texts} Dolly train texts (seed 0); dev: Dolly dev rows "
        f"{settings.held_out_texts}-{settings.held_out_texts + settings.dev_texts - 1}; held-out: Dolly dev rows "
        f"0-{settings.held_out_texts - 1} (demo-embed's)",
        "choice: per factor, the setting with the higher mean dev agreement ρ; held-out scores every variant",
    ]
    for variant in VARIANTS:
        changed = " ".join(variant.overrides) or "(the full objective)"
        lines.append(f"  {variant.name:14s} {variant.factor or 'full':16s} {changed}: {variant.description}")
    lines.append(f"about {estimated_seconds(settings) / 60:.0f} min on a 2-core CPU")
    return lines


def copy_rows(source: Path, target: Path, first: int, count: int) -> None:
    """Rows ``first`` .. ``first + count − 1`` of the JSONL ``source`` into ``target`` (kept if there)."""
    if target.exists():
        return
    if not source.exists():
        raise MtaError(f"the embedding ablation needs {source}; set MTA_DATA_DIR (`mta data download`)")
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(lines) < first + count:
        raise MtaError(f"{source} has {len(lines)} rows; the ablation reads rows {first}-{first + count - 1}")
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, "".join(line + "\n" for line in lines[first : first + count]))


def run_ablation(
    settings: AblationSettings,
    out_dir: str | Path = "runs/ablation-embed",
    *,
    data_dir: str | Path | None = None,
    reporter: Reporter | None = None,
) -> dict:
    """Run (or finish) the ablation; returns what results.json holds."""
    from mta.demo.pipeline import claim_demo_directory, copy_dolly_rows
    from mta.distributed import local_device
    from mta.dtypes import resolve_precision
    from mta.embedding.evaluation import EmbeddingEvalSettings, evaluate_embedding_checkpoints
    from mta.embedding.sentence_encoders import convert_packaged_encoder
    from mta.evaluation.datasets import default_data_dir
    from mta.training.config.loading import load_recipe
    from mta.training.trainer import run_distillation

    reporter = reporter or SilentReporter()
    root = Path(out_dir)
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    precision = resolve_precision(settings.precision, local_device())
    claim_demo_directory(root, {**asdict(settings), "layout": LAYOUT, "resolved_precision": precision}, reporter)
    teacher = convert_packaged_encoder("mpnet", report=lambda line: reporter.message(f"teacher: {line}"))
    source = convert_packaged_encoder("minilm", report=lambda line: reporter.message(f"student: {line}"))
    start = pruned_start(source, root, settings, reporter)

    rows = {split: root / "data" / f"{split}.jsonl" for split in ("train", "dev", "held-out")}
    copy_dolly_rows(
        data_dir / "dolly" / "train.jsonl", rows["train"], settings.train_texts, sample=True, demo="the ablation"
    )
    copy_rows(data_dir / "dolly" / "dev.jsonl", rows["held-out"], 0, settings.held_out_texts)
    copy_rows(data_dir / "dolly" / "dev.jsonl", rows["dev"], settings.held_out_texts, settings.dev_texts)
    embeddings = embed_rows(teacher, rows, root, settings, reporter)

    finals = {}
    for label, overrides in planned_runs(settings, root):
        recipe = load_recipe(TALAS_RECIPE, overrides)
        final = recipe.resolve(recipe.output_dir, "output_dir") / "final"
        if not (final / "config.json").is_file():
            reporter.message(f"distill: {label}")
            final = run_distillation(recipe, resume="auto", reporter=reporter)
        finals[label] = Path(final)

    checkpoints = {START_LABEL: start, **finals}
    names = [label.replace("/", "-").replace(" ", "-") for label in checkpoints]
    scores = {}
    for split in ("dev", "held-out"):
        reporter.message(f"evaluate: teacher agreement on the {split} texts")
        evaluation = evaluate_embedding_checkpoints(
            list(checkpoints.values()),
            out_dir=root / "eval" / split,
            names=names,
            teacher_embeddings=embeddings[split],
            settings=EmbeddingEvalSettings(
                max_length=settings.max_length,
                batch_size=32,
                dtype="fp32",
                tasks=("none",),
                max_pairs=settings.max_pairs,
            ),
            reporter=reporter,
        )
        scores[split] = {
            label: evaluation["checkpoints"][name]["sets"]["proxy"]
            for label, name in zip(checkpoints, names, strict=True)
        }
    return {
        "settings": {**asdict(settings), "precision": precision, "recipe": str(TALAS_RECIPE)},
        "variants": {v.name: {"factor": v.factor, "overrides": list(v.overrides)} for v in VARIANTS},
        **summarise(scores, settings),
    }


def _stat(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "n": len(values)}


def summarise(scores: dict[str, dict[str, dict]], settings: AblationSettings) -> dict:
    """``scores[split][label]``: a checkpoint's proxy scores (``spearman``, ``recall@k``) on
    ``dev`` and ``held-out``. Per variant: mean ± population std over the seeds of each metric on
    each split, and of the held-out ρ difference to the full objective seed by seed; per factor,
    the dev choice between the full objective and its variant."""
    metrics = [key for key in scores["held-out"][START_LABEL] if key == "spearman" or key.startswith("recall@")]
    variants = {}
    for variant in VARIANTS:
        labels = [f"{variant.name}/seed-{seed}" for seed in settings.seeds]
        entry = {
            split: {metric: _stat([scores[split][label][metric] for label in labels]) for metric in metrics}
            for split in ("dev", "held-out")
        }
        entry["held-out"]["spearman_vs_full"] = _stat(
            [
                scores["held-out"][label]["spearman"] - scores["held-out"][f"{FULL}/seed-{seed}"]["spearman"]
                for label, seed in zip(labels, settings.seeds, strict=True)
            ]
        )
        variants[variant.name] = entry
    choices = {}
    for variant in VARIANTS[1:]:
        candidates = (FULL, variant.name)
        chosen = max(candidates, key=lambda name: variants[name]["dev"]["spearman"]["mean"])
        choices[variant.factor] = {
            "candidates": list(candidates),
            "chosen_on_dev": chosen,
            "held_out_spearman": variants[chosen]["held-out"]["spearman"]["mean"],
        }
    start = {split: {metric: scores[split][START_LABEL][metric] for metric in metrics} for split in scores}
    return {"start": start, "summary": variants, "choices": choices}


def _cell(stat: dict) -> str:
    if stat.get("mean") is None:
        return "-"
    return f"{stat['mean']:.3f} ± {stat['std']:.3f}"


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the start, then each variant (mean ± std over seeds) and whether dev
    chose it over the full objective."""
    metrics = list(results["start"]["held-out"])
    header = ["variant", "dev ρ", *(f"held-out {'ρ' if m == 'spearman' else m}" for m in metrics)]
    header += ["held-out Δρ vs talas", "chosen on dev"]
    start = results["start"]
    body = [[START_LABEL, f"{start['dev']['spearman']:.3f}", *(f"{start['held-out'][m]:.3f}" for m in metrics)]]
    body[0] += ["-", "-"]
    for name, entry in results["summary"].items():
        factor = results["variants"][name]["factor"]
        delta = entry["held-out"]["spearman_vs_full"]
        body.append(
            [
                name,
                _cell(entry["dev"]["spearman"]),
                *(_cell(entry["held-out"][m]) for m in metrics),
                "-" if name == FULL else f"{delta['mean']:+.3f} ± {delta['std']:.3f}",
                "-" if name == FULL else ("yes" if results["choices"][factor]["chosen_on_dev"] == name else "no"),
            ]
        )
    return header, body


def write_report(results: dict, out_dir: str | Path, elapsed_seconds: float) -> Path:
    """results.json and results.md in ``out_dir``; returns the markdown's path."""
    out_dir = Path(out_dir)
    header, body = table(results)
    lines = [
        "# mta ablation-embed",
        "",
        f"{elapsed_seconds / 60:.1f} min, precision {results['settings']['precision']}",
        "",
        *markdown_table(header, body),
        "",
        "mean ± population std over seeds "
        + ", ".join(map(str, results["settings"]["seeds"]))
        + "; Δρ: held-out ρ minus the full objective's, seed by seed. Chosen on dev: per factor, the "
        "higher mean dev ρ of the full objective and the variant; the held-out texts choose nothing.",
        "",
        *(
            f"- {factor}: {choice['chosen_on_dev']} (held-out ρ {choice['held_out_spearman']:.3f})"
            for factor, choice in results["choices"].items()
        ),
        "",
    ]
    atomic_write_json(out_dir / "results.json", results)
    markdown = out_dir / "results.md"
    atomic_write_text(markdown, "\n".join(lines))
    return markdown


__all__ = ["AblationSettings", "VARIANTS", "estimated_seconds", "plan_lines", "run_ablation", "write_report"]
