"""`make ablation-embed`: which of TALAS's parts matter, on `make demo-embed`'s pair, at two budgets
(issue 35). The variants, budgets, splits and the dev-only choice: docs/method.md §9, "What the
parts do at this project's scale". :func:`plan_lines` and :func:`estimated_seconds` give the plan
(``bench/ablation_embed.py --plan``), :func:`run_ablation` runs it (finished stages reused, runs
resumed) and :func:`write_report` writes results.json and results.md.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from mta.embedding.demo import START_LABEL, TALAS_RECIPE, embed_rows, pruned_start, student_run_overrides
from mta.errors import MtaError
from mta.files import atomic_write_json, atomic_write_text
from mta.reporting import Reporter, SilentReporter
from mta.tables import markdown_table

FULL = "talas"
COSINE = "cosine"
AUTHOR = "author-code"
DEV_CHOICE = "dev-choice"
LAYOUT = 2


@dataclass(frozen=True)
class AblationVariant:
    name: str  # directory and label
    factor: str  # the part it ablates; "" for the full objective and the references
    overrides: tuple[str, ...]  # on top of the full objective's
    description: str


FULL_VARIANT = AblationVariant(
    FULL, "", (), "0.001·SimCSE + 0.75·TAMD (top 2 layers) + 1·LASD, mean pooling (demo-embed's talas)"
)
REFERENCES = (
    AblationVariant(
        COSINE,
        "",
        ("loss.simcse_weight=0", "loss.lasd_weight=0", "loss.tamd_weight=1.0", "loss.tamd_layers=1"),
        "1 − cos(W·e_L, e_teacher) on the last layer only (demo-embed's cosine)",
    ),
    AblationVariant(
        AUTHOR,
        "",
        ("loss.reference_code=true", "student.pooling=cls_attention"),
        "the full objective trained as the author's code does (docs/method.md §9), CLS-attention pooling",
    ),
)
FACTORS = (
    AblationVariant("no-simcse", "SimCSE", ("loss.simcse_weight=0",), "SimCSE off"),
    AblationVariant("tamd-top1", "TAMD layers", ("loss.tamd_layers=1",), "TAMD on the top layer only"),
    AblationVariant("lasd-detached", "LASD guide", ("loss.lasd_detach=true",), "LASD, the upper layer detached"),
    AblationVariant("lasd-0.1", "LASD weight", ("loss.lasd_weight=0.1",), "LASD at weight 0.1"),
    AblationVariant("cls-attention", "student pooling", ("student.pooling=cls_attention",), "CLS-attention pooling"),
)
VARIANTS = (FULL_VARIANT, *REFERENCES, *FACTORS)  # the short budget's
LONG_VARIANTS = (COSINE, FULL, AUTHOR)  # the long budget's, and the dev choice when it is not talas

# Seconds on the 2-core development machine, from the first full run (results.json "seconds":
# 28.7 min in all, other jobs on the machine part of the time), in one process after the
# encoders and data are loaded.
SECONDS_PER_STEP = {FULL: 0.75, COSINE: 0.5, "no-simcse": 0.5}  # a pass fewer without SimCSE
SECONDS_PER_RUN = 6.0  # the recipe, the model, DeepSpeed, the export
TEXTS_PER_SECOND = 50.0  # the mpnet teacher embedding Dolly texts of 64 tokens (bf16)
SECONDS_PER_SCORE = 1.7  # one student scored on one split of 200 texts
START_SECONDS = 60.0  # imports, encoder conversion, pruning


@dataclass(frozen=True)
class AblationSettings:
    """The ablation's sizes: the demo's pair, lr, batch and length; two budgets, three seeds."""

    train_texts: int = 1536  # long_steps x batch: each text at most once in every run
    dev_texts: int = 200
    held_out_texts: int = 200
    steps: int = 24  # demo-embed's budget
    long_steps: int = 96  # four times that
    batch_size: int = 16
    max_length: int = 64
    seeds: tuple[int, ...] = (1, 2, 3)
    student_layers: int = 3
    lr: float = 1.0e-4
    projector_lr: float = 1.0e-3
    precision: str = "auto"
    max_pairs: int = 1_000_000


def budget_name(steps: int) -> str:
    return f"{steps}-steps"


def run_label(steps: int, variant: str, seed: int) -> str:
    return f"{budget_name(steps)}/{variant}/seed-{seed}"


def run_overrides(
    variant: AblationVariant,
    seed: int,
    settings: AblationSettings,
    *,
    steps: int,
    start: str,
    train: str,
    output_dir: str,
) -> list[str]:
    """The recipe overrides of one run of ``steps`` steps, on TALAS's recipe (recipes/talas-minilm.yaml)."""
    budget = dataclasses.replace(settings, steps=steps)
    shared = student_run_overrides(
        budget, seed=seed, start=start, train=train, output_dir=output_dir, log_interval=steps
    )
    return [*shared, "train.asam=null", *variant.overrides]


