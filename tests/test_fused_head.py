"""The fused head + loss (mta.losses.fused_head, issue 52): every base loss from hidden states and
heads, a chunk of response positions at a time, equals the plain materialised computation written
here (whole logits ``h Wᵀ + b``, the formula per token, the mean over response tokens) in value
and in the gradients with respect to the hidden states and the head's weight and bias: -100
labels, prompt positions, padding on both sides, a chunk size that does not divide the tokens,
tied and untied heads, padded heads (the common-prefix rule), the teacher's cached top k, bf16."""

from __future__ import annotations

import pytest
import torch

from mta.errors import MtaError
from mta.losses.fused_head import HeadTeacher, OutputHead, TopKTeacher, fused_head_loss
from mta.losses.kd import BASE_LOSSES, build_base_loss
from mta.losses.teacher_topk import LOG_FLOOR, top_k_log_probs

VOCAB = 37  # the tokenizer's vocabulary: both heads have more rows (padded)
STUDENT_ROWS, TEACHER_ROWS = 40, 39
D_S, D_T = 8, 6
BATCH, SEQ = 3, 11
CHUNK = 4  # 3 rows' response tokens: 19, not a multiple of 4
TAU = 2.0
ALPHA, BETA_JSD, BETA_D2 = 0.1, 0.5, 1.0


def layout():
    """labels ``[batch, seq]`` (aligned: position t predicts labels[:, t]): row 0 left-padded with
    a prompt, row 1 a prompt then a -100 hole inside the response, row 2 right-padded."""
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[0, :5] = -100  # padding (2) + prompt (3)
    labels[1, :3] = -100  # prompt
    labels[1, 6] = -100  # an ignored token inside the response
    labels[2, :2] = -100  # prompt
    labels[2, 8:] = -100  # padding
    chosen = torch.tensor([True, False, True])
    return labels, chosen


def parameters(tied: bool, bias: bool, dtype=torch.float32):
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(BATCH, SEQ, D_S, generator=generator)
    student_weight = (torch.randn(STUDENT_ROWS, D_S, generator=generator) * 0.7).to(dtype).requires_grad_(True)
    student_bias = (
        (torch.randn(STUDENT_ROWS, generator=generator) * 0.3).to(dtype).requires_grad_(True) if bias else None
    )
    mixer = torch.randn(D_S, D_S, generator=generator) * 0.5
    teacher_hidden = torch.randn(BATCH, SEQ, D_T, generator=generator).to(dtype)
    teacher_weight = (torch.randn(TEACHER_ROWS, D_T, generator=generator)).to(dtype)
    teacher_bias = (torch.randn(TEACHER_ROWS, generator=generator) * 0.3).to(dtype)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return inputs, mixer, ids, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias


def student_hidden(inputs, mixer, ids, weight, tied: bool):
    """The student's final hidden state: with a tied head it reads the head's weight as its input
    embedding, so the weight's gradient has both parts."""
    state = inputs + (weight[ids].float() if tied else 0.0)
    return torch.tanh(state @ mixer).to(weight.dtype)


# --------------------------------------------------------------------------- plain formulas


def plain_kl(p, q):
    return (p * (p.log() - q.log())).sum(-1)


def plain_token_loss(name, student_logits, teacher_logits, labels, chosen):
    """``[n]`` per-token losses from whole logits by the formulas (docs/method.md §5)."""
    if name == "ce":
        return -student_logits.log_softmax(-1).gather(1, labels.unsqueeze(1)).squeeze(1)
    q = (student_logits / TAU).softmax(-1)
    p = (teacher_logits / TAU).softmax(-1)
    if name == "fkl":
        return plain_kl(p, q)
    if name == "rkl":
        return plain_kl(q, p)
    if name == "skl":
        return plain_kl(p, ALPHA * p + (1 - ALPHA) * q)
    if name == "srkl":
        return plain_kl(q, ALPHA * q + (1 - ALPHA) * p)
    if name == "jsd":
        m = BETA_JSD * p + (1 - BETA_JSD) * q
        return BETA_JSD * plain_kl(p, m) + (1 - BETA_JSD) * plain_kl(q, m)
    if name == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    raise AssertionError(name)


