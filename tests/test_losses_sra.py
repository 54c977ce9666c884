"""SRA's loss terms (mta.losses.sra) against plain loop references in float64.

The references loop over sequences, spans, tokens and pairs with scalar maths and share no code
with ``mta.losses``; the batches mix right padding, padding spans, spans out of scope, a span
whose student tokens all weigh 0 (plain-mean fallback), a sequence with no span in scope and
different student/teacher widths and lengths.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mta.errors import MtaError
from mta.losses.dsa import dynamic_structural_alignment
from mta.losses.span_masks import SpanBatch
from mta.losses.sra import (
    GEOMETRY_WEIGHT,
    LOGIT_WEIGHT,
    SpanRepresentationLoss,
    last_token_attention,
    shared_vocabulary,
    span_centres,
)

D_S, D_T, V_S, V_T = 5, 7, 11, 13

# ---------------------------------------------------------------- batches


def make_case(seed: int = 0, pairs: int = 2):
    g = torch.Generator().manual_seed(seed)
    s_len, t_len = 8, 10
    s_real, t_real = [8, 5, 6], [10, 7, 8]
    # (student range, teacher range, in scope) per sequence; sequence 2 has nothing in scope.
    spans = [
        [((0, 2), (0, 3), True), ((2, 3), (3, 4), True), ((3, 6), (4, 7), False), ((6, 8), (7, 10), True)],
        [((0, 1), (0, 2), True), ((1, 5), (2, 7), True)],
        [((0, 3), (0, 4), False)],
    ]
    batch, num = len(spans), 5  # the fifth (and more) are padding spans with garbage ranges
    tensors = [torch.full((batch, num), 3, dtype=torch.long) for _ in range(4)]
    mask = torch.zeros(batch, num, dtype=torch.bool)
    scope = torch.ones(batch, num, dtype=torch.bool)  # padding spans "in scope": the mask must win
    for b, row in enumerate(spans):
        for k, ((ss, se), (ts, te), live) in enumerate(row):
            tensors[0][b, k], tensors[1][b, k], tensors[2][b, k], tensors[3][b, k] = ss, se, ts, te
            mask[b, k] = True
            scope[b, k] = live
    span_batch = SpanBatch(*tensors, mask)

    s_weights = torch.rand(batch, s_len, generator=g) + 0.1
    t_weights = torch.rand(batch, t_len, generator=g) + 0.1
    for b in range(batch):
        s_weights[b, s_real[b] :] = 0
        t_weights[b, t_real[b] :] = 0
    s_weights[1, 1:5] = 0  # student span (1, 5) of sequence 1 weighs 0: plain mean
    student = [torch.randn(batch, s_len, D_S, generator=g, requires_grad=True) for _ in range(pairs)]
    teacher = [torch.randn(batch, t_len, D_T, generator=g) for _ in range(pairs)]
    return {
        "student": student,
        "teacher": teacher,
        "s_weights": s_weights,
        "t_weights": t_weights,
        "spans": span_batch,
        "scope": scope,
        "ranges": spans,
    }


def make_loss(pairs: int = 2, seed: int = 1, **kwargs) -> SpanRepresentationLoss:
    torch.manual_seed(seed)
    return SpanRepresentationLoss(pairs, D_S, D_T, **kwargs)


def make_heads(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    student_head = torch.nn.Linear(D_S, V_S)
    teacher_head = torch.nn.Linear(D_T, V_T)
    with torch.no_grad():
        for p in (*student_head.parameters(), *teacher_head.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    shared = (torch.tensor([0, 2, 3, 7, 10]), torch.tensor([12, 1, 5, 0, 9]))
    return student_head, teacher_head, shared


def at_ids(linear: torch.nn.Linear):
    """A full-vocabulary head read at some ids, as SRA calls its heads (``sra.Head``)."""
    return lambda hidden, ids: linear(hidden).index_select(-1, ids)


# ---------------------------------------------------------------- loop references (float64)


def ref_centre(hidden, weights, b, lo, hi):
    dim = hidden.shape[-1]
    mass = sum(float(weights[b, t]) for t in range(lo, hi))
    out = []
    for d in range(dim):
        if mass > 1e-8:
            out.append(sum(float(weights[b, t]) * hidden[b, t, d] for t in range(lo, hi)) / mass)
        elif hi > lo:
            out.append(sum(hidden[b, t, d] for t in range(lo, hi)) / (hi - lo))
        else:
            out.append(hidden.new_zeros(()))
    return torch.stack(out)


def ref_cos(a, b):
    dot = sum(a[i] * b[i] for i in range(len(a)))
    na = math.sqrt(sum(float(a[i].detach()) ** 2 for i in range(len(a))))
    nb = math.sqrt(sum(float(b[i].detach()) ** 2 for i in range(len(b))))
    if na == 0 or nb == 0:
        return a.new_zeros(())
    norm_a = sum(a[i] * a[i] for i in range(len(a))) ** 0.5
    norm_b = sum(b[i] * b[i] for i in range(len(b))) ** 0.5
    return dot / (norm_a * norm_b)


def ref_live_spans(case):
    """Per sequence: list of (student range, teacher range, teacher span weight) in scope."""
    out = []
    for b, row in enumerate(case["ranges"]):
        live = []
        for k, (s_range, t_range, _) in enumerate(row):
            if case["scope"][b, k]:
                weight = sum(float(case["t_weights"][b, t]) for t in range(*t_range))
                live.append((s_range, t_range, weight))
        out.append(live)
    return out


def ref_terms(case, student, teacher, projectors, heads=None, temperature=1.0):
    """(span, geometry, logit) with plain loops; student/teacher: float64 lists per pair."""
    live = ref_live_spans(case)
    sw, tw = case["s_weights"].double(), case["t_weights"].double()

    def centres(pair, b):
        s = [ref_centre(student[pair], sw, b, *sr) for sr, _, _ in live[b]]
        t = [ref_centre(teacher[pair], tw, b, *tr) for _, tr, _ in live[b]]
        return s, t

    span_pairs = []
    for pair, (weight, bias) in enumerate(projectors):
        per_seq = []
        for b in range(len(live)):
            total = sum(w for _, _, w in live[b])
            if not live[b] or total <= 0:
                continue
            s, t = centres(pair, b)
            acc = 0
            for k, (_, _, w) in enumerate(live[b]):
                projected = torch.stack(
                    [
                        sum(weight[o, i] * s[k][i] for i in range(s[k].shape[0])) + bias[o]
                        for o in range(weight.shape[0])
                    ]
                )
                acc = acc + (w / total) * (1 - ref_cos(projected, t[k]))
            per_seq.append(acc)
        span_pairs.append(sum(per_seq) / max(len(per_seq), 1))
    span = sum(span_pairs) / len(span_pairs)

    geo_seq = []
    for b in range(len(live)):
        n = len(live[b])
        total = sum(w for _, _, w in live[b])
        if n < 2 or total <= 0:
            continue
        s, t = centres(len(projectors) - 1, b)
        w = [x / total for _, _, x in live[b]]
        num, den = 0, 0
        for i in range(n):
            for j in range(n):
                if i != j:
                    gap = ref_cos(s[i], s[j]) - ref_cos(t[i], t[j])
                    num = num + w[i] * w[j] * gap * gap
                    den += w[i] * w[j]
        geo_seq.append(num / den)
    geometry = sum(geo_seq) / max(len(geo_seq), 1)

    logit = None
    if heads is not None:
        (sW, sb), (tW, tb), (s_ids, t_ids) = heads
        seqs = []
        for b in range(len(live)):
            total = sum(w for _, _, w in live[b])
            if not live[b] or total <= 0:
                continue
            s, t = centres(len(projectors) - 1, b)
            acc = 0
            for k, (_, _, w) in enumerate(live[b]):
                s_logit = [(sum(sW[v, i] * s[k][i] for i in range(D_S)) + sb[v]) / temperature for v in s_ids]
                t_logit = [(sum(tW[v, i] * t[k][i] for i in range(D_T)) + tb[v]) / temperature for v in t_ids]
                s_z = sum(torch.exp(x) for x in s_logit)
                t_z = sum(torch.exp(x) for x in t_logit)
                kl = 0
                for x, y in zip(t_logit, s_logit, strict=True):
                    p = torch.exp(x) / t_z
                    kl = kl + p * (torch.log(p) - torch.log(torch.exp(y) / s_z))
                acc = acc + (w / total) * kl
            seqs.append(acc)
        logit = sum(seqs) / max(len(seqs), 1)
    return span, geometry, logit


def double_leaves(case, loss):
    student = [s.detach().double().requires_grad_(True) for s in case["student"]]
    teacher = [t.detach().double() for t in case["teacher"]]
    projectors = [
        (p.weight.detach().double().requires_grad_(True), p.bias.detach().double().requires_grad_(True))
        for p in loss.projectors
    ]
    return student, teacher, projectors


def run(loss, case, **kwargs):
    return loss(
        case["student"],
        case["teacher"],
        case["s_weights"],
        case["t_weights"],
        case["spans"],
        case["scope"],
        **kwargs,
    )


def close(a, b, atol=2e-5):
    torch.testing.assert_close(
        a.double(),
        b.double().detach() if torch.is_tensor(b) else torch.tensor(b, dtype=torch.float64),
        atol=atol,
        rtol=1e-4,
    )


# ---------------------------------------------------------------- span_centres, weights


def test_span_centres_weighted_mean_fallback_and_padding():
    case = make_case()
    hidden = case["student"][0]
    mask = case["spans"].student_token_mask(hidden.shape[1])
    centres = span_centres(hidden, mask, case["s_weights"])
    assert centres.shape == (3, 5, D_S) and centres.dtype == torch.float32
    for b, row in enumerate(case["ranges"]):
        for k, (s_range, _, _) in enumerate(row):
            close(centres[b, k], ref_centre(hidden.double(), case["s_weights"].double(), b, *s_range))
        for k in range(len(row), 5):  # padding spans: exactly zero
            assert torch.equal(centres[b, k], torch.zeros(D_S))
    # the zero-weight span falls back to the plain mean of its tokens
    close(centres[1, 1], hidden[1, 1:5].mean(0))
    # the weights are a constant of the loss: no gradient flows into them
    weights = case["s_weights"].clone().requires_grad_(True)
    span_centres(hidden, mask, weights).sum().backward()
    assert weights.grad is None


def test_last_token_attention_reads_the_last_real_row():
    g = torch.Generator().manual_seed(3)
    attentions = torch.rand(3, 2, 6, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    weights = last_token_attention(attentions, mask)
    assert weights.shape == (3, 6) and not weights.requires_grad
    expected0 = attentions[0, :, 3].sum(0) * mask[0]  # row 3: the last real token, not padding row 5
    close(weights[0], expected0)
    assert not torch.allclose(weights[0], attentions[0, :, 5].sum(0) * mask[0])
    close(weights[1], attentions[1, :, 5].sum(0) * mask[1])  # left padding: the last row is real
    assert torch.equal(weights[2], torch.zeros(6))  # no real token: all zero


# ---------------------------------------------------------------- the three terms


def test_span_and_geometry_match_the_loop_reference_values_and_gradients():
    case = make_case()
    loss = make_loss()
    out = run(loss, case)
    student, teacher, projectors = double_leaves(case, loss)
    span, geometry, _ = ref_terms(case, student, teacher, projectors)
    close(out["sra_span"], span)
    close(out["sra_geometry"], geometry)
    assert out["sra_logit"].item() == 0.0
    close(out["sra"], span + GEOMETRY_WEIGHT * geometry, atol=1e-4)

    grads = torch.autograd.grad(
        out["sra_span"], [*case["student"], *(p.weight for p in loss.projectors)], retain_graph=True
    )
    ref = torch.autograd.grad(span, [*student, *(w for w, _ in projectors)], retain_graph=True)
    for got, want in zip(grads, ref, strict=True):
        close(got, want)
    geo_grads = torch.autograd.grad(out["sra_geometry"], case["student"], allow_unused=True)
    ref_geo = torch.autograd.grad(geometry, student, allow_unused=True)
    # geometry reads the last pair only
    assert geo_grads[0] is None or torch.count_nonzero(geo_grads[0]) == 0
    close(geo_grads[1], ref_geo[1])


@pytest.mark.parametrize("chunk_size", [128, 1, 3])
def test_span_logit_term_matches_the_loop_reference(chunk_size):
    """Whatever the chunk of span centres each head sees (issue 52: the [spans, shared vocabulary]
    logits a chunk at a time, recomputed in backward)."""
    case = make_case(seed=4, pairs=1)
    assert int(case["scope"].sum()) > 3  # several chunks of 1 and of 3
    loss = make_loss(pairs=1, temperature=2.0, logit_weight=0.5, chunk_size=chunk_size)
    student_head, teacher_head, shared = make_heads()
    out = run(loss, case, student_head=at_ids(student_head), teacher_head=at_ids(teacher_head), shared_vocab=shared)
    student, teacher, projectors = double_leaves(case, loss)
    sW = student_head.weight.detach().double().requires_grad_(True)
    heads = (
        (sW, student_head.bias.detach().double()),
        (teacher_head.weight.detach().double(), teacher_head.bias.detach().double()),
        (shared[0].tolist(), shared[1].tolist()),
    )
    span, geometry, logit = ref_terms(case, student, teacher, projectors, heads, temperature=2.0)
    close(out["sra_logit"], logit)
    assert out["sra_logit"].item() > 1e-3
    close(out["sra"], span + GEOMETRY_WEIGHT * geometry + 0.5 * logit, atol=1e-4)
    got = torch.autograd.grad(out["sra_logit"], [case["student"][0], student_head.weight], retain_graph=True)
    want = torch.autograd.grad(logit, [student[0], sW])
    for a, b in zip(got, want, strict=True):
        close(a, b)
    # the teacher's head gets no gradient
    out["sra_logit"].backward()
    assert teacher_head.weight.grad is None


def test_geometry_is_dsa_on_the_last_pair_centres():
    case = make_case(seed=5)
    loss = make_loss()
    out = run(loss, case)
    in_scope = case["spans"].mask & case["scope"]
    s_mask = SpanBatch(
        case["spans"].student_start,
        case["spans"].student_end,
        case["spans"].teacher_start,
        case["spans"].teacher_end,
        in_scope,
    )
    s_tok, t_tok = s_mask.student_token_mask(8), s_mask.teacher_token_mask(10)
    student = span_centres(case["student"][-1], s_tok, case["s_weights"])
    teacher = span_centres(case["teacher"][-1], t_tok, case["t_weights"])
    salience = (t_tok.float() * case["t_weights"].unsqueeze(1)).sum(-1)
    torch.testing.assert_close(out["sra_geometry"], dynamic_structural_alignment(student, teacher, salience, in_scope))


def test_padding_spans_and_out_of_scope_spans_contribute_nothing():
    case = make_case(seed=6)
    loss = make_loss()
    base = {k: v.detach() for k, v in run(loss, case).items()}
    # garbage in padding spans' ranges and in out-of-scope teacher states/weights changes nothing
    spans = case["spans"]
    spans.student_start[:, 4], spans.student_end[:, 4] = 0, 8
    spans.teacher_start[:, 4], spans.teacher_end[:, 4] = 0, 10
    case["teacher"] = [t.clone() for t in case["teacher"]]
    for t in case["teacher"]:
        t[2] = 1e3  # sequence 2 has no span in scope
    again = run(loss, case)
    for key, value in base.items():
        torch.testing.assert_close(again[key].detach(), value)


def test_a_single_span_has_zero_geometry():
    case = make_case(seed=7)
    case["scope"][:] = False
    case["scope"][0, 1] = True
    out = run(loss := make_loss(), case)
    assert out["sra_geometry"].item() == 0.0
    assert out["sra_span"].item() > 0.0
    student, teacher, projectors = double_leaves(case, loss)
    close(out["sra_span"], ref_terms(case, student, teacher, projectors)[0])


def test_nothing_in_scope_gives_zeros_with_zero_gradients():
    case = make_case(seed=8)
    case["scope"][:] = False
    loss = make_loss()
    student_head, teacher_head, shared = make_heads()
    out = run(loss, case, student_head=at_ids(student_head), teacher_head=at_ids(teacher_head), shared_vocab=shared)
    for key in ("sra_span", "sra_geometry", "sra_logit", "sra"):
        assert out[key].item() == 0.0, key
    out["sra"].backward()
    for tensor in (*case["student"], *(p.weight for p in loss.projectors), student_head.weight):
        assert tensor.grad is not None and torch.count_nonzero(tensor.grad) == 0
        assert torch.isfinite(tensor.grad).all()


def test_without_shared_vocab_the_logit_term_is_off():
    case = make_case(seed=9)
    loss = make_loss(logit_weight=3.0)

    def never(*_):
        raise AssertionError("a head was called with the logit term off")

    out = run(loss, case, student_head=never, teacher_head=never, shared_vocab=None)
    assert out["sra_logit"].item() == 0.0
    torch.testing.assert_close(out["sra"], out["sra_span"] + GEOMETRY_WEIGHT * out["sra_geometry"])


def test_the_logit_term_when_off_is_an_fp32_zero_whatever_the_default_dtype():
    case = make_case(seed=9)
    loss = make_loss(logit_weight=3.0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = run(loss, case, shared_vocab=None)
    finally:
        torch.set_default_dtype(previous)
    assert {name: term.dtype for name, term in out.items()} == dict.fromkeys(out, torch.float32)


def test_defaults_and_errors():
    loss = make_loss()
    assert (loss.geometry_weight, loss.logit_weight, loss.temperature) == (GEOMETRY_WEIGHT, LOGIT_WEIGHT, 1.0)
    assert GEOMETRY_WEIGHT == 50.0 and LOGIT_WEIGHT == 1.0
    assert [tuple(p.weight.shape) for p in loss.projectors] == [(D_T, D_S)] * 2
    case = make_case(pairs=1)
    with pytest.raises(MtaError, match="2 layer pairs"):
        run(loss, case)
    case = make_case()
    with pytest.raises(MtaError, match="head"):
        run(loss, case, shared_vocab=make_heads()[2])
    with pytest.raises(MtaError, match="non-empty"):
        head = at_ids(torch.nn.Linear(D_S, V_S))
        run(
            loss,
            case,
            student_head=head,
            teacher_head=head,
            shared_vocab=(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)),
        )
    with pytest.raises(MtaError):
        SpanRepresentationLoss(0, D_S, D_T)


# ---------------------------------------------------------------- shared vocabulary


def test_shared_vocabulary_normalises_space_markers_and_guards_specials():
    student = {"<s>": 0, "Ġthe": 1, "the": 2, "Ġcat": 3, "Ċ": 4, "<|endoftext|>": 5, "ĠĠ": 6, "dog": 7}
    teacher = {"▁the": 10, "<|endoftext|>": 3, "the": 4, "▁cat": 0, "<s>": 1, "\n": 2, "▁▁": 5, "Ġcat": 6}
    s_ids, t_ids = shared_vocabulary(
        student,
        teacher,
        student_special={"<s>", "<|endoftext|>"},
        teacher_special={"<|endoftext|>"},
    )
    assert s_ids.dtype == torch.long and t_ids.dtype == torch.long
    # "<s>" is special for the student only: unmatched. "Ġcat" matches the lowest teacher id
    # among "▁cat"/"Ġcat". "Ċ" is not normalised (the port normalises nothing).
    assert list(zip(s_ids.tolist(), t_ids.tolist(), strict=True)) == [(1, 10), (2, 4), (3, 0), (5, 3), (6, 5)]
    empty = shared_vocabulary({"a": 0}, {"b": 0})
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def test_shared_vocabulary_on_real_byte_level_tokenizers(gpt2_tokenizer_dir, tiny_tokenizer_dir):
    def vocab(path):
        data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        specials = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
        full = dict(data["model"]["vocab"])
        full.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        return full, specials

    gpt2, gpt2_special = vocab(gpt2_tokenizer_dir)
    tiny, tiny_special = vocab(tiny_tokenizer_dir)
    s_ids, t_ids = shared_vocabulary(tiny, gpt2, tiny_special, gpt2_special)
    by_id_tiny = {i: t for t, i in tiny.items()}
    by_id_gpt2 = {i: t for t, i in gpt2.items()}
    assert s_ids.tolist() == sorted(s_ids.tolist())
    assert all(by_id_tiny[s] == by_id_gpt2[t] for s, t in zip(s_ids.tolist(), t_ids.tolist(), strict=True))
    ordinary = (set(tiny) - tiny_special) & (set(gpt2) - gpt2_special)
    assert len(ordinary) > 200 and ordinary <= {by_id_tiny[s] for s in s_ids.tolist()}
    # the same GPT-2 vocabulary spelt SentencePiece-style, ids reversed: every token matches
    sp = {t.replace("Ġ", "▁"): len(gpt2) - 1 - i for t, i in gpt2.items()}
    s_ids, t_ids = shared_vocabulary(gpt2, sp, gpt2_special, gpt2_special)
    assert len(s_ids) == len(gpt2)
    assert torch.equal(t_ids, len(gpt2) - 1 - s_ids)
