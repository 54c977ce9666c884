"""Base losses against loop-based references over tokens and vocabulary entries (docs/method.md §5)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from fixtures.losses import ALPHA, BETA, ref_token_loss
from mta.errors import MtaError
from mta.losses import BASE_LOSSES, build_base_loss
from mta.losses.kd import UNIT_LOSSES

# The per-token losses; distillm2 (pairs, per-sequence means) is tested in test_losses_contrastive.
TOKEN_LOSSES = sorted(set(BASE_LOSSES) - {"distillm2"})


def ref_batch_loss(name, student, teacher, labels, vocab_size, tau=1.0) -> float:
    """Sum over the vocabulary per token, mean over every response token of the batch."""
    values = []
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            label = int(labels[b, t])
            if label == -100:
                continue
            s_row = [float(x) for x in student[b, t, :vocab_size]]
            t_row = [float(x) for x in teacher[b, t, :vocab_size]]
            values.append(ref_token_loss(name, s_row, t_row, label, tau))
    return sum(values) / len(values)


def random_batch(seed: int, vocab: int = 13, padded_vocab: int = 0, scale: float = 2.0):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(3, 6, vocab + padded_vocab, generator=generator) * scale
    teacher = torch.randn(3, 6, vocab + padded_vocab + 2, generator=generator) * scale
    labels = torch.randint(0, vocab, (3, 6), generator=generator)
    labels[0, :4] = -100  # prompt
    labels[1, :] = -100  # a sequence with no response token
    labels[2, 5] = -100  # padding
    return student, teacher, labels


@pytest.mark.parametrize("name", TOKEN_LOSSES)
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_base_loss_matches_loop_reference_on_the_real_vocabulary(name, tau):
    vocab = 13
    student, teacher, labels = random_batch(0, vocab, padded_vocab=3)
    # Padded embedding rows hold garbage that must never count.
    student[..., vocab:] = 50.0
    teacher[..., vocab:] = -50.0
    loss_fn = build_base_loss(name, temperature=tau, vocab_size=vocab, chunk_size=4)
    student.requires_grad_()
    got = loss_fn(student, teacher, labels)
    tau_used = 1.0 if name == "ce" else tau
    expected = ref_batch_loss(name, student.detach(), teacher, labels, vocab, tau_used)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    got.backward()
    assert torch.all(student.grad[..., vocab:] == 0)
    assert torch.all(student.grad[labels == -100] == 0)
    assert student.grad[labels != -100].abs().sum() > 0


@pytest.mark.parametrize("name", TOKEN_LOSSES)
def test_chunked_equals_unchunked_in_value_and_gradient(name):
    student, teacher, labels = random_batch(1)
    results = []
    for chunk_size in (1, 5, 1000):
        leaf = student.clone().requires_grad_()
        teacher_leaf = teacher.clone().requires_grad_()
        loss = build_base_loss(name, chunk_size=chunk_size)(leaf, teacher_leaf, labels)
        (3.0 * loss).backward()
        assert teacher_leaf.grad is None  # the teacher is a constant of the loss
        results.append((loss.detach(), leaf.grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(grad, results[0][1])


@pytest.mark.parametrize("name", sorted(set(TOKEN_LOSSES) - {"ce"}))
def test_gradient_matches_plain_autograd(name):
    """The chunked loss stores its gradient in the forward pass; it must equal autograd's."""
    student, teacher, labels = random_batch(2)
    vocab = 13
    leaf = student.clone().requires_grad_()
    build_base_loss(name, chunk_size=3, vocab_size=vocab)(leaf, teacher, labels).backward()

    reference = student.double().clone().requires_grad_()
    keep = labels != -100
    log_q = F.log_softmax(reference[keep][:, :vocab], -1)
    log_p = F.log_softmax(teacher.double()[keep][:, :vocab], -1)
    p, q = log_p.exp(), log_q.exp()
    per_token = {
        "fkl": (p * (log_p - log_q)).sum(-1),
        "rkl": (q * (log_q - log_p)).sum(-1),
        "skl": (p * (log_p - (ALPHA * p + (1 - ALPHA) * q).log())).sum(-1),
        "srkl": (q * (log_q - (ALPHA * q + (1 - ALPHA) * p).log())).sum(-1),
        "jsd": BETA * (p * (log_p - (BETA * p + (1 - BETA) * q).log())).sum(-1)
        + (1 - BETA) * (q * (log_q - (BETA * p + (1 - BETA) * q).log())).sum(-1),
        "tvd": 0.5 * (p - q).abs().sum(-1),
    }[name]
    per_token.mean().backward()
    torch.testing.assert_close(leaf.grad.double(), reference.grad, atol=1e-6, rtol=1e-4)