def variant_runs(
    variant: AblationVariant, steps: int, settings: AblationSettings, root: Path
) -> list[tuple[str, list[str]]]:
    """``(label, overrides)`` of ``variant``'s runs at ``steps`` steps, seed by seed."""
    return [
        (
            run_label(steps, variant.name, seed),
            run_overrides(
                variant,
                seed,
                settings,
                steps=steps,
                start=str(root / "student-init"),
                train=str(root / "embeddings" / "train"),
                output_dir=str(root / "runs" / budget_name(steps) / variant.name / f"seed-{seed}"),
            ),
        )
        for seed in settings.seeds
    ]


def planned_runs(settings: AblationSettings, root: str | Path = "runs/ablation-embed") -> list[tuple[str, list[str]]]:
    """``(label, overrides)`` of every run known before any ran: the short budget's variants,
    then the long budget's fixed ones (the dev choice is added after the short runs' dev scores)."""
    root = Path(root)
    by_name = {variant.name: variant for variant in VARIANTS}
    short = [run for variant in VARIANTS for run in variant_runs(variant, settings.steps, settings, root)]
    long = [run for name in LONG_VARIANTS for run in variant_runs(by_name[name], settings.long_steps, settings, root)]
    return short + long


def dev_choice_variant(choices: dict[str, dict]) -> AblationVariant | None:
    """``talas`` with each factor set as dev chose it (``summarise``'s ``choices``); None when dev
    chose the full objective's setting for every factor."""
    chosen = [variant for variant in FACTORS if choices[variant.factor]["chosen_on_dev"] == variant.name]
    if not chosen:
        return None
    overrides = tuple(override for variant in chosen for override in variant.overrides)
    return AblationVariant(DEV_CHOICE, "", overrides, "talas with " + ", ".join(v.description for v in chosen))


def _step_seconds(name: str) -> float:
    return SECONDS_PER_STEP.get(name, SECONDS_PER_STEP[FULL])


def estimated_seconds(settings: AblationSettings) -> float:
    """A rough figure for the whole ablation on the 2-core machine (see the constants); the dev
    choice is counted as a full-objective run."""
    scale = settings.batch_size / 16 * settings.max_length / 64
    runs = [(v.name, settings.steps) for v in VARIANTS] + [
        (name, settings.long_steps) for name in (*LONG_VARIANTS, DEV_CHOICE)
    ]
    training = len(settings.seeds) * sum(SECONDS_PER_RUN + steps * _step_seconds(name) * scale for name, steps in runs)
    texts = settings.train_texts + settings.dev_texts + settings.held_out_texts
    scoring = 2 * (len(runs) * len(settings.seeds) + 1) * SECONDS_PER_SCORE
    return START_SECONDS + texts / TEXTS_PER_SECOND * settings.max_length / 64 + training + scoring


