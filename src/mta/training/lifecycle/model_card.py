"""The model card of a trained student: ``README.md`` in the Hugging Face model-card format.

``final/`` (and any other exported student directory, e.g. a ``best/``) carries one, so the
directory says what it is when it is copied, shared or pushed to the Hub without mta: YAML front
matter (``library_name``, ``pipeline_tag``, ``license`` and ``base_model``: ``student.license`` or
what the start's files record of its origin (:func:`start_origin`), ``datasets`` where the
training data is a set the Hub knows, ``tags``), then the teacher,
the student's start, the recipe's name and hash, the data, the steps, the last dev metrics at
save time and the mta version. The recipe hash is ``mta.hashing.json_sha256`` of the resolved
recipe, the mapping ``recipe.yaml`` beside the card holds, so the card names exactly that file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mta.errors import MtaError
from mta.files import atomic_write_text
from mta.hashing import json_sha256
from mta.task_registry import task_of
from mta.training.config.schema import ModelSpec, Recipe
from mta.training.lifecycle.metrics import read_metrics
from mta.versions import package_versions

CARD = "README.md"
# Training sets the Hub knows, recognised by a directory or file name in data.train.
KNOWN_DATASETS = {"dolly": "databricks/databricks-dolly-15k"}


def recipe_hash(recipe: Recipe) -> str:
    """``sha256:`` of the resolved recipe (the mapping recipe.yaml holds) as canonical JSON."""
    return "sha256:" + json_sha256(recipe.model_dump(mode="json"))


def hub_name(spec: ModelSpec | None, recipe: Recipe) -> str | None:
    """The spec's model as a Hub name, or None (no model, a tiny one, a local directory)."""
    from mta.models.hub import is_hub_name

    if spec is None or spec.tiny is not None:
        return None
    try:
        resolved = recipe.resolve(spec.path)
    except MtaError:  # an unset variable: a path, not a Hub name
        return None
    return spec.path if is_hub_name(str(resolved)) and str(resolved) == spec.path else None


def describe_model(spec: ModelSpec | None, recipe: Any = None) -> str:
    """A model as a card names it: a Hub name as it is; a local directory by the Hub model it
    descends from (:func:`start_origin`) where its files record one, else by its own name only,
    never by a path of the machine that trained it (cards are meant to be pushed)."""
    if spec is None:
        return "none (plain SFT on the reference responses)"
    if spec.tiny is not None:
        tiny = spec.tiny
        return (
            f"a random tiny {tiny.model_type} built by mta ({tiny.num_layers} layers, hidden size "
            f"{tiny.hidden_size}, vocabulary {tiny.vocab_size}, seed {tiny.seed})"
        )
    tokenizer = f" (tokenizer {shareable(spec.tokenizer)})" if spec.tokenizer else ""
    if recipe is not None and hub_name(spec, recipe) is None:
        origin = start_origin(spec, recipe).base_model
        if origin:
            return f"`{origin}` (a local copy, {shareable(spec.path)}){tokenizer}"
    return shareable(spec.path) + tokenizer


def shareable(path: str) -> str:
    """A model or data reference a card may show: a Hub name or a relative path as it is, an
    absolute or home path as the local directory's name only."""
    text = str(path)
    local = Path(text).expanduser()
    if text.startswith("~") or local.is_absolute():
        return f"local directory `{local.name}`"
    return f"`{text}`"


def _datasets(paths: Iterable[str | None]) -> list[str]:
    """The Hub datasets a card names: a Hub dataset id as it is, or a known set by its file's name."""
    from mta.models.hub import is_dataset_id

    found: list[str] = []
    for path in paths:
        if not path:
            continue
        if is_dataset_id(path):
            found += [path] if path not in found else []
            continue
        for part in Path(path).parts:
            name = KNOWN_DATASETS.get(Path(part).stem.lower()) or KNOWN_DATASETS.get(part.lower())
            if name and name not in found:
                found.append(name)
    return found


@dataclass(frozen=True)
class CardFacts:
    """What a card says that depends on the recipe's task (``mta.task_registry.Task.card``)."""

    metadata: dict[str, Any]  # the YAML front matter
    intro: str  # what the directory is and how to load it
    loss: str  # the objective, e.g. "1·srkl + 1·DSA + 1·HRA"
    teacher: str  # the teacher row of the table
    data_limits: str  # the data row's lengths


def loss_terms(terms: Iterable[tuple[str, float]]) -> str:
    """``weight·name`` of each term with a non-zero weight, joined by `` + ``."""
    return " + ".join(f"{weight:g}·{name}" for name, weight in terms if weight)


