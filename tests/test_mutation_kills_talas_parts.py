"""The TALAS wing's pooling modes and objective wiring that mutation testing (bench/mutation.py,
group talas) found unchecked by the fast tests.

Pooling: the ``max`` and ``last`` modes (either padding side), rows without a real token, sums
that bf16 cannot hold (mean) and scores that bf16 cannot tell apart (cls_attention), the
unknown-mode message, and every mode under another default device (meta, standing in for a
GPU). Objective: which layers are pooled, the refusals and their boundaries, the
temperature and reduction reaching the terms, the projections' default draw, and the model's
passes, frozen pooler and optimizer groups (with a stand-in student instead of a tiny BERT, so
no test here builds a model). Expected values come from python loops (tests/test_losses_talas.py's
references), hand-derived cases or the module docstrings, not from the code under test; the
default-device and default-mode checks compare the code with itself under another default (what
they pin is that the result does not depend on it) and each also asserts what the other default
must not change.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fixtures.talas_losses import ref_cls_attention, ref_lasd, ref_simcse, ref_tamd
from mta.embedding import export
from mta.embedding.objective import EmbeddingDistillationModel, EmbeddingObjective
from mta.embedding.pooling import pool
from mta.embedding.recipe import EmbeddingLossSpec
from mta.embedding.training_data import EmbeddingBatch
from mta.errors import MtaError
from mta.losses.talas import TeacherAnchor

B, T, D = 4, 6, 5  # T != D != B: a reduction over the wrong dimension changes the shape
RIGHT, LEFT = [6, 3, 1, 4], [0, 2, 5, 3]  # right padding: real tokens per row; left: pads per row


def _hidden(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _right_mask(lengths=RIGHT, length=T) -> torch.Tensor:
    return torch.tensor([[1] * n + [0] * (length - n) for n in lengths])


# ---------------------------------------------------------------- pooling modes


def test_max_pooling_takes_each_dimensions_largest_real_token_state():
    hidden = _hidden(0, B, T, D)
    hidden[1, :3] = -5.0 - hidden[1, :3].abs()  # a row whose real states are all negative
    mask = _right_mask()
    hidden[mask == 0] = 1e3  # padding larger than any real state: must not win
    rows = hidden.tolist()
    expected = [[max(rows[b][t][i] for t in range(n)) for i in range(D)] for b, n in enumerate(RIGHT)]
    pooled = pool(hidden, mask, "max")
    assert pooled.shape == (B, D)
    assert torch.equal(pooled, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("side", ["right", "left"])
def test_last_pooling_takes_the_last_real_tokens_state_with_either_padding_side(side):
    hidden = _hidden(1, B, T, D)
    if side == "right":
        mask, last = _right_mask(), [n - 1 for n in RIGHT]
    else:
        mask, last = torch.tensor([[0] * p + [1] * (T - p) for p in LEFT]), [T - 1] * B
    pooled = pool(hidden, mask, "last")
    assert torch.equal(pooled, torch.stack([hidden[b, last[b]] for b in range(B)]))


def test_a_row_without_real_tokens_pools_to_zeros_for_mean_and_to_its_first_position_for_cls_and_last():
    hidden = _hidden(2, 2, T, D)
    mask = torch.tensor([[0] * T, [1, 1, 0, 0, 0, 0]])
    assert torch.equal(pool(hidden, mask, "mean")[0], torch.zeros(D, dtype=torch.float64))
    assert torch.equal(pool(hidden, mask, "last")[0], hidden[0, 0])
    assert torch.equal(pool(hidden, mask, "cls")[0], hidden[0, 0])
    assert torch.equal(pool(hidden, mask, "last")[1], hidden[1, 1])


def test_mean_pooling_in_bf16_counts_and_sums_wider_than_bf16():
    """257 and 259 are not bf16 numbers (they round to 256 and 260): a sum or a count kept in
    bf16 would make the mean of ones 256/257 or 259/260, not 1. The third row, a 2 and 256 ones,
    sums to 258 (a bf16 number) over 257 tokens: 1.0039 rounds to 1 in bf16, where a sum and a
    count both kept in bf16 give 258/256, the next bf16 number up (1 + 2⁻⁷)."""
    hidden = torch.ones(3, 259, 3, dtype=torch.bfloat16)
    hidden[2, 0] = 2.0
    pooled = pool(hidden, _right_mask([257, 259, 257], 259), "mean")
    assert pooled.dtype == torch.bfloat16
    assert torch.equal(pooled, torch.ones(3, 3, dtype=torch.bfloat16))


def test_cls_attention_in_bf16_scores_in_float32():
    """D = 4: the scores h_0·h_t / 2 are 512 (CLS) and 514, which bf16 rounds to 512: scores in
    bf16 would weigh both tokens alike; in float32 the second gets e²/(1 + e²). The padded third
    state would dominate if it were not masked."""
    hidden = torch.tensor(
        [[[16.0, 16.0, 16.0, 16.0], [64.0, 0.25, 0.0, 0.0], [512.0, 512.0, 512.0, 512.0]]], dtype=torch.bfloat16
    )
    mask = torch.tensor([[1, 1, 0]])
    pooled = pool(hidden, mask, "cls_attention")
    assert pooled.dtype == torch.bfloat16
    expected = ref_cls_attention(hidden.double().tolist(), [2])
    second = math.exp(2.0) / (1.0 + math.exp(2.0))
    assert expected[0][:2] == pytest.approx([(1 - second) * 16 + second * 64, (1 - second) * 16 + second * 0.25])
    assert torch.allclose(pooled.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-2, atol=0)


def test_an_unknown_pooling_is_refused_with_the_modes_to_choose_from():
    with pytest.raises(
        MtaError, match=r"^pooling 'sum': choose one of mean, cls, max, last, cls_attention \(or auto\)$"
    ):
        pool(_hidden(3, B, T, D), _right_mask(), "sum")


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "last", "cls_attention"])
def test_every_pooling_makes_its_helper_tensors_on_the_inputs_device_not_the_default_one(mode):
    """Under another default device (meta, standing in for a GPU) the pooling of CPU tensors is
    unchanged: a position or row index made on the default device would not combine with them."""
    hidden, mask = _hidden(4, B, T, D), _right_mask()
    expected = pool(hidden, mask, mode)
    with torch.device("meta"):
        pooled = pool(hidden, mask, mode)
    assert pooled.device.type == "cpu" and torch.equal(pooled, expected)


# ---------------------------------------------------------------- the objective: layers and refusals


def _objective(num_layers=3, student_dim=D, teacher_dim=7, pooling="cls_attention", **loss) -> EmbeddingObjective:
    spec = EmbeddingLossSpec(**loss)
    return EmbeddingObjective(
        spec, num_layers=num_layers, student_dim=student_dim, teacher_dim=teacher_dim, pooling=pooling
    )


@pytest.mark.parametrize(
    "weights, tamd_layers, expected",
    [
        ((0.001, 0.75, 1.0), 2, [1, 2, 3, 4]),  # LASD: every layer 1..L
        ((0.001, 0.75, 0.0), 2, [3, 4]),  # TAMD's top K
        ((0.0, 0.75, 0.0), 1, [4]),  # TAMD's top K, K = 1
        ((0.001, 0.0, 0.0), 3, [4]),  # SimCSE alone: the last layer, whatever tamd_layers says
        ((0.001, 0.0, 1.0), 3, [1, 2, 3, 4]),
    ],
)
def test_only_the_layers_the_terms_read_are_pooled(weights, tamd_layers, expected):
    simcse, tamd, lasd = weights
    objective = _objective(
        num_layers=4, simcse_weight=simcse, tamd_weight=tamd, lasd_weight=lasd, tamd_layers=tamd_layers
    )
    assert list(objective.pooled_layers) == expected
    assert objective.needs_second_pass is bool(simcse)
    assert (objective.anchor is None) is (tamd == 0)


def test_tamd_may_anchor_every_layer_but_not_more():
    assert len(_objective(num_layers=3, tamd_layers=3).anchor.projections) == 3
    with pytest.raises(
        MtaError,
        match=r"^loss\.tamd_layers=4 anchors more layers than the student has \(3\); use at most 3$",
    ):
        _objective(num_layers=3, tamd_layers=4)
    assert _objective(num_layers=3, tamd_layers=4, tamd_weight=0.0).anchor is None  # TAMD off: no limit


def test_lasd_needs_two_layers():
    assert list(_objective(num_layers=2, tamd_layers=1).pooled_layers) == [1, 2]
    with pytest.raises(
        MtaError,
        match=r"^loss\.lasd_weight > 0 needs a student of at least 2 layers \(LASD pairs adjacent layers\); "
        r"set loss\.lasd_weight=0$",
    ):
        _objective(num_layers=1, tamd_layers=1)
    assert list(_objective(num_layers=1, tamd_layers=1, lasd_weight=0.0).pooled_layers) == [1]


def test_the_default_projections_are_drawn_for_the_anchored_layers_only():
    """Without loss.reference_code only the K projections used are drawn (TeacherAnchor's
    ``drawn_for=None``), so the same seed gives the weights of a K-projection anchor."""
    torch.manual_seed(3)
    objective = _objective(num_layers=4, student_dim=6, teacher_dim=5, tamd_layers=2)
    torch.manual_seed(3)
    alone = TeacherAnchor(2, 6, 5)
    for mine, drawn in zip(objective.anchor.projections, alone.projections, strict=True):
        assert torch.equal(mine.weight, drawn.weight)


# ---------------------------------------------------------------- the objective: the terms


def _pass(seed: int, num_layers: int) -> tuple[torch.Tensor, ...]:
    """``num_layers + 1`` states, each its own draw (index 0, the embeddings, is never read)."""
    return tuple(_hidden(seed + layer, B, T, D) for layer in range(num_layers + 1))


def _terms_by_loops(objective, states, second, mask, teacher, *, temperature, reduction):
    lengths = mask.sum(dim=1).tolist()
    pooled = [ref_cls_attention(states[layer].tolist(), lengths) for layer in range(1, len(states))]
    weights = [p.weight.detach().tolist() for p in objective.anchor.projections] if objective.anchor else []
    return {
        "simcse": ref_simcse(pooled[-1], ref_cls_attention(second.tolist(), lengths), temperature),
        "tamd": ref_tamd(pooled[-len(weights) :], weights, teacher.tolist()) if weights else None,
        "lasd": ref_lasd(pooled, reduction=reduction),
    }


def test_the_terms_use_the_recipes_temperature_and_reduction_on_layers_1_to_L():
    torch.manual_seed(4)
    objective = _objective(
        num_layers=3, simcse_temperature=0.05, lasd_reduction="sum", tamd_layers=2, simcse_weight=0.5
    ).double()
    states, second = _pass(10, 3), _hidden(20, B, T, D)
    mask, teacher = _right_mask(), _hidden(21, B, 7)
    losses = objective(states, mask, teacher, second)
    expected = _terms_by_loops(objective, states, second, mask, teacher, temperature=0.05, reduction="sum")
    assert set(losses) == {"simcse", "tamd", "lasd", "total"}
    for name in ("simcse", "tamd", "lasd"):
        assert losses[name].item() == pytest.approx(expected[name], rel=1e-9), name
    total = 0.5 * expected["simcse"] + 0.75 * expected["tamd"] + 1.0 * expected["lasd"]
    assert losses["total"].item() == pytest.approx(total, rel=1e-9)


def test_without_tamd_no_anchor_is_built_and_the_other_terms_still_add_up():
    objective = _objective(num_layers=3, tamd_weight=0.0, tamd_layers=2, simcse_weight=0.25).double()
    states, second = _pass(30, 3), _hidden(40, B, T, D)
    mask, teacher = _right_mask(), _hidden(41, B, 7)
    losses = objective(states, mask, teacher, second)
    expected = _terms_by_loops(objective, states, second, mask, teacher, temperature=0.1, reduction="mean")
    assert set(losses) == {"simcse", "lasd", "total"}
    assert losses["total"].item() == pytest.approx(0.25 * expected["simcse"] + expected["lasd"], rel=1e-9)


# ---------------------------------------------------------------- the model around the student


class StandInStudent(nn.Module):
    """What the model reads of a Hugging Face encoder: hidden states only when asked for
    (``output_hidden_states``), the last layer's always; each call recorded. Each pass adds its
    own offset (as dropout makes SimCSE's two passes differ)."""

    def __init__(self, num_layers: int = 3, hidden: int = D, pooler: bool = True):
        super().__init__()
        self.embed = nn.Embedding(50, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        if pooler:
            self.pooler = nn.Linear(hidden, hidden)
        self.config = SimpleNamespace(hidden_size=hidden)
        self.calls: list[dict] = []

    def forward(self, input_ids, attention_mask, output_hidden_states=None):
        self.calls.append({"input_ids": input_ids, "attention_mask": attention_mask, "hidden": output_hidden_states})
        states = [self.embed(input_ids) + len(self.calls)]
        for layer in self.layers:
            states.append(torch.tanh(layer(states[-1])))
        return SimpleNamespace(
            last_hidden_state=states[-1], hidden_states=tuple(states) if output_hidden_states else None
        )


def _batch(seed: int = 5) -> EmbeddingBatch:
    g = torch.Generator().manual_seed(seed)
    mask = _right_mask()
    return EmbeddingBatch(
        torch.randint(1, 50, (B, T), generator=g) * mask, mask, torch.randn(B, 7, generator=g), [0, 1, 2, 3]
    )


def test_the_model_pools_every_layer_of_one_pass_and_the_last_of_a_second_only_for_simcse():
    for simcse in (0.5, 0.0):
        torch.manual_seed(6)
        student = StandInStudent()
        model = EmbeddingDistillationModel(student, _objective(simcse_weight=simcse), max_seq_length=32)
        batch = _batch()
        losses = model(batch)
        assert [call["hidden"] for call in student.calls] == ([True, None] if simcse else [True])
        assert all(call["input_ids"] is batch.input_ids for call in student.calls)
        assert all(call["attention_mask"] is batch.attention_mask for call in student.calls)
        assert set(losses) == ({"simcse", "tamd", "lasd", "total"} if simcse else {"tamd", "lasd", "total"})


def test_the_students_pooler_is_frozen_and_everything_else_trains():
    model = EmbeddingDistillationModel(StandInStudent(), _objective(), max_seq_length=32)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"student.pooler.weight", "student.pooler.bias"}
    without = EmbeddingDistillationModel(StandInStudent(pooler=False), _objective(), max_seq_length=32)
    assert all(p.requires_grad for p in without.parameters())


def test_the_projector_group_is_the_tamd_projections_and_empty_without_tamd():
    model = EmbeddingDistillationModel(StandInStudent(), _objective(tamd_layers=2), max_seq_length=32)
    projectors = model.projector_parameters()
    assert [p.shape for p in projectors] == [(7, D), (7, D)]
    assert {id(p) for p in projectors} == {id(p) for p in model.objective.anchor.parameters()}
    assert model.student_gradient_clip == 0.0
    no_tamd = EmbeddingDistillationModel(StandInStudent(), _objective(tamd_weight=0.0), max_seq_length=32)
    assert no_tamd.projector_parameters() == []


def test_export_files_get_the_max_seq_length_the_model_was_built_with(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(export, "write_sentence_transformers_files", lambda *a, **k: calls.append(k))
    model = EmbeddingDistillationModel(StandInStudent(), _objective(pooling="cls"), max_seq_length=48)
    model.export_files(tmp_path)
    assert calls == [{"pooling": "cls", "hidden": D, "max_seq_length": 48}]
