"""Which student layer is aligned with which teacher layer, and at which granularity.

Layers are counted as ``output_hidden_states`` indices: 0 is the embedding output and ``L`` the
last block of an ``L``-layer model, so valid indices run from 0 to ``L`` inclusive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

from mta.errors import MtaError
from mta.training.config.schema import LayerIndexPair, LayerPair

# Either kind of recipe layer pair: what ``_checked_pairs`` is given it returns.
Pair = TypeVar("Pair", LayerPair, LayerIndexPair)

__all__ = [
    "LayerIndexPair",
    "LayerPair",
    "auto_fdd_layers",
    "auto_layer_map",
    "resolve_fdd_layers",
    "resolve_layer_map",
    "resolve_sra_layers",
]


def auto_layer_map(student_layers: int, teacher_layers: int) -> list[LayerPair]:
    """docs/method.md §4 ``auto`` rule: one word-level pair below two phrase-level pairs.

    ``s = max(1, L_S // 4)``; the student layers are ``L_S - 2s`` (word), ``L_S - s`` and ``L_S``
    (phrase); each maps to teacher layer ``round(l_S * L_T / L_S)``, halves rounded up. A
    12-layer student of a 48-layer teacher gives 6→24 word, 9→36 and 12→48 phrase (the
    published GPT-2 map).
    """
    if student_layers < 1 or teacher_layers < 1:
        raise MtaError(
            f"the auto layer map needs models with at least one layer "
            f"(student {student_layers}, teacher {teacher_layers})"
        )
    step = max(1, student_layers // 4)
    picks = [
        (student_layers - 2 * step, "word"),
        (student_layers - step, "phrase"),
        (student_layers, "phrase"),
    ]
    # A 1-layer student gives -1, 0, 1: only the layers that exist are kept.
    return [
        LayerPair(
            student=student,
            teacher=_round_half_up(student * teacher_layers, student_layers),
            granularity=granularity,
        )
        for student, granularity in picks
        if student >= 0
    ]


def auto_fdd_layers(student_layers: int, teacher_layers: int) -> list[LayerIndexPair]:
    """FDD's ``auto`` pairs: student layers ``L_S/3``, ``L_S/2``, ``2·L_S/3`` (rounded half up;
    4, 6, 8 of 12, the published GPT-2 pairs), each with the teacher layer at the same depth
    (16, 24, 32 of 48). Repeats (a shallow student) are dropped, layer 0 never used."""
    if student_layers < 1 or teacher_layers < 1:
        raise MtaError(f"FDD needs models with at least one layer (student {student_layers}, teacher {teacher_layers})")
    pairs: list[LayerIndexPair] = []
    for numerator, denominator in ((1, 3), (1, 2), (2, 3)):
        student = max(1, _round_half_up(numerator * student_layers, denominator))
        pair = LayerIndexPair(student=student, teacher=_round_half_up(student * teacher_layers, student_layers))
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def resolve_fdd_layers(
    layers: Literal["auto"] | Sequence[LayerIndexPair], student_layers: int, teacher_layers: int
) -> list[LayerIndexPair]:
    """The recipe's ``loss.fdd_layers`` as concrete pairs, checked as ``resolve_layer_map`` checks."""
    if layers == "auto":
        return auto_fdd_layers(student_layers, teacher_layers)
    return _checked_pairs(layers, "loss.fdd_layers", student_layers, teacher_layers)


def resolve_sra_layers(
    layers: Literal["last"] | Sequence[LayerIndexPair], student_layers: int, teacher_layers: int
) -> list[LayerIndexPair]:
    """The recipe's ``loss.sra_layers``: ``last`` is each model's last layer (the public port's)."""
    if layers == "last":
        return [LayerIndexPair(student=student_layers, teacher=teacher_layers)]
    return _checked_pairs(layers, "loss.sra_layers", student_layers, teacher_layers, keyword="last")


def _round_half_up(numerator: int, denominator: int) -> int:
    # Exact integer arithmetic: Python's round() would send 4.5 to 4 (banker's rounding).
    return (2 * numerator + denominator) // (2 * denominator)


def resolve_layer_map(
    layers: Literal["auto"] | Sequence[LayerPair],
    student_layers: int,
    teacher_layers: int,
) -> list[LayerPair]:
    """The recipe's ``loss.layers`` as concrete pairs, checked against both models' depths.

    Raises ``MtaError`` naming ``loss.layers[i]``, the offending index and the valid range when a
    pair points past a model's last layer, and when the same pair is listed twice.
    """
    if layers == "auto":
        return auto_layer_map(student_layers, teacher_layers)
    return _checked_pairs(layers, "loss.layers", student_layers, teacher_layers)


def _checked_pairs(
    pairs: Sequence[Pair], key_name: str, student_layers: int, teacher_layers: int, keyword: str = "auto"
) -> list[Pair]:
    """``pairs`` after checking each against both depths and for repeats (``key_name[i]`` in errors;
    ``keyword``: the key's word for the default map, which the message offers as the fix)."""
    resolved: list[Pair] = []
    for index, pair in enumerate(pairs):
        key = f"{key_name}[{index}]"
        for side, layer, depth in (
            ("student", pair.student, student_layers),
            ("teacher", pair.teacher, teacher_layers),
        ):
            if not 0 <= layer <= depth:
                raise MtaError(
                    f"{key}: {side} layer {layer} does not exist; the {side} has {depth} "
                    f"layers, so hidden-state indices run from 0 (embeddings) to {depth}. "
                    f"Fix the pair or write `{key_name.rpartition('.')[2]}: {keyword}`."
                )
        if pair in resolved:
            raise MtaError(
                f"{key}: the pair [{', '.join(str(v) for v in pair.model_dump().values())}] is listed twice; remove one"
            )
        resolved.append(pair)
    return resolved
