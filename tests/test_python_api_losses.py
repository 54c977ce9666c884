"""The public API computes what mta's own pipeline computes (issue 27), in the Hugging Face
convention: every base loss given unshifted logits and labels equals
``DistillationObjective``'s base term on the same batch (and the shifted option equals both);
``MTALoss`` on the models' outputs equals ``DistillationModel`` with the ``FrozenTeacher``;
shapes that fit no convention are refused naming the expected one; ``Annotator`` writes the
rows ``mta annotate`` writes and ``Collator`` gathers the batch ``AnnotatedExamples`` does."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest
import torch

import mta
from conftest import EXAMPLES
from fixtures.batching import random_rows
from mta.data.annotate import run_annotate
from mta.data.annotations import read_annotations
from mta.data.artefact_schema import SCHEMA
from mta.losses.kd import BASE_LOSSES
from mta.training.batching import AnnotatedExamples
from mta.training.config.layers import resolve_layer_map
from mta.training.config.schema import LossSpec
from mta.training.objective import DistillationModel, DistillationObjective
from mta.training.teacher import FrozenTeacher, TeacherOutput

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PADDED = 40, 3  # the tokenizer's vocabulary and the embedding rows a checkpoint adds
TAU = 2.0


def random_batch(count: int, seed: int, *, pairs: bool = False) -> mta.TrainBatch:
    """Rows of one tokenizer (both sides the same ids), through the public collator."""
    rows = random_rows(count, seed)
    for index, row in enumerate(rows):
        row["student_input_ids"] = [token % VOCAB for token in row["student_input_ids"]]
        row["teacher_input_ids"] = row["student_input_ids"]
        row["teacher_prompt_len"] = row["student_prompt_len"]
        if pairs:
            row["pair_id"], row["role"] = index // 2, ("chosen", "rejected")[index % 2]
    return mta.Collator(granularities=())(rows)


def random_logits(batch: mta.TrainBatch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sharp, unrelated student and teacher logits (of different widths) at every position."""
    generator = torch.Generator().manual_seed(seed)
    shape = (*batch.student.input_ids.shape, VOCAB + PADDED)
    student = torch.randn(shape, generator=generator) * 10
    return student, torch.randn((*shape[:-1], VOCAB + PADDED + 2), generator=generator) * 10


@pytest.mark.parametrize("name", sorted(BASE_LOSSES))
def test_every_base_loss_in_the_hf_convention_equals_mtas_objective(name):
    batch = random_batch(6, seed=3, pairs=name == "distillm2")
    student_logits, teacher_logits = random_logits(batch, seed=11)
    labels = batch.student.labels
    assert (labels[:, 1:] != -100).sum() > 10  # enough response tokens to tell shifts apart
    spec = LossSpec(base=name, temperature=TAU, dsa_weight=0, hra_weight=0)
    objective = DistillationObjective(
        spec, [], student_hidden_size=8, teacher_hidden_size=None, same_tokenizer=True, vocab_size=VOCAB
    )
    expected = objective(student_logits, None, TeacherOutput(hidden_states={}, logits=teacher_logits), batch)["base"]
    pairs = {"chosen": batch.chosen} if name == "distillm2" else {}

    kd = mta.KDLoss(name, temperature=TAU, vocab_size=VOCAB)
    assert kd(student_logits, teacher_logits, labels, **pairs).item() == pytest.approx(expected.item(), rel=1e-6)
    shifted = mta.KDLoss(name, temperature=TAU, vocab_size=VOCAB, labels_shifted=True)
    value = shifted(student_logits[:, :-1], teacher_logits[:, :-1], labels[:, 1:], **pairs)
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)
    # The mistake the convention guards against: the same tensors read unshifted give another value.
    if name != "distillm2":
        assert kd(student_logits[:, :-1], teacher_logits[:, :-1], labels[:, 1:]).item() != pytest.approx(
            expected.item(), rel=1e-4
        )


@pytest.mark.parametrize(
    ("shifted", "logits_positions", "labels_positions", "message"),
    [
        (False, 9, 8, "look shifted already"),  # HF logits with labels[:, 1:]
        (False, 8, 9, "The logits are one position shorter"),  # logits[:, :-1] with HF labels
        (False, 9, 5, "the Hugging Face convention"),
        (True, 9, 8, "drop the logits' last position"),  # shifted labels, full logits
        (True, 9, 5, "labels_shifted=True: logits [B, T-1, V] and labels [B, T-1]"),
    ],
)
def test_shapes_that_fit_no_convention_are_refused_naming_the_expected_one(
    shifted, logits_positions, labels_positions, message
):
    kd = mta.KDLoss("fkl", labels_shifted=shifted)
    logits = torch.zeros(2, logits_positions, VOCAB)
    with pytest.raises(mta.MtaError, match=re.escape(message)) as error:
        kd(logits, logits.clone(), torch.zeros(2, labels_positions, dtype=torch.long))
    assert f"[2, {logits_positions}, {VOCAB}]" in str(error.value) and f"[2, {labels_positions}]" in str(error.value)