ORIGIN_RECORDS = ("mta_init.json", "mta_source.json")  # init-student's / a converter's record
ORIGIN_HOPS = 4  # a start pruned from a conversion of a Hub model is two hops away


@dataclass(frozen=True)
class StartOrigin:
    """Where a student's start came from: the Hub model it descends from and its licence, as far
    as the start's files record them (None where they do not)."""

    base_model: str | None = None
    license: str | None = None


def start_origin(spec: Any, recipe: Any) -> StartOrigin:
    """The student's start as the card names it. A Hub name is its own ``base_model`` (its licence
    is the Hub's to say: None). A local directory is followed back, up to ``ORIGIN_HOPS``
    directories, through what it records: its own card's front matter (``base_model``,
    ``license``), a converter's ``mta_source.json`` (``hub_id``, ``license``) and
    ``mta init-student``'s ``mta_init.json`` (``source``: the directory or Hub name it was pruned
    from); the first value found for each wins."""
    if spec is None or getattr(spec, "tiny", None) is not None:
        return StartOrigin()
    name = hub_name(spec, recipe)
    if name:
        return StartOrigin(base_model=name)
    try:
        current: str | None = str(recipe.resolve(spec.path))
    except MtaError:
        return StartOrigin()
    found: dict[str, str | None] = {"base_model": None, "license": None}
    for _ in range(ORIGIN_HOPS):
        if current is None:
            break
        directory = Path(current)
        if not directory.is_dir():  # a Hub name a record points to
            found["base_model"] = found["base_model"] or current
            break
        recorded = _front_matter(directory / CARD)
        for record in ORIGIN_RECORDS:
            recorded = {**_json(directory / record), **recorded}
        found["base_model"] = found["base_model"] or _text(recorded.get("base_model") or recorded.get("hub_id"))
        found["license"] = found["license"] or _text(recorded.get("license"))
        current = _text(_json(directory / "mta_init.json").get("source"))
    return StartOrigin(**found)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _front_matter(path: Path) -> dict[str, Any]:
    """A model card's YAML front matter ({} when there is none or it does not parse)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    if not text.startswith("---"):
        return {}
    block = text[3:].split("\n---", 1)[0]
    try:
        loaded = yaml.safe_load(block)
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def base_metadata(recipe: Any, *, library: str, pipeline: str) -> dict[str, Any]:
    """Front matter every task's card starts from: library, pipeline tag, ``license``
    (``student.license``, else the start's own) and ``base_model`` (the start's Hub origin)."""
    meta: dict[str, Any] = {"library_name": library, "pipeline_tag": pipeline}
    origin = start_origin(recipe.student, recipe)
    license_id = getattr(recipe.student, "license", None) or origin.license
    if license_id:
        meta["license"] = license_id
    if origin.base_model:
        meta["base_model"] = origin.base_model
    return meta


def resolved_precision(recipe: Any) -> str:
    """``train.precision`` as it resolves on this process's device (what ran, when the card is
    written by the run): ``bf16``, or ``bf16 (train.precision=auto)``."""
    from mta.distributed import local_device
    from mta.dtypes import resolve_precision

    requested = recipe.train.precision
    name = resolve_precision(requested, local_device())
    return name if requested == name else f"{name} (train.precision={requested})"


def llm_card_facts(recipe: Recipe) -> CardFacts:
    """The card of a causal-LM student (``task: llm``)."""
    loss = recipe.loss
    terms = [
        (loss.base, loss.base_weight),
        ("DSA", loss.dsa_weight),
        ("HRA", loss.hra_weight),
        ("FDD", loss.fdd_weight),
    ]
    meta = base_metadata(recipe, library="transformers", pipeline="text-generation")
    datasets = _datasets([recipe.data.train, recipe.data.dev])
    if datasets:
        meta["datasets"] = datasets
    sft = is_sft(recipe)
    meta["tags"] = ["mta", "sft" if sft else "knowledge-distillation", loss.base] + [
        name
        for name, weight in (("dsa", loss.dsa_weight), ("hra", loss.hra_weight), ("fdd", loss.fdd_weight))
        if weight
    ]
    how = (
        "fine-tuned on the reference responses (SFT: no teacher term) with mta, as a baseline"
        if sft
        else "trained by knowledge distillation with mta (Multi-Granular Trajectory Alignment)"
    )
    return CardFacts(
        metadata=meta,
        intro=f"A student {how}. "
        'It is a plain Hugging Face causal LM: `AutoModelForCausalLM.from_pretrained("<this directory>")`; '
        "`sha256sum -c checksums.sha256` verifies its files.",
        loss=loss_terms(terms),
        teacher=describe_model(recipe.teacher, recipe) if not sft or recipe.teacher is None else "not used (SFT)",
        data_limits=f"at most {recipe.data.max_length} tokens, {recipe.data.max_prompt_length} of prompt",
    )


def is_sft(recipe: Recipe) -> bool:
    """Whether the run learns from the reference responses alone: no teacher, or a teacher no
    term reads (``ce`` base and no DSA, HRA or FDD), as the demo's and the reproductions' SFT runs."""
    loss = recipe.loss
    return recipe.teacher is None or (loss.base == "ce" and not (loss.dsa_weight or loss.hra_weight or loss.fdd_weight))


def metadata(recipe: Recipe) -> dict[str, Any]:
    """The card's YAML front matter."""
    return task_of(recipe).card(recipe).metadata