def test_forward_kl_scale_matches_torch_kl_div():
    student, teacher, labels = random_batch(3)
    keep = labels != -100
    log_q = F.log_softmax(student[keep][:, :13], -1)
    log_p = F.log_softmax(teacher[keep][:, :13], -1)
    # kl_div(input=log q, target=log p) = p (log p − log q); sum over vocabulary, mean over tokens.
    expected = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).mean()
    got = build_base_loss("fkl", vocab_size=13)(student, teacher, labels)
    torch.testing.assert_close(got, expected)
    # The same number as "batchmean" over the response tokens: not divided by the vocabulary.
    torch.testing.assert_close(got, F.kl_div(log_q, log_p, log_target=True, reduction="batchmean"))


@pytest.mark.parametrize("name", sorted(set(TOKEN_LOSSES) - {"ce"}))
def test_identical_distributions_give_zero(name):
    student, _, labels = random_batch(4)
    # Shifting every logit by a constant leaves the distribution unchanged.
    loss = build_base_loss(name)(student, student[..., :13] + 5.0, labels)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def test_ce_equals_the_causal_lm_loss_of_a_tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = -100  # prompt tokens
    labels[1, 10:] = -100  # padding
    output = model(input_ids=input_ids, labels=labels)
    ours = build_base_loss("ce", chunk_size=7)(output.logits[:, :-1], None, labels[:, 1:])
    torch.testing.assert_close(ours, output.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", TOKEN_LOSSES)
@pytest.mark.parametrize("scale", [3.0, 3e4])
def test_low_precision_logits_give_the_fp32_loss_of_the_same_values(name, dtype, scale):
    """Logits in fp16/bf16 give the loss and gradient of the fp32 copy of the very same values.

    The logits are drawn, rounded to ``dtype`` once, and the fp32 reference is computed from
    ``.float()`` of those rounded values (an exact widening), so the comparison isolates the
    loss computation from the rounding of the logits themselves. At 3e4 (near the fp16 maximum)
    a softmax computed in fp16 would overflow.
    """
    generator = torch.Generator().manual_seed(6)
    vocab = 50
    student = (torch.randn(2, 4, vocab, generator=generator) * scale).clamp(-6e4, 6e4).to(dtype)
    teacher = (torch.randn(2, 4, vocab, generator=generator) * scale).clamp(-6e4, 6e4).to(dtype)
    labels = torch.randint(0, vocab, (2, 4), generator=generator)
    labels[1, 2:] = -100
    low = student.clone().requires_grad_()
    loss = build_base_loss(name, chunk_size=3)(low, teacher, labels)
    loss.backward()
    wide = student.float().requires_grad_()
    reference = build_base_loss(name, chunk_size=3)(wide, teacher.float(), labels)
    reference.backward()

    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    # The loss is documented as fp32 maths on the widened values: the same fp32 numbers go
    # through the same fp32 operations, so only operation order could differ (a few fp32 ulps,
    # ~1e-7 relative). 1e-6 is far below any fp16/bf16 rounding (1e-3 / 8e-3 relative), so a
    # path that computed the softmax or the sums in the logits' dtype would fail here.
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6, abs=1e-9)
    if scale == 3.0:
        # And it is the loop reference (python floats) of the rounded values.
        expected = ref_batch_loss(name, student.float(), teacher.float(), labels, vocab)
        assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)

    # The gradient is stored in the logits' dtype: the fp32 gradient rounded to it once per
    # token and once more when backward scales it by 1/tokens, so at most two roundings of
    # half an ulp each (rtol = 2·eps covers them). For fp16, values below its smallest normal
    # lose relative precision; atol = 2 · the subnormal spacing covers those.
    assert low.grad.dtype == dtype and torch.isfinite(low.grad.float()).all()
    info = torch.finfo(dtype)
    torch.testing.assert_close(low.grad.float(), wide.grad, rtol=2 * info.eps, atol=2 * info.smallest_normal * info.eps)


def test_no_response_token_gives_zero_and_bad_input_is_named():
    student, teacher, labels = random_batch(7)
    student.requires_grad_()
    loss = build_base_loss("srkl")(student, teacher, torch.full_like(labels, -100))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(student.grad == 0)
    with pytest.raises(MtaError, match="unknown base loss 'kl'"):
        build_base_loss("kl")
    with pytest.raises(MtaError, match="teacher_logits is None"):
        build_base_loss("fkl")(student, None, labels)
    with pytest.raises(MtaError, match="vocab_size 99 exceeds"):
        build_base_loss("fkl", vocab_size=99)(student, teacher, labels)


