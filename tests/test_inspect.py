"""`mta inspect` (mta.inspection): linear CKA against a plain NumPy version, its invariances, the
structure agreement, the held-out linear fit, the layer-map DP against brute force, streaming, a
killed run, and the command end to end on tiny random models."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures.commands import files_of, run_mta
from mta.errors import MtaError
from mta.inspection.cka import LinearCKA, linear_cka
from mta.inspection.layer_map import monotone_choice
from mta.inspection.structure import HeldOutLinearFit, structure_agreement

pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------- plain NumPy CKA


def numpy_cka(x: np.ndarray, y: np.ndarray, estimator: str) -> float:
    """Linear CKA through the n × n Gram matrices, as the papers write it."""
    k, l_ = x @ x.T, y @ y.T

    def hsic(a: np.ndarray, b: np.ndarray) -> float:
        n = len(a)
        if estimator == "biased":
            h = np.eye(n) - np.ones((n, n)) / n
            return float(np.trace(a @ h @ b @ h))
        a, b = a.copy(), b.copy()
        np.fill_diagonal(a, 0.0)
        np.fill_diagonal(b, 0.0)
        ones = np.ones(n)
        return float(
            (
                np.trace(a @ b)
                + (ones @ a @ ones) * (ones @ b @ ones) / ((n - 1) * (n - 2))
                - 2.0 / (n - 2) * (ones @ a @ b @ ones)
            )
            / (n * (n - 3))
        )

    return hsic(k, l_) / np.sqrt(hsic(k, k) * hsic(l_, l_))


def features(seed: int, n: int = 80) -> list[np.ndarray]:
    """Three related feature sets (widths 6, 9, 4) with offsets far from 0."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, 6)) + 5.0
    return [base, base @ rng.normal(size=(6, 9)) + 0.5 * rng.normal(size=(n, 9)) - 30.0, rng.normal(size=(n, 4))]


@pytest.mark.parametrize("estimator", ["biased", "debiased"])
def test_streamed_cka_equals_plain_numpy_to_1e_6(estimator):
    left = features(0)
    right = [left[1] @ np.random.default_rng(9).normal(size=(9, 5)), features(1)[0]]  # related, unrelated
    accumulator = LinearCKA([a.shape[1] for a in left], [b.shape[1] for b in right])
    for start, end in ((0, 7), (7, 40), (40, 80)):  # uneven chunks
        accumulator.update([torch.tensor(a[start:end]) for a in left], [torch.tensor(b[start:end]) for b in right])
    expected = np.array([[numpy_cka(a, b, estimator) for b in right] for a in left])
    assert accumulator.items == 80
    np.testing.assert_allclose(accumulator.matrix(estimator), expected, atol=1e-6, rtol=0)
    assert abs(expected).max() > 0.05 and not np.allclose(expected, expected[0, 0])  # not a constant


def test_streaming_equals_all_at_once():
    sets = features(2, n=60)
    dims = [s.shape[1] for s in sets]
    whole, streamed = LinearCKA(dims, dims), LinearCKA(dims, dims)
    whole.update([torch.tensor(s) for s in sets], [torch.tensor(s) for s in sets])
    for start in range(0, 60, 11):
        chunk = [torch.tensor(s[start : start + 11]) for s in sets]
        streamed.update(chunk, chunk)
    for estimator in ("biased", "debiased"):
        np.testing.assert_allclose(streamed.matrix(estimator), whole.matrix(estimator), atol=1e-12, rtol=0)


@pytest.mark.parametrize("estimator", ["biased", "debiased"])
def test_self_cka_is_one_on_the_diagonal_and_symmetric(estimator):
    sets = [torch.tensor(s) for s in features(3)]
    dims = [s.shape[1] for s in sets]
    accumulator = LinearCKA(dims, dims)
    accumulator.update(sets, sets)
    matrix = accumulator.matrix(estimator)
    np.testing.assert_allclose(np.diag(matrix), 1.0, atol=1e-9)
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-9)
    assert (matrix[~np.eye(3, dtype=bool)] < 0.99).all()  # the off-diagonal differ: the check can fail


