"""`mta evaluate --task embedding`: the measures against hand computations, and the files written."""

from __future__ import annotations

import csv
import json
import math
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

from mta.embedding.evaluation import (
    TASKS,
    average_precision,
    macro_f1,
    neighbour_recall,
    ranks,
    sampled_pairs,
    spearman,
    teacher_agreement,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "recipes" / "examples"


@pytest.fixture(autouse=True)
def fp32_on_the_cpu(monkeypatch):
    monkeypatch.setenv("MTA_CPU_BF16", "0")


def hand_spearman(a, b):
    """Ranks by counting (ties: the mean of the positions they share), then Pearson by sums."""

    def rank(values):
        out = []
        for v in values:
            below = sum(1 for w in values if w < v)
            equal = sum(1 for w in values if w == v)
            out.append(below + (equal - 1) / 2)
        return out

    ra, rb = rank(list(a)), rank(list(b))
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def test_spearman_with_ties_is_the_hand_computation():
    a = [0.3, 0.1, 0.3, 0.9, 0.5, 0.1, 0.7]
    b = [1.0, 2.0, 0.5, 3.0, 3.0, -1.0, 2.5]
    assert ranks(a).tolist() == [2.5, 0.5, 2.5, 6.0, 4.0, 0.5, 5.0]
    assert spearman(a, b) == pytest.approx(hand_spearman(a, b), abs=1e-12)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # a constant side has no correlation
    try:
        from scipy.stats import spearmanr
    except ImportError:
        return
    generator = np.random.default_rng(0)
    x, y = generator.integers(0, 5, 200), generator.normal(size=200)
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)


def test_average_precision_and_macro_f1_are_the_hand_computations():
    scores = [0.9, 0.8, 0.8, 0.4, 0.3, 0.1]
    labels = [1, 0, 1, 0, 1, 0]
    # thresholds 0.9 (P 1, R 1/3), 0.8 (P 2/3, R 2/3), 0.4 (P 2/4), 0.3 (P 3/5, R 1), 0.1
    expected = (1 / 3) * 1 + (1 / 3) * (2 / 3) + (1 / 3) * (3 / 5)
    assert average_precision(scores, labels) == pytest.approx(expected)
    assert average_precision([0.2, 0.1], [0, 0]) is None
    truth, predicted = ["a", "a", "b", "c", "c", "c"], ["a", "b", "b", "c", "c", "a"]
    f1 = {"a": 2 * 1 / (2 * 1 + 1 + 1), "b": 2 * 1 / (2 * 1 + 1 + 0), "c": 2 * 2 / (2 * 2 + 0 + 1)}
    assert macro_f1(truth, predicted) == pytest.approx(sum(f1.values()) / 3)
    try:
        from sklearn.metrics import average_precision_score, f1_score
    except ImportError:
        return
    assert average_precision(scores, labels) == pytest.approx(average_precision_score(labels, scores))
    assert macro_f1(truth, predicted) == pytest.approx(f1_score(truth, predicted, average="macro"))


def hand_agreement(student, teacher, ks):
    def cos(u, v):
        return float(u @ v / (u.norm() * v.norm()))

    n = len(teacher)
    pairs = list(combinations(range(n), 2))
    rho = hand_spearman(
        [cos(student[i], student[j]) for i, j in pairs], [cos(teacher[i], teacher[j]) for i, j in pairs]
    )
    recall = {}
    for k in ks:
        hits = 0
        for i in range(n):
            others = [j for j in range(n) if j != i]
            nearest = max(others, key=lambda j: cos(teacher[i], teacher[j]))
            ranked = sorted(others, key=lambda j: -cos(student[i], student[j]))
            hits += nearest in ranked[:k]
        recall[f"recall@{k}"] = hits / n
    return rho, recall


def test_teacher_agreement_is_the_hand_computation():
    generator = torch.Generator().manual_seed(3)
    teacher = torch.randn(12, 6, generator=generator)
    student = teacher[:, :4] + 0.7 * torch.randn(12, 4, generator=generator)  # other width, noisy
    got = teacher_agreement(student, teacher, ks=(1, 3))
    rho, recall = hand_agreement(student, teacher, (1, 3))
    assert got["spearman"] == pytest.approx(rho, abs=1e-9) and got["pairs"] == 66
    assert {k: got[k] for k in recall} == pytest.approx(recall)
    assert 0 < got["recall@1"] < 1 and got["spearman"] < 0.99  # the noise shows


def test_agreement_is_one_for_the_teacher_rotated_scaled_and_widened():
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(30, 8, generator=generator)
    rotation, _ = torch.linalg.qr(torch.randn(8, 8, generator=generator))
    student = torch.cat([teacher @ rotation, torch.zeros(30, 3)], dim=1) * torch.rand(30, 1, generator=generator).add(
        0.5
    )
    got = teacher_agreement(student, teacher, ks=(1, 5))
    assert got["spearman"] == pytest.approx(1.0) and got["recall@1"] == 1.0 and got["recall@5"] == 1.0
    shuffled = student[torch.randperm(30, generator=generator)]
    assert teacher_agreement(shuffled, teacher)["recall@1"] < 0.5


