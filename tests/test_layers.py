"""The docs/method.md §4 `auto` layer rule and the checks on explicit layer maps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mta.errors import MtaError
from mta.training.config.layers import LayerPair, auto_layer_map, resolve_layer_map
from mta.training.config.loading import load_recipe

REPO = Path(__file__).resolve().parents[1]


def triples(pairs: list[LayerPair]) -> list[tuple[int, int, str]]:
    return [(pair.student, pair.teacher, pair.granularity) for pair in pairs]


def reference_auto(student_layers: int, teacher_layers: int) -> list[tuple[int, int, str]]:
    """docs/method.md §4 written out in floating point, one pair at a time."""
    s = max(1, student_layers // 4)
    out = []
    for layer, granularity in (
        (student_layers - 2 * s, "word"),
        (student_layers - s, "phrase"),
        (student_layers, "phrase"),
    ):
        if layer >= 0:
            teacher = math.floor(layer * teacher_layers / student_layers + 0.5)
            out.append((layer, teacher, granularity))
    return out


@pytest.mark.parametrize(
    "student_layers, teacher_layers, expected",
    [
        (12, 48, [(6, 24, "word"), (9, 36, "phrase"), (12, 48, "phrase")]),  # GPT-2 DistiLLM
        (10, 30, [(6, 18, "word"), (8, 24, "phrase"), (10, 30, "phrase")]),  # the example of docs/method.md §4
        (24, 24, [(12, 12, "word"), (18, 18, "phrase"), (24, 24, "phrase")]),  # Qwen shapes
        (24, 32, [(12, 16, "word"), (18, 24, "phrase"), (24, 32, "phrase")]),  # OPT shapes
        (4, 30, [(2, 15, "word"), (3, 23, "phrase"), (4, 30, "phrase")]),  # 22.5 rounds up
        (12, 30, [(6, 15, "word"), (9, 23, "phrase"), (12, 30, "phrase")]),
        (12, 24, [(6, 12, "word"), (9, 18, "phrase"), (12, 24, "phrase")]),  # cross-tokenizer
    ],
)
def test_auto_rule_on_published_shapes(student_layers, teacher_layers, expected):
    assert triples(auto_layer_map(student_layers, teacher_layers)) == expected


def test_auto_rule_matches_the_formula_on_every_shape():
    for student_layers in range(1, 49):
        for teacher_layers in range(1, 81):
            pairs = triples(auto_layer_map(student_layers, teacher_layers))
            assert pairs == reference_auto(student_layers, teacher_layers)
            assert all(0 <= teacher <= teacher_layers for _, teacher, _ in pairs)
            assert pairs[-1] == (student_layers, teacher_layers, "phrase")


def test_one_layer_student_keeps_only_existing_layers():
    assert triples(auto_layer_map(1, 30)) == [(0, 0, "phrase"), (1, 30, "phrase")]


def test_auto_reproduces_the_published_gpt2_map_in_the_recipe():
    recipe = load_recipe(REPO / "recipes" / "gpt2.yaml")
    assert resolve_layer_map("auto", 12, 48) == recipe.loss.layers
    assert resolve_layer_map(recipe.loss.layers, 12, 48) == recipe.loss.layers


def test_explicit_map_keeps_its_order_and_accepts_both_ends():
    pairs = [
        LayerPair(student=12, teacher=48, granularity="phrase"),
        LayerPair(student=0, teacher=0, granularity="word"),
    ]
    assert resolve_layer_map(pairs, 12, 48) == pairs


@pytest.mark.parametrize(
    "pair, message",
    [
        ((13, 48, "phrase"), "loss.layers[1]: student layer 13 does not exist; the student has 12"),
        ((12, 49, "phrase"), "loss.layers[1]: teacher layer 49 does not exist; the teacher has 48"),
    ],
)
def test_out_of_range_layers_are_named(pair, message):
    pairs = [
        LayerPair(student=6, teacher=24, granularity="word"),
        LayerPair(student=pair[0], teacher=pair[1], granularity=pair[2]),
    ]
    with pytest.raises(MtaError) as caught:
        resolve_layer_map(pairs, 12, 48)
    assert message in str(caught.value)
    assert "run from 0 (embeddings)" in str(caught.value)


def test_qwen_map_does_not_fit_a_smaller_teacher():
    recipe = load_recipe(REPO / "recipes" / "qwen.yaml")
    with pytest.raises(MtaError, match=r"loss.layers\[5\]: teacher layer 24"):
        resolve_layer_map(recipe.loss.layers, 24, 22)


def test_duplicate_pairs_are_refused():
    pair = LayerPair(student=6, teacher=24, granularity="word")
    with pytest.raises(MtaError, match=r"loss.layers\[1\].*listed twice"):
        resolve_layer_map([pair, pair], 12, 48)


def test_auto_needs_layers():
    with pytest.raises(MtaError, match="at least one layer"):
        auto_layer_map(0, 12)


# --- FDD's pairs (loss.fdd_layers) -------------------------------------------------------------


def test_the_fdd_auto_pairs_are_the_published_gpt2_ones_and_follow_the_depths():
    from mta.training.config.layers import LayerIndexPair, auto_fdd_layers, resolve_fdd_layers

    assert [(p.student, p.teacher) for p in auto_fdd_layers(12, 48)] == [(4, 16), (6, 24), (8, 32)]
    assert [(p.student, p.teacher) for p in auto_fdd_layers(24, 32)] == [(8, 11), (12, 16), (16, 21)]
    assert [(p.student, p.teacher) for p in auto_fdd_layers(2, 4)] == [(1, 2)]  # repeats dropped
    assert resolve_fdd_layers([LayerIndexPair(student=2, teacher=3)], 4, 4) == [LayerIndexPair(student=2, teacher=3)]
    with pytest.raises(MtaError, match=r"loss\.fdd_layers\[1\]: teacher layer 9 does not exist.*`fdd_layers: auto`"):
        resolve_fdd_layers([LayerIndexPair(student=1, teacher=2), LayerIndexPair(student=2, teacher=9)], 4, 4)
    with pytest.raises(MtaError, match=r"loss\.fdd_layers\[1\]: the pair \[1, 2\] is listed twice"):
        resolve_fdd_layers([LayerIndexPair(student=1, teacher=2)] * 2, 4, 4)