@pytest.mark.parametrize("estimator", ["biased", "debiased"])
def test_invariant_to_rotation_and_isotropic_scale_not_to_a_linear_map(estimator):
    rng = np.random.default_rng(4)
    x, y = features(4)[0], features(4)[1]
    rotation, _ = np.linalg.qr(rng.normal(size=(9, 9)))
    before = linear_cka(torch.tensor(x), torch.tensor(y), estimator)
    rotated = linear_cka(torch.tensor(x), torch.tensor(3.7 * y @ rotation), estimator)
    assert rotated == pytest.approx(before, abs=1e-9)
    assert linear_cka(torch.tensor(0.01 * x), torch.tensor(y), estimator) == pytest.approx(before, abs=1e-9)
    stretch = rng.normal(size=(9, 9)) @ np.diag([10.0, 1, 1, 1, 1, 1, 1, 1, 0.1])  # not orthogonal × scale
    moved = linear_cka(torch.tensor(x), torch.tensor(y @ stretch), estimator)
    assert abs(moved - before) > 1e-2


def test_bad_shapes_and_estimators_are_refused():
    accumulator = LinearCKA([3], [2])
    with pytest.raises(MtaError, match="expected \\[items, 3\\]"):
        accumulator.update([torch.zeros(4, 2)], [torch.zeros(4, 2)])
    with pytest.raises(MtaError, match="same items"):
        accumulator.update([torch.zeros(4, 3)], [torch.zeros(5, 2)])
    with pytest.raises(MtaError, match="not one of"):
        accumulator.matrix("kernel")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- structure and HRA fit


def test_structure_agreement_is_one_under_rotation_and_scale_and_near_zero_for_random():
    rng = np.random.default_rng(5)
    teacher = torch.tensor(rng.normal(size=(6, 12, 16)))
    rotation, _ = np.linalg.qr(rng.normal(size=(16, 16)))
    student = 2.5 * teacher @ torch.tensor(rotation)
    mask = torch.ones(6, 12, dtype=torch.bool)
    mask[1, 2:] = False  # 2 spans: too few to count
    mask[2, 7:] = False
    correlation, counted = structure_agreement(student, teacher, mask)
    assert counted.tolist() == [True, False, True, True, True, True]
    np.testing.assert_allclose(correlation[counted].numpy(), 1.0, atol=1e-9)

    unrelated = torch.tensor(rng.normal(size=(64, 12, 16)))
    teachers = torch.tensor(rng.normal(size=(64, 12, 16)))
    correlation, counted = structure_agreement(unrelated, teachers, torch.ones(64, 12, dtype=torch.bool))
    assert counted.all() and abs(float(correlation.mean())) < 0.05

    # against a plain Pearson on one row, with padding spans in between
    row = 2
    keep = mask[row].nonzero().squeeze(1).numpy()
    cos = lambda a: (a / np.linalg.norm(a, axis=1, keepdims=True)) @ (a / np.linalg.norm(a, axis=1, keepdims=True)).T  # noqa: E731
    noisy = student + torch.tensor(rng.normal(size=student.shape))
    upper = np.triu_indices(len(keep), 1)
    expected = np.corrcoef(cos(noisy[row].numpy()[keep])[upper], cos(teacher[row].numpy()[keep])[upper])[0, 1]
    got = structure_agreement(noisy, teacher, mask)[0][row]
    assert float(got) == pytest.approx(expected, abs=1e-9) and expected < 0.99