def plain_loss(name, hidden, weight, bias, teacher_logits_full, labels, chosen):
    """The materialised computation: the whole ``[batch, seq, rows]`` logits, the first VOCAB columns."""
    logits = hidden.float() @ weight.float().t() + (0.0 if bias is None else bias.float())
    logits = logits[..., :VOCAB]
    teacher = teacher_logits_full[..., :VOCAB]
    mask = labels != -100
    if name != "distillm2":
        return plain_token_loss(name, logits[mask], teacher[mask], labels[mask], chosen).mean()
    # DistiLLM-2: per-row means of SKL (chosen) / SRKL with a constant q in its mixture (rejected).
    q = (logits / TAU).softmax(-1)
    p = (teacher / TAU).softmax(-1)
    skl = plain_kl(p, ALPHA * p + (1 - ALPHA) * q)
    srkl = plain_kl(q, ALPHA * q.detach() + (1 - ALPHA) * p)
    per_token = torch.where(chosen.unsqueeze(1), skl, srkl)
    row_mean = (per_token * mask).sum(1) / mask.sum(1)
    chosen_mean = row_mean[chosen].mean()
    rejected_mean = row_mean[~chosen].mean()
    return (2 - BETA_D2) * chosen_mean + BETA_D2 * rejected_mean


def fused(name, hidden, head, side, labels, chosen, chunk=CHUNK):
    loss = build_base_loss(name, temperature=TAU, vocab_size=VOCAB, chunk_size=chunk)
    extra = {"chosen": chosen} if name == "distillm2" else {}
    return loss.from_hidden(hidden, head, side, labels, **extra)


def grads(value, tensors):
    return torch.autograd.grad(value, [t for t in tensors if t is not None])


