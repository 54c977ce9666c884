"""`mta evaluate --task embedding`: sentence-embedding checkpoints, side by side, in the LLM
evaluation's ``results.json`` / ``results.md``: teacher agreement on held-out texts (set ``proxy``,
:func:`teacher_agreement`) and the TALAS author's nine tasks (TALAS.md §9, his ``eval.py``, on his
CSV copies ``phongdq/TALAS-M-Datasets``: MTEB's tasks of those names use other splits and
protocols). A task whose files cannot be reached is reported unavailable with the reason, never
left out. Checkpoints are fingerprinted as LLM checkpoints are; rank 0 does the work.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mta import distributed
from mta.dtypes import dtype_name, resolve_dtype
from mta.embedding.embed import TeacherEmbeddings, build_teacher_embeddings, read_teacher_embeddings
from mta.embedding.encoder import load_encoder
from mta.embedding.pooling import AUTO
from mta.errors import MtaError
from mta.evaluation.models_under_test import checkpoint_names
from mta.files import atomic_write_json, atomic_write_text, disk_full_is_reported, make_output_directory
from mta.models.weights import checkpoint_fingerprint
from mta.reporting import Reporter, SilentReporter
from mta.tables import markdown_table
from mta.versions import package_versions

TASKS_REPO = "phongdq/TALAS-M-Datasets"  # the author's evaluation CSVs (a Hub dataset repo)
TASKS_SUBDIR = "multi-data"
DEFAULT_K = (1, 10)
DEFAULT_MAX_PAIRS = 1_000_000


# --------------------------------------------------------------------------- the measures


def ranks(values: np.ndarray) -> np.ndarray:
    """0-based ranks of ``values`` with ties given their mean rank (as ``scipy.stats.rankdata``
    minus one)."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="mergesort")
    ranked = np.empty(len(values), dtype=np.float64)
    ranked[order] = np.arange(len(values), dtype=np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranked) / counts)[inverse]


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the tie-averaged ranks); None when either side
    is constant (it is undefined) or there are fewer than two values."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} and {len(b)} values")
    if len(a) < 2:
        return None
    ra, rb = ranks(a) - (len(a) - 1) / 2, ranks(b) - (len(b) - 1) / 2
    denominator = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return None if denominator == 0 else float((ra * rb).sum() / denominator)


def average_precision(scores: Sequence[float], labels: Sequence[int]) -> float | None:
    """Average precision of ``scores`` for the positive ``labels`` (1), as
    ``sklearn.metrics.average_precision_score``: Σ_n (R_n − R_{n−1}) P_n over the distinct score
    thresholds, highest first. None without a positive."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(np.int64)
    positives = int(labels.sum())
    if positives == 0:
        return None
    order = np.argsort(-scores, kind="mergesort")
    scores, labels = scores[order], labels[order]
    last_of_threshold = np.r_[np.nonzero(np.diff(scores))[0], len(scores) - 1]
    true_positives = np.cumsum(labels)[last_of_threshold]
    precision = true_positives / (last_of_threshold + 1)
    recall = true_positives / positives
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def macro_f1(truth: Sequence, predicted: Sequence) -> float:
    """The unweighted mean over the classes present in either list of each class's F1
    (``sklearn.metrics.f1_score(average="macro")``; a class never predicted nor present
    scores 0)."""
    truth, predicted = np.asarray(truth), np.asarray(predicted)
    scores = []
    for label in np.union1d(truth, predicted):
        tp = float(np.sum((truth == label) & (predicted == label)))
        fp = float(np.sum((truth != label) & (predicted == label)))
        fn = float(np.sum((truth == label) & (predicted != label)))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else 0.0


def sampled_pairs(n: int, max_pairs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i, j)`` index tensors of distinct texts: every pair i < j when there are at most
    ``max_pairs``, else ``max_pairs`` pairs drawn uniformly (with ``seed``) among i != j."""
    if n < 2:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    if n * (n - 1) // 2 <= max_pairs:
        pairs = torch.triu_indices(n, n, offset=1)
        return pairs[0], pairs[1]
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(0, n, (max_pairs,), generator=generator)
    second = (first + torch.randint(1, n, (max_pairs,), generator=generator)) % n
    return first, second