def test_the_other_refusals_name_what_is_missing():
    logits, labels = torch.zeros(2, 5, VOCAB), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(mta.MtaError, match="do not cover the same positions"):
        mta.KDLoss("fkl")(logits, torch.zeros(2, 4, VOCAB), labels)
    with pytest.raises(mta.MtaError, match="teacher_logits is None"):
        mta.KDLoss("rkl")(logits, None, labels)
    with pytest.raises(mta.MtaError, match="reads chosen"):
        mta.KDLoss("distillm2")(logits, logits, labels)
    with pytest.raises(mta.MtaError, match="distillm2 only"):
        mta.KDLoss("ce")(logits, None, labels, chosen=torch.ones(2, dtype=torch.bool))
    with pytest.raises(mta.MtaError, match="unknown base loss 'kl'"):
        mta.KDLoss("kl")
    with pytest.raises(mta.MtaError, match="not annotated"):
        mta.Collator()([{"prompt": "Hi.\n", "response": "Hello."}])
    with pytest.raises(mta.MtaError, match=r"layers\[1\]"):
        mta.layer_map(4, 8, [(1, 2, "word"), (1, 2, "sentence")])
    with pytest.raises(mta.MtaError, match="does not exist"):
        mta.layer_map(4, 8, [(5, 2, "word")])
    assert mta.layer_map(12, 48) == resolve_layer_map("auto", 12, 48)
    assert mta.layer_map(4, 8, [(1, 2, "word")]) == [mta.LayerPair(student=1, teacher=2, granularity="word")]


# --- MTALoss on real (tiny) models against DistillationModel ------------------------------------


@pytest.fixture(scope="module")
def models(tiny_model_dir, teacher_dir, other_tokenizer_dir, tmp_path_factory):
    from mta.models.tiny import build_tiny_model

    other_dir = build_tiny_model(other_tokenizer_dir, tmp_path_factory.mktemp("other-student"), seed=2)
    return {"student": tiny_model_dir, "teacher": teacher_dir, "other": other_dir}


def load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory)


ROWS = [json.loads(line) for line in EXAMPLES.read_text(encoding="utf-8").splitlines()[:4] if line.strip()]