def test_held_out_linear_fit_against_numpy_least_squares():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(8, 10, 5))
    y = x @ rng.normal(size=(5, 7)) + 1.5 + 0.3 * rng.normal(size=(8, 10, 7))
    mask = np.ones((8, 10), dtype=bool)
    mask[:, 8:] = False
    fit = HeldOutLinearFit(5, 7, ridge=0.0)
    weights = torch.tensor(mask, dtype=torch.float32)
    for rows in (slice(0, 2), slice(2, 4)):
        fit.fit(torch.tensor(x[rows]), torch.tensor(y[rows]), torch.tensor(mask[rows]))
    for rows in (slice(4, 6), slice(6, 8)):
        fit.measure(torch.tensor(x[rows]), torch.tensor(y[rows]), weights[rows], torch.tensor(mask[rows]))
    result = fit.result()
    design = lambda a: np.concatenate([a, np.ones((len(a), 1))], axis=1)  # noqa: E731
    train_x, train_y = x[:4][mask[:4]], y[:4][mask[:4]]
    w, *_ = np.linalg.lstsq(design(train_x), train_y, rcond=None)
    test_x, test_y = x[4:][mask[4:]], y[4:][mask[4:]]
    predicted = design(test_x) @ w
    expected = ((predicted - test_y) ** 2).sum() / ((test_y - test_y.mean(axis=0)) ** 2).sum()
    assert result["relative_residual"] == pytest.approx(expected, rel=1e-9)
    assert 0.0 < expected < 0.5
    cosines = (predicted * test_y).sum(1) / np.linalg.norm(predicted, axis=1) / np.linalg.norm(test_y, axis=1)
    per_row = (1 - cosines).reshape(4, 8).mean(axis=1)  # uniform weights: HRA is a row's mean 1 − cos
    assert result["hra"] == pytest.approx(per_row.mean(), abs=1e-5)
    assert (result["fitted_items"], result["measured_items"], result["measured_rows"]) == (32, 32, 4)
    assert not result["underdetermined"]  # 32 items for 6 inputs: at least 5 per input
    thin = HeldOutLinearFit(5, 7)
    thin.fit(torch.tensor(x[:1]), torch.tensor(y[:1]), torch.tensor(mask[:1]))  # 8 items
    thin.measure(torch.tensor(x[4:5]), torch.tensor(y[4:5]), weights[4:5], torch.tensor(mask[4:5]))
    assert thin.result()["underdetermined"]
    with pytest.raises(MtaError, match="already solved"):
        fit.fit(torch.tensor(x[:1]), torch.tensor(y[:1]), torch.tensor(mask[:1]))


# --------------------------------------------------------------------------- the layer map DP


def brute_force(scores: np.ndarray, strict: bool) -> float:
    pairs, layers = scores.shape
    best = -np.inf
    for choice in itertools.product(range(layers), repeat=pairs):
        steps = np.diff(choice)
        if (steps > 0).all() if strict else (steps >= 0).all():
            best = max(best, sum(scores[i, t] for i, t in enumerate(choice)))
    return best


@pytest.mark.parametrize("strict", [False, True])
def test_layer_map_dp_is_monotone_and_optimal_against_brute_force(strict):
    rng = np.random.default_rng(7)
    for _ in range(150):
        pairs, layers = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        if strict and pairs > layers:
            continue
        scores = rng.normal(size=(pairs, layers)).round(1)  # ties happen
        choice, total = monotone_choice(scores, strict=strict)
        steps = np.diff(choice)
        assert (steps > 0).all() if strict else (steps >= 0).all()
        assert total == pytest.approx(sum(scores[i, t] for i, t in enumerate(choice)))
        assert total == pytest.approx(brute_force(scores, strict)), (scores, choice)


def test_layer_map_dp_gives_up_the_unconstrained_best_to_stay_monotone():
    scores = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # each row's best: 2 then 0, not monotone
    choice, total = monotone_choice(scores)
    assert choice in ([0, 0], [2, 2]) and total == 1.0
    assert monotone_choice(np.array([[0.2, np.nan], [0.1, 0.9]]))[0] == [0, 1]


# --------------------------------------------------------------------------- token positions


