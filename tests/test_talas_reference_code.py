"""TALAS (task: embedding) against a literal transcription of its author's code (docs/method.md §9).

The transcription (``tests/fixtures/talas_reference.py``) follows `phongdq25/TALAS-M` @b2ea437
line by line: his pooling, loss terms, projections, optimizer, SAM step and scheduler, and
`pytorch_optimizer.SAM`. It shares no code with mta. On this CPU it runs without his autocast;
the comparisons are in float64 (terms) and float32 (steps through DeepSpeed).

Each of mta's terms equals the author's in value and gradient on the same batch and weights
(tiny random BERT students, dropout on, the same RNG state for both). Where mta differs on
purpose, a batch where the difference is at work shows mta's default disagreeing and
``loss.reference_code: true`` agreeing.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from fixtures.talas_reference import (
    AuthorTrainer,
    author_build_optimizer,
    author_build_projection_layer,
    author_get_embedding,
    author_scheduler,
    author_step,
)
from fixtures.trainers import trainer_of
from mta.embedding.objective import EmbeddingDistillationModel, EmbeddingObjective
from mta.embedding.pooling import pool
from mta.embedding.recipe import EmbeddingLossSpec
from mta.embedding.training_data import EmbeddingBatch
from mta.losses.talas import TeacherAnchor
from mta.training.config.schema import AsamSpec, TrainSpec

pytestmark = pytest.mark.usefixtures("one_thread")

L, HIDDEN, HEADS, D_T, VOCAB = 3, 16, 2, 12, 60
LENGTHS = [9, 4, 7, 2, 6]  # real tokens per row ([CLS] first); right padding to 9


# ------------------------------------------------------------ shared set-up


def tiny_student(seed=0, dtype=torch.float64):
    """A random 3-layer BERT with dropout (what SimCSE's two passes need), in train mode."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
        max_position_embeddings=32,
        output_hidden_states=True,  # as the author's build_model
        attn_implementation="eager",
    )
    return BertModel(config).to(dtype).train()


def tiny_batch(seed=1, dtype=torch.float64, teacher_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    length = max(LENGTHS)
    mask = torch.tensor([[1] * n + [0] * (length - n) for n in LENGTHS])
    ids = torch.randint(5, VOCAB, (len(LENGTHS), length), generator=g) * mask
    ids[:, 0] = 2  # [CLS]
    teacher = teacher_scale * torch.randn(len(LENGTHS), D_T, generator=g, dtype=dtype)
    return ids, mask, teacher


def author_args(cls_pooling=False, lambdas=(0.001, 0.75, 1.0), lr=2e-5):
    """argument.py's defaults with scripts/train_asam_mini384.sh's values (temperature 0.1)."""
    return SimpleNamespace(
        temperature=0.1,
        lambda1=lambdas[0],
        lambda2=lambdas[1],
        lambda3=lambdas[2],
        cls_pooling=cls_pooling,
        learning_rate_adamw=lr,
        weight_decay=0.01,
    )


def mta_model(student, projectors, *, pooling="cls_attention", lambdas=(0.001, 0.75, 1.0), **loss):
    """mta's module over a copy of ``student``, its TAMD projections the author's top two."""
    spec = EmbeddingLossSpec(simcse_weight=lambdas[0], tamd_weight=lambdas[1], lasd_weight=lambdas[2], **loss)
    dtype = next(student.parameters()).dtype
    objective = EmbeddingObjective(spec, num_layers=L, student_dim=HIDDEN, teacher_dim=D_T, pooling=pooling)
    objective = objective.to(dtype)
    with torch.no_grad():
        for mine, theirs in zip(objective.anchor.projections, list(projectors)[-2:], strict=True):
            mine.weight.copy_(theirs.weight)
    return EmbeddingDistillationModel(copy.deepcopy(student), objective, max_seq_length=32)


def grads_of(module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


# ------------------------------------------------------------ pooling


@pytest.mark.parametrize("cls_pooling", [False, True], ids=["cls_attention", "cls"])
def test_pooling_is_the_author_s_get_embedding_in_value_and_gradient(cls_pooling):
    g = torch.Generator().manual_seed(0)
    _, mask, _ = tiny_batch()
    hidden = torch.randn(len(LENGTHS), mask.shape[1], HIDDEN, generator=g, dtype=torch.float64)
    hidden[mask == 0] *= 30.0  # large padded states: their scores would dominate if not masked
    probe = torch.randn(len(LENGTHS), HIDDEN, generator=g, dtype=torch.float64)
    mine, theirs = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    pooled = pool(mine, mask, "cls" if cls_pooling else "cls_attention")
    expected = author_get_embedding(theirs, mask, cls_pooling=cls_pooling)
    torch.testing.assert_close(pooled, expected, rtol=0, atol=1e-12)
    (pooled * probe).sum().backward()
    (expected * probe).sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)


# ------------------------------------------------------------ the terms on a tiny encoder


@pytest.mark.parametrize("cls_pooling", [False, True], ids=["cls_attention", "cls"])
def test_each_term_and_every_gradient_are_the_author_s_on_a_tiny_encoder(cls_pooling):
    """The same student, projections, batch and dropout draws: SimCSE, TAMD (layers 2, 3 of 3),
    LASD (pairs 1-2, 2-3, mean, the guide not detached) and the total equal his, and so does the
    gradient of every student weight and of the two anchored projections."""
    student = tiny_student()
    torch.manual_seed(5)
    projectors = author_build_projection_layer(L, HIDDEN, D_T, "cpu").double()
    ids, mask, teacher = tiny_batch()
    ours = mta_model(student, projectors, pooling="cls" if cls_pooling else "cls_attention")
    args = author_args(cls_pooling=cls_pooling)
    theirs = AuthorTrainer(copy.deepcopy(student), None, projectors, args)

    torch.manual_seed(11)
    loss, simcse = theirs.compute_loss({"input_ids": ids, "attention_mask": mask}, teacher)
    loss.backward()
    torch.manual_seed(11)  # the same dropout masks for mta's two passes
    losses = ours(EmbeddingBatch(ids, mask, teacher, list(range(len(LENGTHS)))))
    losses["total"].backward()

    for name, value in (("total", loss), ("simcse", simcse), *theirs.terms.items()):
        assert losses[name].item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15), name
    assert losses["simcse"].item() > 0.05  # the dropout passes differ: SimCSE is at work
    mine, author = grads_of(ours.student), grads_of(theirs.student)
    assert mine.keys() == author.keys() and not any("pooler" in name for name in mine)
    for name, grad in author.items():
        torch.testing.assert_close(mine[name], grad, rtol=1e-9, atol=1e-13, msg=name)
    for k, projection in enumerate(ours.objective.anchor.projections):  # layers 2 and 3: his [1], [2]
        torch.testing.assert_close(projection.weight.grad, projectors[L - 2 + k].weight.grad, rtol=1e-9, atol=1e-15)
    assert projectors[0].weight.grad is None  # his projection of layer 1 is never used