@pytest.mark.parametrize(
    ("case", "options"),
    [
        ("same", {"base": "fkl", "layers": "auto"}),
        ("two", {"base": "ce", "layers": [(1, 1, "word"), (2, 2, "phrase")]}),  # the teacher runs 2 blocks
    ],
)
def test_mta_loss_on_model_outputs_equals_mtas_distillation_model(models, case, options):
    from transformers import AutoTokenizer

    student_dir = models["student"] if case == "same" else models["other"]
    settings = mta.AnnotateSettings(
        teacher=str(models["teacher"]), student=str(student_dir), max_length=256, max_prompt_length=160
    )
    student, teacher = load(student_dir), load(models["teacher"])
    vocab = len(AutoTokenizer.from_pretrained(student_dir))
    torch.manual_seed(0)
    loss = mta.MTALoss.for_models(student, teacher, vocab_size=vocab, same_tokenizer=case == "same", **options)
    batch = mta.Collator(annotator=mta.Annotator(settings), granularities=loss.granularities)(ROWS)
    assert all(spans.mask.any() for spans in batch.spans.values())

    student_out = student(
        input_ids=batch.student.input_ids, attention_mask=batch.student.attention_mask, output_hidden_states=True
    )
    with torch.no_grad():
        teacher_out = teacher(
            input_ids=batch.teacher.input_ids, attention_mask=batch.teacher.attention_mask, output_hidden_states=True
        )
    got = loss(student_out, teacher_out, batch)
    assert set(got) == {"base", "dsa", "hra", "total"}

    pairs = mta.layer_map(4, 4, options["layers"])
    objective = DistillationObjective(
        LossSpec(base=options["base"]),
        pairs,
        student_hidden_size=student.config.hidden_size,
        teacher_hidden_size=teacher.config.hidden_size,
        same_tokenizer=case == "same",
        vocab_size=vocab,
    )
    objective.load_state_dict(loss.objective.state_dict())  # the same projectors
    frozen = FrozenTeacher(teacher, objective.teacher_layers, objective.needs_teacher_logits)  # truncates it
    assert frozen.truncated == (case == "two")
    expected = DistillationModel(student, objective)(
        batch, frozen(batch.teacher.input_ids, batch.teacher.attention_mask)
    )
    assert set(expected) == set(got)
    for term, value in expected.items():
        assert got[term].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), term

    # alignment(): the DSA and HRA of forward(), weighted into their own total.
    aligned = loss.trajectory(
        student_out.hidden_states,
        teacher_out.hidden_states,
        batch.student.attention_mask,
        batch.teacher.attention_mask,
        batch.spans,
    )
    assert set(aligned) == {"dsa", "hra", "total"}
    for term in ("dsa", "hra"):
        assert aligned[term].item() == pytest.approx(got[term].item(), rel=1e-6), term
    weights = {"dsa": 2.0, "hra": 0.2}  # MTALoss's defaults
    assert aligned["total"].item() == pytest.approx(sum(weights[t] * aligned[t].item() for t in weights), rel=1e-6)

    got["total"].backward()  # the gradient reaches the student and the projectors
    assert student.get_input_embeddings().weight.grad is not None
    assert all(parameter.grad is not None for parameter in loss.parameters())

    # Labels given explicitly, in either convention, are the batch's.
    labels = batch.student.labels
    assert loss(student_out, teacher_out, batch, labels=labels)["total"].item() == pytest.approx(got["total"].item())
    shifted = mta.MTALoss.for_models(
        student, teacher, vocab_size=vocab, same_tokenizer=case == "same", labels_shifted=True, **options
    )
    shifted.load_state_dict(loss.state_dict())
    value = shifted(student_out, teacher_out, batch, labels=labels[:, 1:])["total"]
    assert value.item() == pytest.approx(got["total"].item())
    with pytest.raises(mta.MtaError, match="look shifted already"):
        loss(student_out, teacher_out, batch, labels=labels[:, 1:])
    with pytest.raises(mta.MtaError, match="as the model returns them"):
        loss({"logits": student_out.logits[:, :-1]}, teacher_out, batch)
    with pytest.raises(mta.MtaError, match="output_hidden_states=True"):
        loss({"logits": student_out.logits}, teacher_out, batch)


# --- rows: the Annotator is mta annotate, the Collator is AnnotatedExamples ----------------------

PAIRS = [
    {"prompt": "Name a colour.\n", "chosen": "The sky is a deep blue.", "rejected": "Red, like a ripe apple."},
    {"instruction": "Say hello.", "chosen": "Hello there, my good friend.", "rejected": "Hi."},
]


@pytest.mark.parametrize("kind", ["rows", "pairs"])
def test_annotator_rows_are_mta_annotates_and_collate_as_annotated_examples(two_tokenizer_settings, tmp_path, kind):
    records = [*ROWS, {"prompt": "x" * 2000 + "\n", "response": "A prompt over the limit: skipped."}]
    if kind == "pairs":
        records = PAIRS
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    run_annotate(source, tmp_path / "out", two_tokenizer_settings)
    table = read_annotations(tmp_path / "out").table
    annotator = mta.Annotator(two_tokenizer_settings)

    rows = annotator.annotate(records)
    assert rows == table.to_pylist()
    ids = [row["id"] for row in rows]
    assert ids == [0, 1, 2, 3] if kind == "pairs" else len(ROWS) not in ids  # the over-long prompt is skipped

    expected = AnnotatedExamples(table, student_pad_id=7, teacher_pad_id=5, boundary=True).batch(range(len(table)))
    collate = mta.Collator(student_pad_id=7, teacher_pad_id=5, boundary=True)
    for got in (
        collate(rows),
        collate(pa.Table.from_pylist(rows, schema=SCHEMA)),
        mta.Collator(student_pad_id=7, teacher_pad_id=5, boundary=True, annotator=annotator)(records),
    ):
        assert got.row_ids == expected.row_ids
        for side in ("student", "teacher"):
            for field in ("input_ids", "attention_mask", "labels"):
                assert torch.equal(getattr(getattr(got, side), field), getattr(getattr(expected, side), field))
        assert set(got.spans) == set(expected.spans) == {"word", "phrase", "boundary"}
        for name, spans in expected.spans.items():
            for field in ("student_start", "student_end", "teacher_start", "teacher_end", "mask"):
                assert torch.equal(getattr(got.spans[name], field), getattr(spans, field)), (name, field)
        assert (got.chosen is None) == (kind == "rows")
        if kind == "pairs":
            assert got.chosen.tolist() == [True, False, True, False]