def pair_cosines(
    embeddings: torch.Tensor, first: torch.Tensor, second: torch.Tensor, block: int = 1 << 16
) -> torch.Tensor:
    """``cos(e_i, e_j)`` for each pair, float64, in blocks of pairs (flat memory)."""
    unit = torch.nn.functional.normalize(embeddings.double(), dim=-1)
    return (
        torch.cat(
            [(unit[first[s : s + block]] * unit[second[s : s + block]]).sum(-1) for s in range(0, len(first), block)]
        )
        if len(first)
        else torch.empty(0, dtype=torch.float64)
    )


def neighbour_recall(
    student: torch.Tensor, teacher: torch.Tensor, ks: Sequence[int], block: int = 1024
) -> dict[str, float]:
    """``{"recall@k": ...}``: the share of texts whose teacher nearest neighbour (highest
    teacher cosine among the other texts) is among the student's k nearest (itself excluded)."""
    n = len(teacher)
    if n < 2:
        return {f"recall@{k}": float("nan") for k in ks}
    s_unit = torch.nn.functional.normalize(student.double(), dim=-1)
    t_unit = torch.nn.functional.normalize(teacher.double(), dim=-1)
    k_max = min(max(ks), n - 1)
    hits = {k: 0 for k in ks}
    for start in range(0, n, block):
        rows = torch.arange(start, min(start + block, n))
        t_sim = t_unit[rows] @ t_unit.T
        s_sim = s_unit[rows] @ s_unit.T
        t_sim[torch.arange(len(rows)), rows] = -math.inf
        s_sim[torch.arange(len(rows)), rows] = -math.inf
        nearest = t_sim.argmax(dim=1, keepdim=True)  # [rows, 1]
        top = s_sim.topk(k_max, dim=1).indices  # [rows, k_max], best first
        found = top == nearest
        for k in ks:
            hits[k] += int(found[:, : min(k, n - 1)].any(dim=1).sum())
    return {f"recall@{k}": hits[k] / n for k in ks}


def teacher_agreement(
    student: torch.Tensor,
    teacher: torch.Tensor,
    *,
    max_pairs: int = DEFAULT_MAX_PAIRS,
    ks: Sequence[int] = DEFAULT_K,
    seed: int = 0,
) -> dict:
    """The proxy of one checkpoint: ``spearman`` of the student's and the teacher's cosines over
    pairs of distinct texts (all, or ``max_pairs`` drawn with ``seed``; widths may differ),
    ``recall@k`` (is the teacher's nearest neighbour among the student's k nearest, the mean over
    texts) and ``pairs``; both are 1.0 for the teacher itself.

    student ``[n, d_s]``, teacher ``[n, d_t]``: row i of both is text i."""
    if len(student) != len(teacher):
        raise ValueError(f"teacher_agreement: {len(student)} student and {len(teacher)} teacher rows")
    first, second = sampled_pairs(len(teacher), max_pairs, seed)
    rho = spearman(pair_cosines(student, first, second).numpy(), pair_cosines(teacher, first, second).numpy())
    return {"spearman": rho, **neighbour_recall(student, teacher, ks), "pairs": len(first)}


# --------------------------------------------------------------------------- the nine tasks


@dataclass(frozen=True)
class EmbeddingTask:
    """One of the author's tasks: its category, metric and CSV files (``train`` for classification)."""

    name: str
    title: str
    category: str  # classification | pair | sts
    test: str
    train: str | None = None

    @property
    def metric(self) -> str:
        return {"classification": "macro_f1", "pair": "average_precision", "sts": "spearman"}[self.category]