def plan_lines(settings: AblationSettings, root: str | Path = "runs/ablation-embed") -> list[str]:
    """What the ablation runs, in words, with its time estimate."""
    runs = planned_runs(settings, root)
    seeds = len(settings.seeds)
    lines = [
        f"ablation-embed: {len(runs) + seeds} runs, seeds {', '.join(map(str, settings.seeds))}, from demo-embed's "
        f"start ({settings.student_layers} of all-MiniLM-L6-v2's layers), teacher all-mpnet-base-v2; "
        f"{settings.batch_size} texts of <= {settings.max_length} tokens a step, lr {settings.lr:g}, projections "
        f"{settings.projector_lr:g}, precision {settings.precision}, no ASAM",
        f"data: train {settings.train_texts} Dolly train texts (seed 0); dev: Dolly dev rows "
        f"{settings.held_out_texts}-{settings.held_out_texts + settings.dev_texts - 1}; held-out: Dolly dev rows "
        f"0-{settings.held_out_texts - 1} (demo-embed's)",
        "choice: per factor, the setting with the higher mean dev agreement ρ; held-out scores every variant",
        f"{settings.steps} steps (demo-embed's budget): {len(VARIANTS)} variants x {seeds} seeds",
    ]
    for variant in VARIANTS:
        changed = " ".join(variant.overrides) or "(the full objective)"
        lines.append(f"  {variant.name:14s} {variant.factor or '-':16s} {changed}: {variant.description}")
    lines.append(
        f"{settings.long_steps} steps: {', '.join(LONG_VARIANTS)} and {DEV_CHOICE} (talas with each part as dev "
        f"chose it at {settings.steps} steps; left out if that is talas) x {seeds} seeds"
    )
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
    import time

    from mta.demo.pipeline import claim_demo_directory, copy_dolly_rows
    from mta.distributed import local_device
    from mta.dtypes import resolve_precision
    from mta.embedding.sentence_encoders import convert_packaged_encoder
    from mta.evaluation.datasets import default_data_dir

    reporter = reporter or SilentReporter()
    root = Path(out_dir)
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    precision = resolve_precision(settings.precision, local_device())
    claim_demo_directory(root, {**asdict(settings), "layout": LAYOUT, "resolved_precision": precision}, reporter)
    seconds: dict[str, float] = {}
    began = time.perf_counter()
    teacher = convert_packaged_encoder("mpnet", report=lambda line: reporter.message(f"teacher: {line}"))
    source = convert_packaged_encoder("minilm", report=lambda line: reporter.message(f"student: {line}"))
    start = pruned_start(source, root, settings, reporter)
    rows = {split: root / "data" / f"{split}.jsonl" for split in ("train", "dev", "held-out")}
    copy_dolly_rows(
        data_dir / "dolly" / "train.jsonl", rows["train"], settings.train_texts, sample=True, demo="the ablation"
    )
    copy_rows(data_dir / "dolly" / "dev.jsonl", rows["held-out"], 0, settings.held_out_texts)
    copy_rows(data_dir / "dolly" / "dev.jsonl", rows["dev"], settings.held_out_texts, settings.dev_texts)
    seconds["start"] = time.perf_counter() - began
    began = time.perf_counter()
    embeddings = embed_rows(teacher, rows, root, settings, reporter)
    seconds["teacher_embeddings"] = time.perf_counter() - began

    def score(split: str, budget: str, checkpoints: dict[str, Path]) -> dict[str, dict]:
        return _scores(checkpoints, root / "eval" / split / budget, embeddings[split], settings, reporter)

    runs = planned_runs(settings, root)
    short = [run for run in runs if run[0].startswith(budget_name(settings.steps) + "/")]
    began = time.perf_counter()
    finals = _train(short, reporter)
    seconds["train_short"] = time.perf_counter() - began
    began = time.perf_counter()
    dev = score("dev", budget_name(settings.steps), {START_LABEL: start, **finals})
    seconds["score_dev_short"] = time.perf_counter() - began
    choices = _choices(_summary(dev, dev, settings, settings.steps, [v.name for v in VARIANTS]))
    long = [run for run in runs if run not in short]
    choice = dev_choice_variant(choices)
    if choice is not None:
        long += variant_runs(choice, settings.long_steps, settings, root)
    began = time.perf_counter()
    long_finals = _train(long, reporter)
    seconds["train_long"] = time.perf_counter() - began
    began = time.perf_counter()
    dev.update(score("dev", budget_name(settings.long_steps), long_finals))
    held = score("held-out", "all", {START_LABEL: start, **finals, **long_finals})
    seconds["score_rest"] = time.perf_counter() - began
    return {
        "settings": {**asdict(settings), "precision": precision, "recipe": str(TALAS_RECIPE)},
        "variants": {
            v.name: {"factor": v.factor, "overrides": list(v.overrides), "description": v.description}
            for v in (*VARIANTS, *([choice] if choice else []))
        },
        "seconds": seconds,
        **summarise({"dev": dev, "held-out": held}, settings, dev_choice=choice is not None),
    }