def test_token_positions_leave_out_specials_and_keep_evenly_spaced_ones():
    from mta.inspection.items import token_positions

    ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11, 1, 2], [0, 5, 6, 1, 2, 2, 2, 2, 2, 2]])
    mask = torch.tensor([[1] * 9 + [0], [1] * 4 + [0] * 6])
    chosen = token_positions(ids, mask, special_ids=[0, 1], per_row=3)
    eligible = [[1, 2, 3, 4, 5, 6, 7], [1, 2]]  # real, not 0 or 1
    expected = torch.zeros_like(chosen)
    for row, positions in enumerate(eligible):
        keep = positions if len(positions) <= 3 else [positions[int(np.ceil(k * len(positions) / 3))] for k in range(3)]
        expected[row, keep] = True
    assert chosen.tolist() == expected.tolist()
    assert chosen[0].sum() == 3

    # the first position is left out even when it is no special token (the attention sink)
    plain = torch.tensor([[7, 5, 6, 8]])
    assert token_positions(plain, torch.ones(1, 4), [], per_row=10).tolist() == [[False, True, True, True]]
    kept = token_positions(plain, torch.ones(1, 4), [], per_row=10, skip_first=False)
    assert kept.tolist() == [[True, True, True, True]]


def test_spans_covering_the_first_position_are_left_out_on_either_side():
    from mta.inspection.items import off_sink
    from mta.losses.span_masks import SpanBatch

    spans = SpanBatch(
        student_start=torch.tensor([[0, 1, 2, 0]]),
        student_end=torch.tensor([[1, 2, 3, 0]]),
        teacher_start=torch.tensor([[0, 0, 3, 0]]),  # span 1 starts the teacher's sequence only
        teacher_end=torch.tensor([[2, 3, 4, 0]]),
        mask=torch.tensor([[True, True, True, False]]),
    )
    assert off_sink(spans, True).tolist() == [[False, False, True, False]]
    assert off_sink(spans, False).tolist() == [[True, True, True, False]]


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def second_student(tiny_tokenizer_dir, tmp_path_factory):
    from mta.models.tiny import build_tiny_model

    return build_tiny_model(tiny_tokenizer_dir, tmp_path_factory.mktemp("student-b"), seed=7)