@pytest.mark.parametrize("name", list(BASE_LOSSES))
@pytest.mark.parametrize(("tied", "bias"), [(False, False), (True, False), (False, True)])
def test_every_base_loss_from_hidden_states_equals_the_materialised_loss(name, tied, bias):
    labels, chosen = layout()
    inputs, mixer, ids, weight, student_bias, teacher_hidden, teacher_weight, teacher_bias = parameters(tied, bias)
    teacher_full = teacher_hidden @ teacher_weight.t() + teacher_bias
    side = HeadTeacher(teacher_hidden, OutputHead(teacher_weight, teacher_bias))

    hidden = student_hidden(inputs, mixer, ids, weight, tied).detach().requires_grad_(True)
    reduced = fused(name, hidden, OutputHead(weight, student_bias), side, labels, chosen)
    assert reduced.tokens == int((labels != -100).sum())
    got = grads(reduced.mean, [hidden, weight, student_bias])

    plain_hidden = hidden.detach().clone().requires_grad_(True)
    expected_value = plain_loss(name, plain_hidden, weight, student_bias, teacher_full, labels, chosen)
    expected = grads(expected_value, [plain_hidden, weight, student_bias])

    torch.testing.assert_close(reduced.mean, expected_value, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The padded rows of the head get no gradient; prompt and padding positions none either.
    assert torch.count_nonzero(got[1][VOCAB:]) == 0
    assert torch.count_nonzero(got[0][labels == -100]) == 0

    if tied:  # through the embedding too: the whole graph's gradient of the tied weight
        weight.grad = None
        full_hidden = student_hidden(inputs, mixer, ids, weight, tied)
        fused(name, full_hidden, OutputHead(weight, None), side, labels, chosen).mean.backward()
        tied_fused = weight.grad.clone()
        weight.grad = None
        plain_loss(
            name, student_hidden(inputs, mixer, ids, weight, tied), weight, None, teacher_full, labels, chosen
        ).backward()
        torch.testing.assert_close(tied_fused, weight.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", [name for name in BASE_LOSSES if name != "ce"])
def test_the_cached_top_k_rebuilt_per_chunk_equals_the_dense_rebuilt_teacher(name):
    """The teacher-cache path: the top k at ``[batch, seq]`` positions (floors where nothing is
    stored), p̃ rebuilt a chunk at a time, against the loss on the whole rebuilt logits."""
    labels, chosen = layout()
    inputs, mixer, ids, weight, _, teacher_hidden, teacher_weight, teacher_bias = parameters(False, False)
    teacher_full = (teacher_hidden @ teacher_weight.t() + teacher_bias)[..., :VOCAB]
    k = 5
    top_ids, top_log_probs, tail = top_k_log_probs(teacher_full.reshape(-1, VOCAB), k, temperature=TAU)
    top_ids, top_log_probs, tail = (
        top_ids.view(BATCH, SEQ, k),
        top_log_probs.view(BATCH, SEQ, k),
        tail.view(BATCH, SEQ),
    )
    off = labels == -100  # what the cache stores nothing for
    top_ids[off], top_log_probs[off], tail[off] = 0, LOG_FLOOR, LOG_FLOOR
    side = TopKTeacher(top_ids, top_log_probs, tail, VOCAB, TAU)
    # p̃ by hand: the top k at their values, the rest of the mass evenly over the other tokens.
    dense_log_p = (tail - torch.log(torch.tensor(VOCAB - k, dtype=torch.float32))).unsqueeze(-1).expand(-1, -1, VOCAB)
    dense_log_p = dense_log_p.clone().scatter(2, top_ids, top_log_probs)

    hidden = student_hidden(inputs, mixer, ids, weight, False).detach().requires_grad_(True)
    reduced = fused(name, hidden, OutputHead(weight), side, labels, chosen)
    got = grads(reduced.mean, [hidden, weight])
    plain_hidden = hidden.detach().clone().requires_grad_(True)
    expected_value = plain_loss(name, plain_hidden, weight, None, dense_log_p * TAU, labels, chosen)
    expected = grads(expected_value, [plain_hidden, weight])
    torch.testing.assert_close(reduced.mean, expected_value, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, 128])
def test_the_sum_and_count_do_not_depend_on_the_chunk_size(chunk):
    """``LossSum``: the sum over response tokens and their count, whatever the chunking."""
    labels, chosen = layout()
    inputs, mixer, ids, weight, _, teacher_hidden, teacher_weight, teacher_bias = parameters(False, False)
    hidden = student_hidden(inputs, mixer, ids, weight, False)
    side = HeadTeacher(teacher_hidden, OutputHead(teacher_weight, teacher_bias))
    one = fused("srkl", hidden, OutputHead(weight), side, labels, chosen, chunk=chunk)
    reference = fused("srkl", hidden, OutputHead(weight), side, labels, chosen, chunk=3)
    assert one.tokens == reference.tokens == 19
    torch.testing.assert_close(one.total, reference.total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(one.mean, one.total / 19)


def test_bf16_heads_match_the_materialised_bf16_path():
    """bf16 weights and hidden states: the fused path against the materialised one in bf16 (the
    head's logits in bf16, the loss in fp32), to bf16's tolerance."""
    labels, chosen = layout()
    inputs, mixer, ids, weight, _, teacher_hidden, teacher_weight, teacher_bias = parameters(
        False, False, torch.bfloat16
    )
    hidden = student_hidden(inputs, mixer, ids, weight, False).detach().requires_grad_(True)
    side = HeadTeacher(teacher_hidden, OutputHead(teacher_weight, teacher_bias))
    reduced = fused("srkl", hidden, OutputHead(weight), side, labels, chosen)
    got = grads(reduced.mean, [hidden, weight])
    assert got[0].dtype == got[1].dtype == torch.bfloat16

    plain_hidden = hidden.detach().clone().requires_grad_(True)
    student_logits = plain_hidden @ weight.t()  # bf16, as the model's head gives them
    teacher_logits = teacher_hidden @ teacher_weight.t() + teacher_bias
    loss = build_base_loss("srkl", temperature=TAU, vocab_size=VOCAB, chunk_size=CHUNK)
    expected_value = loss(student_logits, teacher_logits, labels)
    expected = grads(expected_value, [plain_hidden, weight])
    torch.testing.assert_close(reduced.mean, expected_value, rtol=1e-3, atol=1e-4)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_a_frozen_head_and_no_grad_compute_no_head_gradient_and_no_token_gives_zero():
    labels, chosen = layout()
    inputs, mixer, ids, weight, _, teacher_hidden, teacher_weight, _ = parameters(False, False)
    frozen = weight.detach()  # a LoRA student's head: frozen
    hidden = student_hidden(inputs, mixer, ids, frozen, False).detach().requires_grad_(True)
    side = HeadTeacher(teacher_hidden, OutputHead(teacher_weight))
    reduced = fused("fkl", hidden, OutputHead(frozen), side, labels, chosen)
    (grad,) = torch.autograd.grad(reduced.mean, [hidden])
    assert grad.abs().sum() > 0
    with torch.no_grad():
        assert fused("fkl", hidden, OutputHead(weight), side, labels, chosen).mean.requires_grad is False
    none = torch.full_like(labels, -100)
    empty = fused("fkl", hidden, OutputHead(weight), side, none, chosen)
    assert empty.tokens == 0 and float(empty.mean.detach()) == 0.0
    (grad,) = torch.autograd.grad(empty.mean, [weight])
    assert torch.count_nonzero(grad) == 0


def test_a_vocabulary_wider_than_a_head_and_a_head_that_is_not_linear_are_refused():
    inputs, mixer, ids, weight, *_ = parameters(False, False)
    hidden = torch.randn(4, D_S)
    with pytest.raises(MtaError, match=r"vocab_size 41 exceeds the heads' rows \(40\)"):
        fused_head_loss(
            lambda s, t, y: s.sum(1), hidden, OutputHead(weight), None, torch.zeros(4), vocab_size=41, chunk_size=2
        )
    with pytest.raises(MtaError, match=r"do not fit the head's weight"):
        fused_head_loss(
            lambda s, t, y: s.sum(1),
            hidden[:, :3],
            OutputHead(weight),
            None,
            torch.zeros(4),
            vocab_size=8,
            chunk_size=2,
        )

    class Model(torch.nn.Module):
        config = None

        def get_output_embeddings(self):
            return torch.nn.Sequential(torch.nn.Linear(2, 3))

    with pytest.raises(MtaError, match=r"not a plain nn.Linear .*loss.fused_head=false"):
        OutputHead.of(Model())


# --------------------------------------------------------------------------- the Python API


@pytest.mark.parametrize("name", list(BASE_LOSSES))
def test_kdloss_from_hidden_states_equals_kdloss_on_the_heads_logits(name):
    """``mta.KDLoss.from_hidden`` (HF convention: unshifted hidden states and labels) against
    ``mta.KDLoss`` on ``head(hidden)``, with the teacher as hidden states + head or as logits."""
    import mta

    labels, chosen = layout()
    labels = torch.nn.functional.pad(labels, (1, 0), value=-100)  # unshifted: token t + 1 at t + 1
    inputs, mixer, ids, weight, _, teacher_hidden, teacher_weight, teacher_bias = parameters(False, False)
    hidden = torch.nn.functional.pad(student_hidden(inputs, mixer, ids, weight, False), (0, 0, 0, 1))
    hidden = hidden.detach().requires_grad_(True)
    teacher_hidden = torch.nn.functional.pad(teacher_hidden, (0, 0, 0, 1))
    head = torch.nn.Linear(D_S, STUDENT_ROWS, bias=False)
    head.weight = torch.nn.Parameter(weight.detach().clone())
    teacher_head = torch.nn.Linear(D_T, TEACHER_ROWS)
    teacher_head.weight, teacher_head.bias = torch.nn.Parameter(teacher_weight), torch.nn.Parameter(teacher_bias)
    pairs = {"chosen": chosen} if name == "distillm2" else {}
    kd = mta.KDLoss(name, temperature=TAU, vocab_size=VOCAB, chunk_size=CHUNK)

    plain_hidden = hidden.detach().clone().requires_grad_(True)
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_hidden)
    expected = kd(head(plain_hidden), teacher_logits, labels, **pairs)
    expected_grads = torch.autograd.grad(expected, [plain_hidden, head.weight])

    teachers = [{}] if name == "ce" else [dict(teacher_hidden=teacher_hidden, teacher_head=teacher_head)]
    teachers += [] if name == "ce" else [dict(teacher_logits=teacher_logits)]
    for teacher in teachers:
        got = kd.from_hidden(hidden, head, labels, **teacher, **pairs)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got, [hidden, head.weight]), expected_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if name != "distillm2":
        total = kd.from_hidden(hidden, head, labels, **teachers[0], reduction="sum")
        torch.testing.assert_close(total, expected * int((labels[:, 1:] != -100).sum()), rtol=1e-5, atol=1e-5)
    if name != "ce":
        with pytest.raises(MtaError, match="give teacher_hidden and teacher_head, or teacher_logits"):
            kd.from_hidden(hidden, head, labels, **pairs)