def test_lasd_with_the_guide_detached_is_mta_s_own_option_not_the_author_s():
    """loss.lasd_detach (off by default, as the author's code) keeps the value and changes the
    gradient: it is not his (``tests/test_losses_talas.py`` tests what it does)."""
    student = tiny_student()
    torch.manual_seed(5)
    projectors = author_build_projection_layer(L, HIDDEN, D_T, "cpu").double()
    ids, mask, teacher = tiny_batch()
    ours = mta_model(student, projectors, lasd_detach=True)
    theirs = AuthorTrainer(copy.deepcopy(student), None, projectors, author_args())
    torch.manual_seed(11)
    theirs.compute_loss({"input_ids": ids, "attention_mask": mask}, teacher)[0].backward()
    torch.manual_seed(11)
    losses = ours(EmbeddingBatch(ids, mask, teacher, list(range(len(LENGTHS)))))
    losses["total"].backward()
    assert losses["lasd"].item() == pytest.approx(theirs.terms["lasd"].item(), rel=1e-12)
    name = "encoder.layer.2.output.dense.weight"  # the top layer: only a guide in LASD
    assert not torch.allclose(grads_of(ours.student)[name], grads_of(theirs.student)[name], rtol=1e-6, atol=0)


# ------------------------------------------------------------ the projections' initialisation


def test_the_projections_are_drawn_like_the_author_s_and_identically_with_reference_code():
    """Default: the author's distribution (bias-free, N(0, 1e-3²)) but other draws, since he builds
    one projection per layer and keeps the top two; loss.reference_code draws as he does."""
    torch.manual_seed(42)
    his = author_build_projection_layer(6, 384, 256, "cpu")
    top = [projection.weight for projection in list(his)[-2:]]
    torch.manual_seed(42)
    default = TeacherAnchor(2, 384, 256)
    torch.manual_seed(42)
    drawn = EmbeddingObjective(
        EmbeddingLossSpec(reference_code=True), num_layers=6, student_dim=384, teacher_dim=256, pooling="cls_attention"
    ).anchor
    weights = torch.cat([p.weight.flatten() for p in default.projections])
    assert all(p.bias is None for p in default.projections)
    assert weights.std().item() == pytest.approx(1e-3, rel=0.02) and abs(weights.mean().item()) < 2e-5
    assert not torch.equal(default.projections[0].weight, top[0])
    assert len(drawn.projections) == 2 and all(p.bias is None for p in drawn.projections)
    for mine, theirs in zip(drawn.projections, top, strict=True):
        assert torch.equal(mine.weight, theirs)