def last_dev_metrics(records: Iterable[dict], step: int | None = None) -> dict | None:
    """The numbers of the last dev record (at or before ``step``), samples left out."""
    dev = [r for r in records if r.get("split") == "dev" and (step is None or r.get("step", 0) <= step)]
    if not dev:
        return None
    return {k: v for k, v in dev[-1].items() if k not in ("split", "samples") and isinstance(v, (int, float))}


def model_card(
    recipe: Recipe,
    *,
    step: int | None = None,
    dev: dict | None = None,
    what: str = "final",
    selection: dict | None = None,
) -> str:
    """The card's text: front matter, then what the student is and how it was made.
    ``selection``: a ``best/`` student's selection.json (the metric, its value and step)."""
    version = package_versions(("mta",))["mta"] or "unknown"
    facts = task_of(recipe).card(recipe)
    front = yaml.safe_dump(facts.metadata, sort_keys=False, allow_unicode=True).strip()
    data = f"train {shareable(recipe.data.train)}" + (f", dev {shareable(recipe.data.dev)}" if recipe.data.dev else "")
    rows = [
        ("teacher", facts.teacher),
        ("student start", describe_model(recipe.student, recipe)),
        ("recipe", f"`{recipe.name}`, {recipe_hash(recipe)} (the resolved recipe: recipe.yaml beside this card)"),
        ("loss", facts.loss),
        ("data", f"{data}; {facts.data_limits}"),
        (
            "steps",
            (f"{step}" if step is not None else "not recorded")
            + f" (global batch {recipe.train.batch_size}, lr {recipe.train.lr:g}, {resolved_precision(recipe)})",
        ),
        ("mta", version),
    ]
    spec = getattr(recipe.student, "lora", None)  # an encoder student has no lora
    if spec is not None:
        rows.insert(
            -1,
            (
                "LoRA",
                f"r {spec.r}, alpha {spec.alpha:g}, dropout {spec.dropout:g} on "
                f"{spec.target_modules or 'the architecture default'}; merged into these weights",
            ),
        )
    if selection:
        rows.insert(
            -1,
            (
                "selected by",
                f"{selection['metric']} = {selection['value']:.4f} at step "
                f"{selection['step']} ({selection['goal']} of the run's dev evaluations)",
            ),
        )
    lines = [
        "---",
        front,
        "---",
        "",
        f"# {recipe.name}: {'SFT baseline' if task_of(recipe).name == 'llm' and is_sft(recipe) else 'distilled'} "
        f"student ({what})",
        "",
        facts.intro,
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in rows),
        "",
    ]
    if dev:
        at = f" at step {dev['step']}" if "step" in dev else ""
        lines += [f"## Dev metrics{at} (the last before saving)", "", "| metric | value |", "|---|---:|"]
        lines += [
            f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
            for key, value in dev.items()
            if key != "step"
        ]
        lines.append("")
    else:
        lines += ["No dev metrics were recorded (no data.dev, or no dev evaluation before saving).", ""]
    return "\n".join(lines)


def write_model_card(
    directory: str | Path,
    recipe: Recipe,
    *,
    step: int | None = None,
    metrics_path: str | Path | None = None,
    what: str = "final",
    selection: dict | None = None,
) -> Path:
    """``directory/README.md`` for the student saved there at ``step``; the dev metrics are the
    last of ``metrics_path`` (a run's metrics.jsonl) up to ``step``. Returns the card's path."""
    records = read_metrics(Path(metrics_path)) if metrics_path and Path(metrics_path).is_file() else []
    path = Path(directory) / CARD
    atomic_write_text(
        path, model_card(recipe, step=step, dev=last_dev_metrics(records, step), what=what, selection=selection)
    )
    return path