def test_backward_keeps_no_fp32_copy_of_the_logits():
    """What autograd keeps is one gradient in the logits' dtype, not fp32 softmax intermediates."""
    generator = torch.Generator().manual_seed(8)
    student = torch.randn(2, 16, 300, generator=generator).bfloat16().requires_grad_()
    teacher = torch.randn(2, 16, 300, generator=generator).bfloat16()
    labels = torch.randint(0, 300, (2, 16), generator=generator)
    saved: list[weakref.ref] = []

    def pack(tensor):
        saved.append(weakref.ref(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = build_base_loss("srkl", chunk_size=5)(student, teacher, labels)
    # Per-chunk fp32 graphs are freed inside the forward pass; what is still held waits for backward.
    held = [ref() for ref in saved if ref() is not None]
    assert held, "the saved-tensor hook saw nothing: the test would pass vacuously"
    assert not [t for t in held if t.is_floating_point() and t.dtype != torch.bfloat16]
    assert sum(t.numel() * t.element_size() for t in held) <= student.numel() * 2 + 1024
    loss.backward()
    assert torch.isfinite(student.grad.float()).all()


def _recipe_base_loss_names() -> list[str]:
    from typing import get_args

    from mta.training.config.schema import BaseLossName

    return sorted(get_args(BaseLossName))


def test_the_recipe_schema_names_exactly_the_built_losses():
    assert set(BASE_LOSSES) | set(UNIT_LOSSES) == set(_recipe_base_loss_names())


# uld and gold read aligned units (tests/test_losses_cross_vocabulary.py, tests/test_cross_vocabulary_training.py).
@pytest.mark.parametrize("name", sorted(set(_recipe_base_loss_names()) - set(UNIT_LOSSES)))
def test_every_recipe_base_loss_is_built_and_computes_through_the_objective(name):
    """A recipe's ``loss.base`` built as training builds it (LossSpec -> DistillationObjective)
    and run on a small batch: the documented number, and 0 where teacher equals student."""
    from mta.training.batching import TokenBatch, TrainBatch
    from mta.training.config.schema import LossSpec
    from mta.training.objective import DistillationObjective
    from mta.training.teacher import TeacherOutput

    vocab, tau = 13, 2.0
    spec = LossSpec(
        base=name,
        temperature=tau,
        skew_alpha=ALPHA,
        jsd_beta=BETA,
        base_weight=0.5,
        dsa_weight=0,
        hra_weight=0,
        chunk_size=4,
    )
    objective = DistillationObjective(
        spec, [], student_hidden_size=8, teacher_hidden_size=8, same_tokenizer=True, vocab_size=vocab
    )
    assert objective.trajectory is None and objective.needs_teacher_logits == (name != "ce")

    generator = torch.Generator().manual_seed(9)
    student = torch.randn(2, 7, vocab + 3, generator=generator) * 2  # 3 padded embedding rows
    teacher = torch.randn(2, 7, vocab + 3, generator=generator) * 2
    input_ids = torch.randint(0, vocab, (2, 7), generator=generator)
    labels = input_ids.clone()
    labels[:, :3] = -100  # prompt
    labels[1, 6] = -100  # padding
    chosen = torch.tensor([True, False]) if name == "distillm2" else None  # row 0 the teacher's response
    batch = TrainBatch(["a", "b"], TokenBatch(input_ids, torch.ones_like(input_ids), labels), None, {}, chosen)

    def run(student_logits, teacher_logits):
        leaf = student_logits.clone().requires_grad_()
        out = objective(leaf, None, TeacherOutput({}, teacher_logits), batch)
        out["total"].backward()
        return out, leaf.grad

    out, grad = run(student, None if name == "ce" else teacher)
    assert set(out) == {"base", "total"}
    assert out["base"].dim() == 0 and out["base"].dtype == torch.float32 and torch.isfinite(out["base"])
    # Position t predicts token t + 1 (the objective shifts); temperature does not apply to ce.
    if name == "distillm2":  # β = 1: row 0's mean skew KL + row 1's mean skew reverse KL
        expected = sum(
            ref_batch_loss(
                kind, student[row : row + 1, :-1], teacher[row : row + 1, :-1], labels[row : row + 1, 1:], vocab, tau
            )
            for row, kind in ((0, "skl"), (1, "srkl"))
        )
    else:
        expected = ref_batch_loss(
            name, student[:, :-1], teacher[:, :-1], labels[:, 1:], vocab, 1.0 if name == "ce" else tau
        )
    assert out["base"].item() == pytest.approx(expected, rel=1e-5)
    assert out["total"].item() == pytest.approx(0.5 * expected, rel=1e-5)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert torch.all(grad[..., vocab:] == 0) and torch.all(grad[:, -1] == 0)  # the last position predicts nothing

    if name != "ce":
        # Every divergence of docs/method.md §5 (fkl, rkl, skl, srkl, jsd, tvd) is 0 when both
        # distributions agree, for any skew α and JSD β; a teacher that only differs by a
        # constant shift per position is the same distribution. 0 is the minimum, so the smooth
        # ones also have a zero gradient there (tvd = ½Σ|p − q| has a kink at 0: no gradient).
        same, same_grad = run(student, student[..., :vocab] + torch.randn(2, 7, 1, generator=generator))
        assert same["base"].item() == pytest.approx(0.0, abs=1e-6)
        if name != "tvd":
            assert same_grad.abs().max().item() < 1e-6
        assert out["base"].item() > 1e-3  # and the different teacher above was not 0
