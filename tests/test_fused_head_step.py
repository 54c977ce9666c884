"""A training step's tensors on the fused path (issue 52): no tensor of more than ``chunk_size ×
head rows`` elements is created by either model's forward, the losses or the backward, besides
parameter-shaped ones (the heads' weights and their gradients), recorded by a ``TorchDispatchMode``
that sees every tensor an operator returns; the same check trips on the materialised path (whole
``[batch, seq, vocab]`` logits), and both paths compute the same losses and gradients."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM

from fixtures.batching import random_rows
from mta.data.artefact_schema import SCHEMA
from mta.training.batching import AnnotatedExamples
from mta.training.config.schema import LayerIndexPair, LossSpec
from mta.training.logit_lens import LogitLens
from mta.training.objective import DistillationModel, DistillationObjective
from mta.training.teacher import FrozenTeacher

VOCAB = 1500  # the tokenizer's; the heads are padded beyond it
CHUNK = 8


class LargestTensors(TorchDispatchMode):
    """Records the element count and shape of every tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[int, tuple[int, ...], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.created.append((value.numel(), tuple(value.shape), str(func)))
        return out

    def over(self, limit: int, allowed: set[tuple[int, ...]]) -> list[tuple[int, tuple[int, ...], str]]:
        return [entry for entry in self.created if entry[0] > limit and entry[1] not in allowed]


def tiny_llama(hidden: int, rows: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=rows,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float()


def batch_of(count: int):
    rows = random_rows(count, seed=7)
    for row in rows:
        row["student_input_ids"] = [(token * 7) % VOCAB for token in row["student_input_ids"]]
        row["teacher_input_ids"] = row["student_input_ids"]
        row["teacher_prompt_len"] = row["student_prompt_len"]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return AnnotatedExamples(table, student_pad_id=0, teacher_pad_id=0, granularities=()).batch(list(range(count)))


def step(fused: bool, base: str, fdd: bool):
    """One forward + backward of both models and the objective; the losses, the gradients and
    the recorder."""
    spec = LossSpec(
        base=base,
        temperature=2.0,
        dsa_weight=0,
        hra_weight=0,
        chunk_size=CHUNK,
        fused_head=fused,
        fdd_weight=1.0 if fdd else 0.0,
    )
    pairs = [LayerIndexPair(student=1, teacher=1), LayerIndexPair(student=2, teacher=2)] if fdd else []
    objective = DistillationObjective(
        spec,
        [],
        student_hidden_size=16,
        teacher_hidden_size=24,
        same_tokenizer=True,
        vocab_size=VOCAB,
        fdd_pairs=pairs,
    )
    student = tiny_llama(16, VOCAB + 4, seed=1)
    teacher_model = tiny_llama(24, VOCAB + 6, seed=2)
    model = DistillationModel(student, objective)
    lens = LogitLens(teacher_model, final_norm=False, num_layers=2) if fdd else None
    teacher = FrozenTeacher(teacher_model, objective.teacher_layers, objective.needs_teacher_logits, lens, fused=fused)
    batch = batch_of(6)
    # Parameter-shaped: a weight, its first VOCAB rows (what the losses read), their transposes, and
    # the gradients of these shapes.
    allowed = set()
    for parameter in (*student.parameters(), *teacher_model.parameters()):
        shape = tuple(parameter.shape)
        allowed |= {shape, shape[::-1], (VOCAB, *shape[1:]), (*shape[1:][::-1], VOCAB)}
    with LargestTensors() as recorder:
        out = teacher(batch.teacher.input_ids, batch.teacher.attention_mask)
        losses = model(batch, out)
        losses["total"].backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in losses.items()}, grads, recorder, allowed, batch


@pytest.mark.parametrize(("base", "fdd"), [("srkl", True), ("ce", False)])
def test_no_tensor_larger_than_a_chunk_of_logits_exists_in_a_fused_step_and_the_materialised_step_trips(base, fdd):
    fused_losses, fused_grads, recorder, allowed, batch = step(True, base, fdd)
    tokens = int((batch.student.labels[:, 1:] != -100).sum())
    assert tokens > 3 * CHUNK  # several chunks: the whole logits would be far over the limit
    limit = CHUNK * (VOCAB + 6)  # a chunk of the wider head's rows
    assert recorder.over(limit, allowed) == []

    plain_losses, plain_grads, plain_recorder, _, _ = step(False, base, fdd)
    tripped = plain_recorder.over(limit, allowed)
    assert tripped, "the materialised path's whole logits must trip the check"
    assert any(shape[-1] in (VOCAB + 4, VOCAB + 6) and len(shape) == 3 for _, shape, _ in tripped)

    # The same step, whichever path: losses and every student gradient.
    assert fused_losses.keys() == plain_losses.keys()
    for name in fused_losses:
        torch.testing.assert_close(fused_losses[name], plain_losses[name], rtol=1e-5, atol=1e-6)
    assert fused_grads.keys() == plain_grads.keys()
    for name in fused_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)