TASKS = (
    EmbeddingTask("banking77", "Banking77", "classification", "banking77_test.csv", "banking_train.csv"),
    EmbeddingTask("emotion", "Emotion", "classification", "emotion_test.csv", "emotion_train.csv"),
    EmbeddingTask("tweeteval", "TweetEval", "classification", "tweet_test.csv", "tweet_train.csv"),
    EmbeddingTask("mrpc", "MRPC", "pair", "mrpc_test.csv"),
    EmbeddingTask("scitail", "SciTail", "pair", "scitail_test.csv"),
    EmbeddingTask("wic", "WiC", "pair", "wic_test.csv"),
    EmbeddingTask("sick", "SICK", "sts", "sick_test.csv"),
    EmbeddingTask("sts12", "STS12", "sts", "sts12_test.csv"),
    EmbeddingTask("stsb", "STS-B", "sts", "stsb_test.csv"),
)
CATEGORIES = ("classification", "pair", "sts")
TASK_NAMES = tuple(task.name for task in TASKS)


def _download_hint() -> str:
    return (
        f"download the author's CSVs where the Hub is reachable (`hf download {TASKS_REPO} --repo-type "
        f"dataset --local-dir DIR`) and pass --tasks-dir DIR/{TASKS_SUBDIR}"
    )


def locate_task_files(task: EmbeddingTask, tasks_dir: Path | None) -> tuple[dict[str, Path] | None, str | None]:
    """``({"test": path, ["train": path]}, None)``, or ``(None, why not)``: from ``tasks_dir``
    (``DIR/x.csv`` or ``DIR/multi-data/x.csv``), else from the Hub when it is reachable."""
    names = {"test": task.test, **({"train": task.train} if task.train else {})}
    if tasks_dir is not None:
        found = {}
        for role, name in names.items():
            candidates = [tasks_dir / name, tasks_dir / TASKS_SUBDIR / name]
            path = next((c for c in candidates if c.is_file()), None)
            if path is None:
                return None, f"{name} is not in --tasks-dir {tasks_dir} (nor in its {TASKS_SUBDIR}/)"
            found[role] = path
        return found, None
    from mta.models.hub import endpoint, offline_mode, unreachable_reason

    if offline_mode():
        return None, f"HF_HUB_OFFLINE is set and no --tasks-dir was given; {_download_hint()}"
    reason = unreachable_reason(endpoint())
    if reason is not None:
        return None, f"the Hugging Face Hub ({endpoint()}) is unreachable ({reason}); {_download_hint()}"
    try:
        from huggingface_hub import hf_hub_download

        return {
            role: Path(hf_hub_download(TASKS_REPO, f"{TASKS_SUBDIR}/{name}", repo_type="dataset"))
            for role, name in names.items()
        }, None
    except Exception as error:  # a missing file, a gated repo, a dropped connection
        return (
            None,
            f"cannot download {TASKS_REPO}/{TASKS_SUBDIR}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}",
        )


def _read_csv(path: Path, columns: Sequence[str]) -> dict[str, list[str]]:
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise MtaError(f"{path}: no column {', '.join(missing)} (it has {', '.join(reader.fieldnames or [])})")
        rows = list(reader)
    return {column: [row[column] for row in rows] for column in columns}


def score_task(task: EmbeddingTask, files: dict[str, Path], encode) -> dict:
    """One task's metric for ``encode(texts) -> [n, d] tensor``, by the author's protocol."""
    if task.category == "classification":
        try:
            from sklearn.linear_model import LogisticRegression
        except ImportError as error:
            raise _Unavailable("scikit-learn is not installed (pip install 'mta-distill[embed]')") from error
        train, test = _read_csv(files["train"], ("text", "label")), _read_csv(files["test"], ("text", "label"))
        classifier = LogisticRegression(random_state=42, n_jobs=1, max_iter=200)
        classifier.fit(encode(train["text"]).numpy(), train["label"])
        predicted = classifier.predict(encode(test["text"]).numpy())
        return {"macro_f1": macro_f1(test["label"], predicted), "rows": len(test["text"])}
    label = "score" if task.category == "sts" else "label"
    rows = _read_csv(files["test"], ("sentence1", "sentence2", label))
    cosines = torch.nn.functional.cosine_similarity(
        encode(rows["sentence1"]).double(), encode(rows["sentence2"]).double()
    ).numpy()
    gold = np.asarray([float(v) for v in rows[label]])
    if task.category == "sts":
        return {"spearman": spearman(cosines, gold), "rows": len(gold)}
    return {"average_precision": average_precision((cosines + 1) / 2, gold.astype(np.int64)), "rows": len(gold)}


