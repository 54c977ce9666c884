"""The off-policy micro batch (mta.training.off_policy.micro_batches) on scripted generations: what the
models are given, what is a target, which spans the loss reads and when they are waited for.

The generator is scripted (the student's sampling is tested in test_generation and end to end
in test_off_policy_training), so each edge case is exact: EOS as the first token, nothing
generated, a response that fills the budget, a multibyte character cut by the budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fixtures.distill import LENGTHS
from mta.data.annotate import AnnotateSettings
from mta.data.annotations import read_annotations
from mta.data.online_spans import GeneratedRow, SpanParser, annotate_generated
from mta.generation import Completion
from mta.models.tokenizers import load_tokenizer
from mta.training.batching import IGNORE_INDEX, AnnotatedExamples
from mta.training.config.schema import Recipe
from mta.training.off_policy import micro_batches
from mta.training.off_policy.micro_batches import OffPolicyBatches

BUDGET = 8
GRANULARITIES = ("phrase", "word")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def settings(tiny_tokenizer_dir):
    return AnnotateSettings(teacher=str(tiny_tokenizer_dir), student=str(tiny_tokenizer_dir), workers=1, **LENGTHS)


def multibyte_cut(tokenizer) -> list[int]:
    """Ids of a response whose last id ends inside a multibyte character (within the budget)."""
    ids = tokenizer.encode(" 茶是一种饮料", add_special_tokens=False)
    for end in range(1, min(len(ids), BUDGET) + 1):
        if tokenizer.decode(ids[:end]).endswith("\ufffd"):
            return ids[:end]
    pytest.fail("the tokenizer splits no CJK character into byte tokens")


def scripted(tokenizer) -> list[tuple[list[int], bool]]:
    """(generated ids without the stop token, finished) for four rows."""
    words = tokenizer.encode(" the cat sat on the mat and then it slept all day long", add_special_tokens=False)
    return [
        ([], True),  # EOS as the first token
        ([], False),  # nothing generated at all
        (words[:BUDGET], False),  # the budget is spent
        (multibyte_cut(tokenizer), False),  # cut inside a character
    ]


class ScriptedGenerator:
    """Stands in for HFGenerator: completes prompt i with ``script[i]``."""

    script: list[tuple[list[int], bool]] = []

    def __init__(self, model, tokenizer, params, batch_size):
        assert params.max_new_tokens == BUDGET

    def generate(self, prompts, seeds):
        yield [
            Completion(position, list(ids), finished)
            for position, (ids, finished) in enumerate(self.script[: len(prompts)])
        ]


class CountingParser:
    """A synchronous SpanParser whose pending results count how often they are waited for."""

    def __init__(self, parser: SpanParser):
        self.parser = parser
        self.waits = 0

    def submit(self, rows):
        pending = self.parser.submit(rows)
        real = pending.result

        def result(timeout=None):
            self.waits += 1
            return real(timeout)

        pending.result = result
        return pending


def off_policy(table, tokenizer, parser, *, mode="adaptive", save_generated=False) -> OffPolicyBatches:
    recipe = Recipe.model_validate(
        {
            "name": "r",
            "output_dir": "o",
            "teacher": {"path": "t"},
            "student": {"path": "s"},
            "data": {"train": "x", "dev": None, **LENGTHS},
            "train": {"max_steps": 4, "batch_size": 4, "micro_batch_size": 4, "save_generated": save_generated},
            "off_policy": {"mode": mode, "init_threshold": 1.0, "buffer_size": 8, "max_new_tokens": BUDGET},
        }
    )
    return OffPolicyBatches(
        recipe,
        table,
        model=None,
        tokenizer=tokenizer,
        pad_ids={"student": 0, "teacher": 0},
        with_teacher=True,
        granularities=GRANULARITIES,
        parser=parser,
        total_steps=4,
    )


def test_a_generated_micro_batch_trains_on_the_ids_generated_and_their_spans(
    same_data,
    tokenizer,
    settings,
    monkeypatch,  # noqa: F811
):
    table = read_annotations(same_data).table
    ScriptedGenerator.script = scripted(tokenizer)
    monkeypatch.setattr(micro_batches, "HFGenerator", ScriptedGenerator)
    with SpanParser(settings, workers=0) as span_parser:
        parser = CountingParser(span_parser)
        batches = off_policy(table, tokenizer, parser, save_generated=True)
        rows = np.arange(4)
        gold = AnnotatedExamples(table, student_pad_id=0, granularities=GRANULARITIES).batch(rows)
        batch, source = batches.batch(0, 0, rows, gold)
        assert source == "generated" and batch.pending_spans is not None and batch.spans == {}
        assert parser.waits == 0, "the spans were waited for before the teacher forward"
        assert batch.to("cpu").padded_to(64, {"student": 0, "teacher": 0}).pending_spans is batch.pending_spans

        eos = tokenizer.eos_token_id
        expected_rows = []
        for position, (ids, finished) in enumerate(ScriptedGenerator.script):
            row = table.slice(position, 1).to_pylist()[0]
            prompt = row["student_input_ids"][: row["student_prompt_len"]]
            response = ids + ([eos] if finished else [])
            length = len(prompt) + len(response)
            for tokens in (batch.student, batch.teacher):  # one tokenizer: the same ids on both sides
                assert tokens.input_ids[position, :length].tolist() == prompt + response
                assert tokens.attention_mask[position].sum() == length
                labels = tokens.labels[position]
                # Only the generated response is a target: EOS first is one target, nothing none.
                assert (labels[: len(prompt)] == IGNORE_INDEX).all() and (labels[length:] == IGNORE_INDEX).all()
                assert labels[len(prompt) : length].tolist() == response
            expected_rows.append(
                GeneratedRow(row["text"][: row["prompt_chars"]], prompt, response, finished=finished, id=row["id"])
            )

        # The spans the loss reads (asked for after the teacher forward) are those of the same
        # rows parsed directly, waited for once.
        want = (
            AnnotatedExamples(
                annotate_generated(span_parser.annotator, expected_rows).batch,
                student_pad_id=0,
                granularities=GRANULARITIES,
            )
            .batch(rows)
            .spans
        )
        with_spans = batches.with_spans(batch.to("cpu"))
        assert with_spans.pending_spans is None and batches.with_spans(with_spans) is with_spans
        device_spans = with_spans.spans
        for name in GRANULARITIES:
            for field in ("student_start", "student_end", "teacher_start", "teacher_end", "mask"):
                assert torch.equal(getattr(device_spans[name], field), getattr(want[name], field)), (name, field)
        assert batches.with_spans(batch).spans.keys() == set(GRANULARITIES) and parser.waits == 1
        assert want["word"].mask[2].any(), "the full-budget row has words"

        # Settled before the next decision: into the buffer, as the rows the spans came from.
        batches.settle()
        assert parser.waits == 1 and len(batches.buffer) == 4
        buffered = batches.buffer.rows()
        cut = buffered[3]
        assert cut["student_input_ids"][cut["student_prompt_len"] :] == ScriptedGenerator.script[3][0]
        # Its text is the tokenizer's decode of the ids: the cut character is one U+FFFD at the end.
        assert cut["text"] == tokenizer.decode(cut["student_input_ids"]) and cut["text"].endswith("\ufffd")
        for row in buffered:
            for span in row["word_spans"] + row["phrase_spans"]:
                assert row["text"][span["char_start"] : span["char_end"]].strip()
        assert [rows_saved for rows_saved, _, _ in batches._saved] == [buffered]


def test_the_parsed_rows_must_hold_the_ids_trained_on(same_data, tokenizer, settings, monkeypatch):  # noqa: F811
    table = read_annotations(same_data).table
    ScriptedGenerator.script = scripted(tokenizer)
    monkeypatch.setattr(micro_batches, "HFGenerator", ScriptedGenerator)
    with SpanParser(settings, workers=0) as parser:
        batches = off_policy(table, tokenizer, parser, mode="always")
        rows = np.arange(4)
        gold = AnnotatedExamples(table, student_pad_id=0, granularities=GRANULARITIES).batch(rows)
        batch, _ = batches.batch(0, 0, rows, gold)
        batch.student.input_ids[2, -1] += 1  # as if a worker's tokenizer differed
        with pytest.raises(micro_batches.MtaError, match="differ from the ids generated"):
            batches.with_spans(batch)