def _train(runs: list[tuple[str, list[str]]], reporter: Reporter) -> dict[str, Path]:
    """Each run's ``final/``, trained in this process unless it is there (a run resumes)."""
    from mta.training.config.loading import load_recipe
    from mta.training.trainer import run_distillation

    finals = {}
    for label, overrides in runs:
        recipe = load_recipe(TALAS_RECIPE, overrides)
        final = recipe.resolve(recipe.output_dir, "output_dir") / "final"
        if not (final / "config.json").is_file():
            reporter.message(f"distill: {label}")
            final = run_distillation(recipe, resume="auto", reporter=reporter)
        finals[label] = Path(final)
    return finals


def _scores(
    checkpoints: dict[str, Path], out_dir: Path, embeddings: Path, settings: AblationSettings, reporter: Reporter
) -> dict[str, dict]:
    """``label -> proxy scores`` of each checkpoint against the teacher's ``embeddings``."""
    from mta.embedding.evaluation import EmbeddingEvalSettings, evaluate_embedding_checkpoints

    names = [label.replace("/", "-").replace(" ", "-") for label in checkpoints]
    reporter.message(f"evaluate: teacher agreement, {len(names)} encoders, {out_dir.name} ({out_dir.parent.name})")
    evaluation = evaluate_embedding_checkpoints(
        list(checkpoints.values()),
        out_dir=out_dir,
        names=names,
        teacher_embeddings=embeddings,
        settings=EmbeddingEvalSettings(
            max_length=settings.max_length, batch_size=32, dtype="fp32", tasks=("none",), max_pairs=settings.max_pairs
        ),
        reporter=reporter,
    )
    return {
        label: evaluation["checkpoints"][name]["sets"]["proxy"] for label, name in zip(checkpoints, names, strict=True)
    }


def _stat(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "n": len(values)}


def _metrics(scores: dict) -> list[str]:
    return [key for key in scores[START_LABEL] if key == "spearman" or key.startswith("recall@")]


def _summary(
    dev: dict[str, dict], held: dict[str, dict], settings: AblationSettings, steps: int, names: list[str]
) -> dict:
    """Per variant at ``steps``: each metric's mean ± std over seeds on dev and held-out, and the
    held-out ρ difference to talas and to cosine, seed by seed."""
    metrics = _metrics(held)
    summary = {}
    for name in names:
        labels = [run_label(steps, name, seed) for seed in settings.seeds]
        entry = {
            split: {metric: _stat([scores[label][metric] for label in labels]) for metric in metrics}
            for split, scores in (("dev", dev), ("held-out", held))
        }
        for reference in (FULL, COSINE):
            entry["held-out"][f"spearman_vs_{reference}"] = _stat(
                [
                    held[label]["spearman"] - held[run_label(steps, reference, seed)]["spearman"]
                    for label, seed in zip(labels, settings.seeds, strict=True)
                ]
            )
        summary[name] = entry
    return summary


def _choices(short: dict) -> dict:
    """Per factor, the short budget's dev choice between the full objective and its variant (a
    tie keeps the full objective's setting)."""
    choices = {}
    for variant in FACTORS:
        candidates = (FULL, variant.name)
        chosen = max(candidates, key=lambda name: short[name]["dev"]["spearman"]["mean"])
        choices[variant.factor] = {
            "candidates": list(candidates),
            "chosen_on_dev": chosen,
            "held_out_spearman": short[chosen]["held-out"]["spearman"]["mean"],
        }
    return choices