def test_pairs_are_all_pairs_or_a_seeded_sample_of_distinct_texts():
    first, second = sampled_pairs(5, 100, seed=0)
    assert sorted(zip(first.tolist(), second.tolist(), strict=True)) == list(combinations(range(5), 2))
    first, second = sampled_pairs(1000, 5000, seed=7)
    assert len(first) == 5000 and bool((first != second).all())
    again = sampled_pairs(1000, 5000, seed=7)
    assert torch.equal(first, again[0]) and torch.equal(second, again[1])
    assert math.isnan(neighbour_recall(torch.randn(1, 3), torch.randn(1, 3), (1,))["recall@1"])  # one text: undefined


def write_task_files(directory: Path) -> None:
    """The author's CSV shapes, a few rows each (texts from the shipped corpus)."""
    texts = [
        json.loads(line)["text"] for line in (EXAMPLES / "tiny-teacher-corpus.jsonl").read_text().splitlines() if line
    ]

    def write(name, header, rows):
        with open(directory / name, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)

    for task in TASKS:
        if task.category == "classification":
            write(task.train, ["text", "label"], [(t, i % 3) for i, t in enumerate(texts[:24])])
            write(task.test, ["text", "label"], [(t, i % 3) for i, t in enumerate(texts[24:36])])
        elif task.category == "pair":
            write(task.test, ["sentence1", "sentence2", "label"], [(texts[i], texts[i + 1], i % 2) for i in range(12)])
        else:
            write(task.test, ["sentence1", "sentence2", "score"], [(texts[i], texts[i + 2], i % 5) for i in range(12)])


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from mta.embedding.tiny_encoders import build_tiny_encoder

    root = tmp_path_factory.mktemp("encoders")
    teacher = build_tiny_encoder(
        root / "teacher", layers=2, hidden=32, heads=4, seed=1, pooling="mean", normalize=True, max_position=64
    )
    student = build_tiny_encoder(root / "student", layers=1, hidden=16, heads=2, seed=5, max_position=64)
    return teacher, student


def run_cli(*args: str) -> None:
    from mta_cli.main import app

    try:
        app(list(args), standalone_mode=False)
    except SystemExit as error:  # pragma: no cover
        assert error.code in (0, None)


def test_evaluate_task_embedding_writes_results_json_and_md(encoders, tmp_path, monkeypatch, capsys):
    teacher, student = encoders
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_task_files(tasks_dir)
    (tasks_dir / TASKS[-1].test).unlink()  # STS-B missing: reported, not silently dropped
    monkeypatch.setenv("MTA_PROGRESS", "plain")
    out = tmp_path / "eval"
    run_cli(
        "evaluate",
        "--task",
        "embedding",
        str(teacher),
        str(student),
        "--names",
        "teacher,student",
        "-o",
        str(out),
        "--teacher",
        str(teacher),
        "--held-out",
        str(EXAMPLES / "tiny-teacher-corpus.jsonl"),
        "--tasks-dir",
        str(tasks_dir),
    )
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "embedding" and set(results["checkpoints"]) == {"teacher", "student"}
    proxy = results["sets"]["proxy"]
    assert proxy["rows"] == 40 and proxy["pairs"] == 40 * 39 // 2
    ours = results["checkpoints"]["teacher"]["sets"]["proxy"]
    assert ours["spearman"] == pytest.approx(1.0) and ours["recall@1"] == 1.0  # the teacher agrees with itself
    theirs = results["checkpoints"]["student"]["sets"]["proxy"]
    assert theirs["spearman"] < 0.9 and results["checkpoints"]["student"]["fingerprint"].startswith("sha256:")
    assert not results["sets"]["stsb"]["available"] and "stsb_test.csv" in results["sets"]["stsb"]["reason"]
    assert results["checkpoints"]["student"]["sets"]["stsb"] is None
    assert (
        results["checkpoints"]["student"]["categories"]["sts"] is None
        and results["checkpoints"]["student"]["avg"] is None
    )
    pair = results["checkpoints"]["student"]["sets"]["mrpc"]
    assert pair["rows"] == 12 and 0 < pair["average_precision"] <= 1
    assert results["checkpoints"]["teacher"]["categories"]["pair"] is not None
    markdown = (out / "results.md").read_text()
    assert "| teacher | 1.0000 | 1.0000 | 1.0000 |" in markdown and "STS-B" in markdown and "Not run" in markdown
    assert (out / "teacher-embeddings" / ".mta" / "manifest.json").is_file()
    assert "wrote" in capsys.readouterr().out