# ------------------------------------------------------------ the ASAM step, through the Trainer


def mta_trainer(model, *, zero_stage, lr, grad_clip, reference_code):
    """mta's Trainer over a DeepSpeed engine of ``model`` (built as ``build_embedding_run``
    builds it), fp32, a constant schedule, ASAM at the author's setting (ρ 0.05, T_w = |w|)."""
    from mta.embedding.training_run import initialize_engine
    from mta.training import engine as engines

    engines.init_distributed()
    train = TrainSpec(
        lr=lr,
        projector_lr=1e-4,  # hard-coded in his build_optimizer
        weight_decay=0.01,
        schedule="constant",
        batch_size=len(LENGTHS),
        micro_batch_size=len(LENGTHS),
        max_steps=3,
        grad_clip=grad_clip,
        zero_stage=zero_stage,
        asam=AsamSpec(),
    )
    recipe = SimpleNamespace(train=train, loss=EmbeddingLossSpec(reference_code=reference_code), deepspeed={})
    engine = initialize_engine(model, recipe, 3, 1)
    return trainer_of(engine, train, accumulation=1), engine


def steps_side_by_side(*, lambdas, zero_stage=0, grad_clip=1.0, reference_code=False, lr=1e-3):
    """Three ASAM steps of the author's loop and of mta's Trainer from the same weights, on the
    same batches and dropout draws. Returns the largest weight difference after each step (student
    and projections), his pre-clip norms of the student's gradient (two a step), the losses logged."""
    student = tiny_student(dtype=torch.float32)  # DeepSpeed reduces no float64 gradient
    torch.manual_seed(5)
    projectors = author_build_projection_layer(L, HIDDEN, D_T, "cpu")
    model = mta_model(student, projectors, lambdas=lambdas, reference_code=reference_code)
    args = author_args(lambdas=lambdas, lr=lr)
    theirs = AuthorTrainer(copy.deepcopy(student), None, projectors, args)
    opt_sam = author_build_optimizer(args, theirs.student, projectors)
    trainer, engine = mta_trainer(
        model, zero_stage=zero_stage, lr=lr, grad_clip=grad_clip, reference_code=reference_code
    )
    gaps, norms, logged = [], [], []
    try:
        for step in range(3):
            ids, mask, teacher = tiny_batch(seed=20 + step, dtype=torch.float32, teacher_scale=1.0 + step)
            torch.manual_seed(100 + step)
            his_loss, his_norms = author_step(theirs, opt_sam, ({"input_ids": ids, "attention_mask": mask}, teacher))
            batch = EmbeddingBatch(ids, mask, teacher, list(range(len(LENGTHS))))
            trainer.micro_batches = lambda _step, batch=batch: iter([batch])
            torch.manual_seed(100 + step)
            logged.append((trainer.step(step)["total"], his_loss))
            norms += his_norms
            mine = dict(model.student.named_parameters())
            gap = max((mine[name] - p).abs().max().item() for name, p in theirs.student.named_parameters())
            for k, projection in enumerate(model.objective.anchor.projections):
                gap = max(gap, (projection.weight - projectors[L - 2 + k].weight).abs().max().item())
            gaps.append(gap)
    finally:
        engine.destroy()
    return gaps, norms, logged


AUTHOR_LAMBDAS = (0.001, 0.75, 1.0)  # on this student his clip acts: the gradient's norm is ~3
SMALL_LAMBDAS = (0.001, 0.05, 0.05)  # the student's gradient ~0.2, the projections' ~4


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_asam_steps_are_the_author_s_sam_steps_where_no_clip_acts(zero_stage):
    """ε = ρ·|w|²·g / ‖|w|·g‖ over the student and the projections, the second pass at w + ε,
    w restored, AdamW (lr per group, decay 0.01) on g′, the perturbed loss logged: his step, on
    batches where his clip (to 1, the student's gradient) does not act and mta clips nothing."""
    gaps, norms, logged = steps_side_by_side(lambdas=SMALL_LAMBDAS, zero_stage=zero_stage, grad_clip=0.0)
    assert max(norms) < 0.5
    assert max(gaps) < 1e-6, gaps
    for mine, his in logged:
        assert mine == pytest.approx(his, rel=1e-5)