class _Unavailable(Exception):
    pass


# --------------------------------------------------------------------------- the whole evaluation


@dataclass(frozen=True)
class EmbeddingEvalSettings:
    """What ``mta evaluate --task embedding`` runs with."""

    pooling: str = AUTO
    max_length: int | None = None
    batch_size: int = 64
    dtype: str = "auto"
    device: str = "auto"
    max_pairs: int = DEFAULT_MAX_PAIRS
    ks: tuple[int, ...] = DEFAULT_K
    seed: int = 0
    tasks: tuple[str, ...] | None = None  # None: all nine
    tasks_dir: str | None = None
    limit: int | None = None  # first N held-out texts

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise MtaError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.max_pairs < 1:
            raise MtaError(f"--max-pairs must be at least 1, got {self.max_pairs}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise MtaError(f"--k must be positive integers, got {self.ks}")
        unknown = [t for t in (self.tasks or ()) if t not in TASK_NAMES + ("none",)]
        if unknown:
            raise MtaError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASK_NAMES)} (or none)")

    def record(self) -> dict:
        return {
            "pooling": self.pooling,
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "device": self.device,
            "max_pairs": self.max_pairs,
            "k": list(self.ks),
            "seed": self.seed,
            "tasks": list(self.tasks) if self.tasks is not None else None,
            "tasks_dir": self.tasks_dir,
            "limit": self.limit,
        }


def protocol() -> dict:
    return {
        "proxy.spearman": (
            "Spearman (tie-averaged ranks) between the checkpoint's and the teacher's cosine similarities "
            "over the pairs"
        ),
        "proxy.recall@k": (
            "share of held-out texts whose teacher nearest neighbour is among the checkpoint's k nearest "
            "(self excluded)"
        ),
        "classification": (
            "LogisticRegression(max_iter=200, random_state=42) on the train split's embeddings; macro-F1 on test"
        ),
        "pair": "average precision of (cos + 1) / 2 against the binary label",
        "sts": "Spearman between cosine and the gold score",
        "avg": "mean of the three category means (only when all nine tasks ran)",
        "source": f"the author's CSVs ({TASKS_REPO}/{TASKS_SUBDIR}), test splits",
    }