def test_mta_inspect_end_to_end_on_tiny_models(
    monkeypatch, capsys, tmp_path, teacher_dir, tiny_model_dir, second_student, same_data
):
    out = tmp_path / "inspect"
    code, lines = run_mta(
        monkeypatch, capsys, "inspect", teacher_dir, tiny_model_dir, second_student, "--data", same_data,
        "--rows", 8, "--batch-size", 4, "--tokens-per-row", 1000,
        "--layers", "1:2:word,2:3:phrase,4:4:phrase", "--names", "a,b", "-o", out,
    )  # fmt: skip
    assert code == 0, lines
    results = json.loads((out / "results.json").read_text())
    assert results["granularities"] == ["token", "word", "phrase"]
    assert results["rows"]["ids"] == list(range(8)) and results["rows"]["fit"] == 4
    assert results["teacher"]["layers"] == [0, 1, 2, 3, 4] and results["teacher"]["fingerprint"].startswith("sha256:")
    assert [s["label"] for s in results["students"]] == ["a", "b"]
    for student in results["students"]:
        for granularity in results["granularities"]:
            for estimator in ("biased", "debiased"):
                matrix = np.array(student["cka"][granularity][estimator], dtype=float)
                assert matrix.shape == (5, 5) and np.isfinite(matrix).all()
        assert [p["granularity"] for p in student["aligned"]] == ["word", "phrase", "phrase"]
        assert student["layer_map"]["recipe"] == [[1, 2, "word"], [2, 3, "phrase"], [4, 4, "phrase"]]
        suggested = [t for _, t, _ in student["layer_map"]["suggested"]]
        assert suggested == sorted(suggested)
        assert student["layer_map"]["suggested_total"] >= student["layer_map"]["recipe_total"] - 1e-12
        for pair in student["aligned"]:
            assert -1 <= pair["structure_agreement"] <= 1 and pair["relative_residual"] > 0 and pair["hra"] > 0
    for name in ("results.md", "cka-token.png", "cka-word.png", "cka-phrase.png"):
        assert (out / name).stat().st_size > 0
    assert any("1 → 2 word" in line for line in lines) and any("- [1, " in line for line in lines)

    # the token CKA of one pair, again from the models by hand (special tokens and the first
    # position left out, every other kept: --tokens-per-row is above every row's length)
    from transformers import AutoModelForCausalLM

    from mta.data.annotations import read_annotations
    from mta.models.tokenizers import load_tokenizer

    table = read_annotations(same_data).table.slice(0, 8)
    specials = set(load_tokenizer(teacher_dir).all_special_ids)
    states = {}
    for name, path in (("teacher", teacher_dir), ("student", tiny_model_dir)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        rows = []
        for ids in table.column("student_input_ids").to_pylist():
            keep = [i for i, token in enumerate(ids) if token not in specials and i > 0]  # nor the sink
            assert 0 < len(keep) < len(ids)  # an EOS at least is left out
            with torch.no_grad():
                hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            rows.append(
                hidden[3][0, keep].double().numpy() if name == "student" else hidden[1][0, keep].double().numpy()
            )
        states[name] = np.concatenate(rows)
    got = results["students"][0]["cka"]["token"]["biased"][3][1]
    assert got == pytest.approx(numpy_cka(states["student"], states["teacher"], "biased"), abs=1e-5)


def test_a_model_against_itself_is_one_on_the_diagonal(monkeypatch, capsys, tmp_path, teacher_dir, same_data):
    out = tmp_path / "self"
    code, lines = run_mta(
        monkeypatch, capsys, "inspect", teacher_dir, teacher_dir, "--data", same_data,
        "--rows", 8, "--batch-size", 8, "-o", out,
    )  # fmt: skip
    assert code == 0, lines
    student = json.loads((out / "results.json").read_text())["students"][0]
    for granularity in ("token", "word", "phrase"):
        matrix = np.array(student["cka"][granularity]["debiased"], dtype=float)
        np.testing.assert_allclose(np.diag(matrix), 1.0, atol=1e-6)
        np.testing.assert_allclose(matrix, matrix.T, atol=1e-6)
    for pair in student["aligned"]:  # auto map: s -> s; the same states on both sides
        assert pair["structure_agreement"] == pytest.approx(1.0, abs=1e-6) and pair["dsa"] == pytest.approx(0, abs=1e-9)
    assert [t for s, t, _ in student["layer_map"]["suggested"]] == [s for s, _, _ in student["layer_map"]["suggested"]]


def test_a_killed_run_leaves_the_last_results_json_and_no_partial_one(tmp_path, teacher_dir, tiny_model_dir, same_data):
    import mta.inspection.report as report
    from mta.inspection import inspect

    out = tmp_path / "out"
    inspect(str(teacher_dir), [str(tiny_model_dir)], same_data, out=out, rows=4, batch_size=2)
    before = files_of(out)

    class Killed:
        def __init__(self):
            self.rows = 0

        def message(self, text):
            pass

        def start(self, *args, **kwargs):
            pass

        def advance(self, amount=1, **counters):
            self.rows += amount
            if self.rows >= 2:
                raise KeyboardInterrupt

        def record(self, record):
            pass

        def stop(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        inspect(str(teacher_dir), [str(tiny_model_dir)], same_data, out=out, rows=6, batch_size=2, reporter=Killed())
    assert files_of(out) == before

    # killed as results.json's bytes are complete beside it but not yet renamed onto it (a kill
    # at any earlier point leaves less): the old results.json stays whole, a first run leaves none
    import mta.files

    real_publish = mta.files.publish

    def killed_at_results(temporary, path):
        if Path(path).name == "results.json":
            assert json.loads(Path(temporary).read_text())  # what was written is whole, only not yet published
            raise KeyboardInterrupt
        real_publish(temporary, path)

    results = json.loads((out / "results.json").read_text())
    results["rows"]["count"] = 99  # would differ, were it published
    fresh = tmp_path / "fresh"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mta.files, "publish", killed_at_results)
        for directory in (out, fresh):
            with pytest.raises(KeyboardInterrupt):
                report.write_inspection(results, directory)
    assert (out / "results.json").read_bytes() == before["results.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no temporary left either
    assert (fresh / "results.md").exists() and not (fresh / "results.json").exists()


def test_training_rows_and_other_tokenizers_are_refused(
    monkeypatch, capsys, tmp_path, teacher_dir, tiny_model_dir, same_data, other_tokenizer_dir
):
    from fixtures.distill import write_recipe
    from mta.models.tiny import build_tiny_model

    trained = tmp_path / "run" / "final"
    shutil.copytree(tiny_model_dir, trained)
    write_recipe(
        trained / "recipe.yaml", teacher=teacher_dir, student=tiny_model_dir, annotations=same_data,
        output_dir=tmp_path / "run", loss={"layers": [[2, 1, "word"], [4, 3, "phrase"]]},
    )  # fmt: skip
    args = ("inspect", teacher_dir, trained, "--data", same_data, "--rows", 4, "-o", tmp_path / "x")
    code, lines = run_mta(monkeypatch, capsys, *args)
    assert code == 2 and "--allow-training-rows" in lines[-1] and "data.train" in lines[-1]
    assert not (tmp_path / "x").exists()
    code, lines = run_mta(monkeypatch, capsys, *args, "--allow-training-rows")
    assert code == 0, lines
    results = json.loads((tmp_path / "x" / "results.json").read_text())
    assert results["students"][0]["layer_map"]["recipe"] == [[2, 1, "word"], [4, 3, "phrase"]]  # its recipe.yaml's map
    assert "training rows" in results["rows"]["held_out"]

    other = build_tiny_model(other_tokenizer_dir, tmp_path / "other")
    code, lines = run_mta(monkeypatch, capsys, "inspect", teacher_dir, other, "--data", same_data, "-o", tmp_path / "y")
    assert code == 2 and "not the student tokenizer" in lines[-1] and "mta annotate" in lines[-1]


def test_the_teacher_side_from_a_teacher_cache_equals_the_teacher_at_its_layers(
    tmp_path, tiny_run_recipe, teacher_dir, tiny_model_dir, same_data
):
    from mta.inspection import inspect
    from mta.training.config.loading import load_recipe
    from mta.training.teacher_cache.teacher import run_teacher_stage

    recipe = load_recipe(tiny_run_recipe(tmp_path / "run", teacher_cache={"storage": "fp32", "states": "storage"}))
    run_teacher_stage(recipe, out_dir=tmp_path / "cache", batch_size=6)
    layers = [(2, 2, "word"), (3, 3, "phrase"), (4, 4, "phrase")]  # the recipe's auto map: what the cache holds
    common = {"rows": 6, "batch_size": 3, "layers": layers}
    online = inspect(str(teacher_dir), [str(tiny_model_dir)], same_data, **common)
    cached = inspect(None, [str(tiny_model_dir)], same_data, teacher_cache=str(tmp_path / "cache" / "dev"), **common)
    assert cached["teacher"]["layers"] == [2, 3, 4] and cached["teacher"]["teacher_cache"].endswith("dev")
    for granularity in ("token", "word", "phrase"):
        full = np.array(online["students"][0]["cka"][granularity]["debiased"], dtype=float)
        part = np.array(cached["students"][0]["cka"][granularity]["debiased"], dtype=float)
        np.testing.assert_allclose(part, full[:, 2:], atol=1e-6)  # teacher layers 2, 3, 4 only
    for got, expected in zip(cached["students"][0]["aligned"], online["students"][0]["aligned"], strict=True):
        for key in ("cka", "structure_agreement", "dsa", "hra", "relative_residual"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    with pytest.raises(MtaError, match="does not hold"):
        inspect(
            None,
            [str(tiny_model_dir)],
            same_data,
            teacher_cache=str(tmp_path / "cache" / "dev"),
            rows=4,
            layers=[(1, 1, "word")],
        )