def summarise(scores: dict[str, dict[str, dict]], settings: AblationSettings, *, dev_choice: bool = False) -> dict:
    """``scores[split][label]``: a checkpoint's proxy scores (``spearman``, ``recall@k``) on
    ``dev`` and ``held-out``, labels from :func:`run_label` and ``START_LABEL``. Per budget and
    variant: mean ± population std over the seeds of each metric on each split, and the held-out
    ρ differences to talas and cosine seed by seed; per factor, the short budget's dev choice."""
    dev, held = scores["dev"], scores["held-out"]
    long_names = [*LONG_VARIANTS, *([DEV_CHOICE] if dev_choice else [])]
    summary = {
        budget_name(settings.steps): _summary(dev, held, settings, settings.steps, [v.name for v in VARIANTS]),
        budget_name(settings.long_steps): _summary(dev, held, settings, settings.long_steps, long_names),
    }
    start = {split: {metric: scores[split][START_LABEL][metric] for metric in _metrics(held)} for split in scores}
    return {"start": start, "summary": summary, "choices": _choices(summary[budget_name(settings.steps)])}


def _cell(stat: dict, signed: bool = False) -> str:
    if stat.get("mean") is None:
        return "-"
    return f"{stat['mean']:{'+' if signed else ''}.3f} ± {stat['std']:.3f}"


def table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the start, then per budget each variant (mean ± std over seeds), its
    held-out ρ against talas and cosine, and whether dev chose it over the full objective."""
    metrics = list(results["start"]["held-out"])
    header = ["steps", "variant", "dev ρ", *(f"held-out {'ρ' if m == 'spearman' else m}" for m in metrics)]
    header += ["Δρ vs talas", "Δρ vs cosine", "chosen on dev"]
    start = results["start"]
    body = [["0", START_LABEL, f"{start['dev']['spearman']:.3f}", *(f"{start['held-out'][m]:.3f}" for m in metrics)]]
    body[0] += ["-", "-", "-"]
    chosen = {choice["chosen_on_dev"] for choice in results["choices"].values()}
    for budget, variants in results["summary"].items():
        for name, entry in variants.items():
            factor = results["variants"].get(name, {}).get("factor", "")
            body.append(
                [
                    budget.split("-")[0],
                    name,
                    _cell(entry["dev"]["spearman"]),
                    *(_cell(entry["held-out"][m]) for m in metrics),
                    "-" if name == FULL else _cell(entry["held-out"]["spearman_vs_talas"], signed=True),
                    "-" if name == COSINE else _cell(entry["held-out"]["spearman_vs_cosine"], signed=True),
                    ("yes" if name in chosen else "no") if factor else "-",
                ]
            )
    return header, body


def write_report(results: dict, out_dir: str | Path, elapsed_seconds: float) -> Path:
    """results.json and results.md in ``out_dir``; returns the markdown's path."""
    out_dir = Path(out_dir)
    header, body = table(results)
    settings = results["settings"]
    choice = results["variants"].get(DEV_CHOICE)
    lines = [
        "# mta ablation-embed",
        "",
        f"{elapsed_seconds / 60:.1f} min, precision {settings['precision']}",
        "",
        *markdown_table(header, body),
        "",
        "mean ± population std over seeds "
        + ", ".join(map(str, settings["seeds"]))
        + f"; held-out: Dolly dev rows 0-{settings['held_out_texts'] - 1}, dev: rows {settings['held_out_texts']}-"
        f"{settings['held_out_texts'] + settings['dev_texts'] - 1}. Δρ: held-out ρ minus talas's (cosine's) at the "
        "same budget, seed by seed. Chosen on dev: per factor, the higher mean dev ρ of the full objective and the "
        f"variant at {settings['steps']} steps; the held-out texts choose nothing.",
        "",
        *(
            f"- {factor}: {entry['chosen_on_dev']} (held-out ρ {entry['held_out_spearman']:.3f})"
            for factor, entry in results["choices"].items()
        ),
        f"- {DEV_CHOICE} at {settings['long_steps']} steps: "
        + (choice["description"] if choice else "not run: dev chose talas's setting for every part"),
        "",
    ]
    atomic_write_json(out_dir / "results.json", results)
    markdown = out_dir / "results.md"
    atomic_write_text(markdown, "\n".join(lines))
    return markdown


__all__ = [
    "AblationSettings",
    "VARIANTS",
    "dev_choice_variant",
    "estimated_seconds",
    "plan_lines",
    "run_ablation",
    "summarise",
    "table",
    "write_report",
]