def evaluate_embedding_checkpoints(
    checkpoints: Sequence[str | Path],
    *,
    out_dir: str | Path,
    names: Sequence[str] | None = None,
    teacher: str | Path | None = None,
    data: str | Path | None = None,
    teacher_embeddings: str | Path | None = None,
    settings: EmbeddingEvalSettings | None = None,
    reporter: Reporter | None = None,
) -> dict:
    """Score ``checkpoints`` (encoder directories or hub names) on the proxy and the nine tasks;
    write ``OUT/results.json`` and ``OUT/results.md``; return what results.json holds.

    The held-out texts and their teacher vectors: ``teacher_embeddings`` (an ``mta embed``
    directory), or ``teacher`` and ``data`` (embedded into ``OUT/teacher-embeddings``, reused).
    Without either the proxy is left out (the nine tasks still run).
    """
    settings = settings or EmbeddingEvalSettings()
    reporter = reporter or SilentReporter()
    checkpoints = [str(c) for c in checkpoints]
    if not checkpoints:
        raise MtaError("give at least one checkpoint to evaluate")
    out_dir = Path(out_dir)
    labels = checkpoint_names(checkpoints, names)
    if teacher_embeddings is not None and (teacher is not None or data is not None):
        raise MtaError("give --teacher-embeddings DIR, or --teacher and --held-out, not both")
    if (teacher is None) != (data is None):
        raise MtaError("--teacher and --held-out go together: the teacher embeds the held-out texts of --held-out")
    fingerprints = [checkpoint_fingerprint(checkpoint)[0] for checkpoint in checkpoints]
    tasks_dir = Path(settings.tasks_dir) if settings.tasks_dir else None
    if tasks_dir is not None and not tasks_dir.is_dir():
        raise MtaError(f"--tasks-dir {tasks_dir} is not a directory; {_download_hint()}")
    make_output_directory(out_dir)  # a read-only or full -o: one line before any encoder loads
    device = distributed.resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    with distributed.joined_process_group():
        results = None
        if distributed.is_main():
            held_out = _held_out(teacher, data, teacher_embeddings, out_dir, settings, reporter)
            wanted = [t for t in TASKS if settings.tasks is None or t.name in settings.tasks]
            located = {task.name: locate_task_files(task, tasks_dir) for task in wanted}
            runs = {}
            for checkpoint, label, fingerprint in zip(checkpoints, labels, fingerprints, strict=True):
                runs[label] = _evaluate_one(
                    checkpoint, fingerprint, held_out, wanted, located, settings, device, dtype, reporter, label
                )
            results = {
                "task": "embedding",
                "protocol": protocol(),
                "settings": {**settings.record(), "dtype": dtype_name(dtype)},
                "sets": _sets(held_out, wanted, located, settings),
                "checkpoints": runs,
                "versions": package_versions(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            with disk_full_is_reported(out_dir / "results.json"):
                atomic_write_json(out_dir / "results.json", results)
            with disk_full_is_reported(out_dir / "results.md"):
                atomic_write_text(out_dir / "results.md", results_markdown(results))
        distributed.barrier()
        return distributed.broadcast_from_main(results)


def _held_out(
    teacher, data, teacher_embeddings, out_dir: Path, settings: EmbeddingEvalSettings, reporter
) -> TeacherEmbeddings | None:
    if teacher_embeddings is None and teacher is None:
        return None
    if teacher_embeddings is None:
        teacher_embeddings = build_teacher_embeddings(
            teacher,
            Path(data),
            out_dir / "teacher-embeddings",
            batch_size=settings.batch_size,
            dtype=settings.dtype,
            device=settings.device,
            reporter=reporter,
            shard=(0, 1),
        )
    held_out = read_teacher_embeddings(teacher_embeddings)
    if settings.limit is not None and settings.limit < len(held_out):
        n = settings.limit
        held_out = TeacherEmbeddings(
            held_out.directory, held_out.ids[:n], held_out.texts[:n], held_out.embeddings[:n], held_out.manifest
        )
    return held_out


def _evaluate_one(checkpoint, fingerprint, held_out, tasks, located, settings, device, dtype, reporter, label) -> dict:
    encoder = load_encoder(
        checkpoint, pooling=settings.pooling, max_length=settings.max_length, dtype=dtype, device=device
    )

    def encode(texts: Sequence[str], what: str) -> torch.Tensor:
        texts = list(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # similar lengths batch together
        reporter.start(f"{label} · {what}", len(texts), unit="texts")
        out = torch.empty(len(texts), encoder.dimension)
        try:
            for start in range(0, len(order), settings.batch_size):
                batch = order[start : start + settings.batch_size]
                out[batch] = encoder.embed_batch(encoder.tokenize([texts[i] for i in batch]))
                reporter.advance(len(batch))
        finally:
            reporter.stop()
        return out

    sets: dict[str, dict | None] = {}
    if held_out is not None:
        student = encode(held_out.texts, "proxy")
        sets["proxy"] = teacher_agreement(
            student, held_out.embeddings, max_pairs=settings.max_pairs, ks=settings.ks, seed=settings.seed
        )
    for task in tasks:
        files, reason = located[task.name]
        if files is None:
            sets[task.name] = None
            continue
        try:
            sets[task.name] = score_task(task, files, lambda texts, name=task.name: encode(texts, name))
        except _Unavailable as unavailable:
            located[task.name] = (None, str(unavailable))
            sets[task.name] = None
    categories = {}
    for category in CATEGORIES:
        members = [t for t in TASKS if t.category == category]
        values = [sets.get(t.name, None) for t in members]
        scored = [
            v[t.metric] for t, v in zip(members, values, strict=True) if v is not None and v.get(t.metric) is not None
        ]
        categories[category] = float(np.mean(scored)) if len(scored) == len(members) else None
    complete = all(value is not None for value in categories.values())
    return {
        "checkpoint": str(checkpoint),
        "fingerprint": fingerprint,
        "pooling": {**encoder_record(checkpoint, settings)},
        "sets": sets,
        "categories": categories,
        "avg": float(np.mean(list(categories.values()))) if complete else None,
    }


def encoder_record(checkpoint, settings: EmbeddingEvalSettings) -> dict:
    from mta.embedding.encoder import plan_encoder

    plan = plan_encoder(checkpoint, pooling=settings.pooling, max_length=settings.max_length)
    return {**plan.pooling.record(), "max_length": plan.max_length}


def _sets(held_out, tasks, located, settings) -> dict:
    sets = {}
    if held_out is not None:
        manifest = held_out.manifest
        sets["proxy"] = {
            "title": "teacher agreement",
            "path": manifest.get("input", {}).get("path"),
            "teacher_embeddings": str(held_out.directory),
            "teacher": manifest.get("teacher", {}).get("name"),
            "teacher_pooling": manifest.get("pooling"),
            "rows": len(held_out),
            "pairs": sampled_pairs(len(held_out), settings.max_pairs, settings.seed)[0].numel(),
            "available": True,
        }
    for task in tasks:
        files, reason = located[task.name]
        sets[task.name] = {
            "title": task.title,
            "category": task.category,
            "metric": task.metric,
            "available": files is not None,
            "reason": reason,
            "files": {role: str(path) for role, path in (files or {}).items()},
        }
    return sets


# --------------------------------------------------------------------------- results.md


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """Header and body of the comparison table (results.md and the terminal)."""
    sets = results["sets"]
    ks = results["settings"]["k"]
    header = ["checkpoint"]
    if "proxy" in sets:
        header += ["agreement ρ", *(f"NN recall@{k}" for k in ks)]
    tasks = [name for name in sets if name != "proxy" and sets[name]["available"]]
    header += [sets[name]["title"] for name in tasks]
    header += ["classification", "pair", "sts", "avg"] if tasks else []
    body = []
    for label, run in results["checkpoints"].items():
        cells = [label]
        if "proxy" in sets:
            proxy = run["sets"]["proxy"]
            cells += [_number(proxy["spearman"]), *(_number(proxy[f"recall@{k}"]) for k in ks)]
        for name in tasks:
            value = run["sets"].get(name)
            cells.append(_number(value[sets[name]["metric"]] if value else None))
        if tasks:
            cells += [_number(run["categories"][c]) for c in CATEGORIES] + [_number(run["avg"])]
        body.append(cells)
    return header, body


def _number(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def unavailable_tasks(results: dict) -> dict[str, list[str]]:
    """``{reason: [task titles]}`` of the tasks that did not run, grouped by why."""
    grouped: dict[str, list[str]] = {}
    for name, entry in results["sets"].items():
        if name != "proxy" and not entry["available"]:
            grouped.setdefault(entry["reason"], []).append(entry["title"])
    return grouped


def results_markdown(results: dict) -> str:
    """results.md: what the numbers are, the table, and every task that could not run, with why."""
    lines = ["# Evaluation (embedding)", ""]
    proxy = results["sets"].get("proxy")
    if proxy:
        lines += [
            f"Teacher agreement on {proxy['rows']} held-out texts ({proxy['path']}), teacher {proxy['teacher']}: "
            f"Spearman ρ between the checkpoint's and the teacher's cosine similarities over {proxy['pairs']} pairs; "
            "NN recall@k = share of texts whose teacher nearest neighbour is among the checkpoint's k nearest.",
            "",
        ]
    lines += [*markdown_table(*table_rows(results)), ""]
    missing = [(name, s) for name, s in results["sets"].items() if name != "proxy" and not s["available"]]
    if missing:
        lines += ["Not run (the author's nine tasks need their CSV files):", ""]
        lines += [f"- {', '.join(titles)}: {reason}" for reason, titles in unavailable_tasks(results).items()]
        lines.append("")
    return "\n".join(lines)


__all__ = [
    "EmbeddingEvalSettings",
    "TASKS",
    "average_precision",
    "evaluate_embedding_checkpoints",
    "macro_f1",
    "neighbour_recall",
    "ranks",
    "results_markdown",
    "spearman",
    "table_rows",
    "teacher_agreement",
]