@pytest.mark.parametrize(
    "lambdas, zero_stage",
    [(SMALL_LAMBDAS, 0), (AUTHOR_LAMBDAS, 0), (AUTHOR_LAMBDAS, 1)],
    ids=["only-mta-clips", "both-clip", "both-clip-zero1"],
)
def test_mta_s_clip_differs_from_his_and_reference_code_clips_as_he_does(lambdas, zero_stage):
    """His clip_grad_norm_(student.parameters(), 1.0) rescales the student's gradient alone (the
    projections' is not clipped) before ε and before AdamW; mta's clip (train.grad_clip 1) is one
    norm over everything, the projections' gradient in it (large: W starts at 1e-3, so
    ∂(1 − cos)/∂W is ~1/‖W e‖), and ε comes from the unclipped g. With small λ his clip leaves
    the student's gradient as it is while mta's scales it down; at his λ both act, differently.
    loss.reference_code: his steps in both."""
    gaps, norms, _ = steps_side_by_side(lambdas=lambdas, zero_stage=zero_stage)
    assert max(gaps) > 1e-4, gaps
    assert (min(norms) > 1.5) if lambdas == AUTHOR_LAMBDAS else (max(norms) < 0.5)
    gaps, norms, logged = steps_side_by_side(lambdas=lambdas, zero_stage=zero_stage, reference_code=True)
    assert max(gaps) < 1e-6, gaps
    for mine, his in logged:
        assert mine == pytest.approx(his, rel=1e-5)


def test_reference_code_refuses_several_processes_and_keeps_no_clip_when_none_is_asked():
    from mta.embedding.training_run import initialize_engine
    from mta.errors import MtaError

    model = mta_model(tiny_student(dtype=torch.float32), author_build_projection_layer(L, HIDDEN, D_T, "cpu"))
    train = TrainSpec(batch_size=4, micro_batch_size=2, max_steps=1)
    recipe = SimpleNamespace(train=train, loss=EmbeddingLossSpec(reference_code=True), deepspeed={})
    with pytest.raises(MtaError, match="one process, not 2"):
        initialize_engine(model, recipe, 1, 2)
    assert model.student_gradient_clip == 0.0


# ------------------------------------------------------------ precision and schedule


def test_the_terms_run_in_fp32_under_autocast_and_under_it_with_reference_code():
    """mta computes the terms with autocast off (the student's forwards under it); the author's
    loop computes them under autocast (bf16 pooling, projections, cosine matrices, scores)."""
    student = tiny_student(dtype=torch.float32).eval()  # no dropout: both evaluations see one pass
    projectors = author_build_projection_layer(L, HIDDEN, D_T, "cpu")
    ids, mask, teacher = tiny_batch(dtype=torch.float32)
    batch = EmbeddingBatch(ids, mask, teacher, list(range(len(LENGTHS))))
    results = {}
    for reference_code in (False, True):
        model = mta_model(student, projectors, reference_code=reference_code)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = model(batch)
            hidden = model.student(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            under = model.objective(hidden, mask, teacher, hidden[-1])
        exact = model.objective(hidden, mask, teacher, hidden[-1])  # the same states, autocast off
        results[reference_code] = (losses, exact, under)
    losses, exact, _ = results[False]
    for name in ("simcse", "tamd", "lasd", "total"):
        assert losses[name].dtype == torch.float32
        assert losses[name].item() == pytest.approx(exact[name].item(), rel=1e-6), name
    losses, exact, under = results[True]
    assert losses["lasd"].item() == pytest.approx(under["lasd"].item(), rel=1e-6)
    assert losses["lasd"].item() != pytest.approx(exact["lasd"].item(), rel=1e-3)  # bf16 cosine matrices


def test_the_author_s_cosine_floor_is_half_a_percent_of_each_rate_not_5e_6():
    """His scheduler gets min_lr=5e-6, which transformers divides by the optimizer's default lr:
    SAM builds the AdamW with none, so 1e-3. The floor is 0.5 % of each group's rate (1e-7 for the
    student at 2e-5, 5e-7 for the projections), and the first step runs at lr 0 (warmup from 0).
    mta's cosine (train.schedule) decays to 0 after train.warmup_steps; not reproduced."""
    student = tiny_student(dtype=torch.float32)
    opt_sam = author_build_optimizer(author_args(), student, author_build_projection_layer(L, HIDDEN, D_T, "cpu"))
    scheduler = author_scheduler(opt_sam.base_optimizer, 100)
    rates = [[group["lr"] for group in opt_sam.base_optimizer.param_groups]]
    for _ in range(100):
        opt_sam.base_optimizer.step()
        scheduler.step()
        rates.append([group["lr"] for group in opt_sam.base_optimizer.param_groups])
    assert rates[0] == [0.0, 0.0] and rates[5] == pytest.approx([2e-5, 1e-4])
    assert rates[-1] == pytest.approx([1e-7, 5e-7], rel=1e-6)