def test_mtaloss_with_heads_equals_mtaloss_on_logits():
    """``mta.MTALoss(..., student_head=, teacher_head=)`` on the models' bodies (no logits) equals
    ``mta.MTALoss`` on their whole outputs: every term and the student's gradients."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import mta

    def llama(hidden, rows, seed):
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=rows, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        return LlamaForCausalLM(config)

    student, teacher = llama(16, VOCAB + 3, 1), llama(24, VOCAB + 5, 2)
    labels, _ = layout()
    ids = torch.where(labels == -100, 1, labels)
    batch = mta.TrainBatch(
        [str(i) for i in range(BATCH)],
        mta.TokenBatch(ids, torch.ones_like(ids), torch.nn.functional.pad(labels[:, :-1], (1, 0), value=-100)),
        mta.TokenBatch(ids, torch.ones_like(ids), labels),
        {},
    )
    loss = mta.MTALoss([], student_hidden_size=16, teacher_hidden_size=24, vocab_size=VOCAB, same_tokenizer=True,
                       base="srkl", dsa_weight=0, hra_weight=0, chunk_size=CHUNK, temperature=TAU)  # fmt: skip
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    with torch.no_grad():
        teacher_whole, teacher_body = teacher(**kwargs), teacher.get_decoder()(**kwargs)
    expected = loss(student(**kwargs), teacher_whole, batch)
    expected["total"].backward()
    expected_grads = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    got = loss(student.get_decoder()(**kwargs), teacher_body, batch, student_head=student, teacher_head=teacher)
    got["total"].backward()
    assert got.keys() == expected.keys()
    torch.testing.assert_close(got["base"], expected["base"], rtol=1e-5, atol=1e-6)
    for name, parameter in student.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-4, atol=1e-6)
