"""Collecting parsed spans without workers or spaCy (mta.data.online_spans): a batch's futures in
order, each way a worker can fail, and chunk results merged. The parsing itself is tested in
tests/test_online_spans.py; these are what mutation testing (bench/mutation.py) needs in
seconds."""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from concurrent.futures.process import BrokenProcessPool

import pytest

from fixtures.online_spans import chunk, done, late
from mta.data.artefact_schema import SCHEMA
from mta.data.online_spans import PendingSpans, merge_results
from mta.errors import MtaError


def test_chunk_results_merge_in_order_with_counts_summed():
    merged = merge_results([chunk([0, 1], rows=2), chunk([-5, 2], rows=1, skipped=1), chunk([3], rows=1)])
    assert merged.batch.column("id").to_pylist() == [0, 1, 2, 3]
    assert merged.counts == Counter(rows=4, skipped=1)
    assert [p.id for p in merged.skipped] == [-5]
    one = chunk([7], rows=1)
    alone = merge_results([one])
    assert alone.batch is one.batch and alone.counts == Counter(rows=1) and alone.counts is not one.counts
    nothing = merge_results([])
    assert nothing.batch.num_rows == 0 and nothing.batch.schema == SCHEMA and nothing.counts == Counter()


def test_a_batch_is_done_when_every_chunk_is_and_its_result_is_theirs_in_order():
    pending_future: concurrent.futures.Future = concurrent.futures.Future()
    pending = PendingSpans([done(chunk([0])), pending_future], timeout_s=5.0)
    assert not pending.done()
    pending_future.set_result(chunk([1, 2], rows=2))
    assert pending.done()
    assert pending.result().batch.column("id").to_pylist() == [0, 1, 2]
    assert PendingSpans([], timeout_s=1.0).done()


def test_a_batch_that_gets_no_answer_in_time_says_how_many_chunks_are_pending():
    # Chunks that finish only after 2 s: a result() that waited longer than asked returns them.
    stuck = PendingSpans([done(chunk([0])), late(chunk([1]), 2.0), late(chunk([2]), 2.0)], timeout_s=0.05)
    with pytest.raises(TimeoutError) as answer:
        stuck.result()
    assert str(answer.value) == (
        "span parsing gave no answer within 0.05 s (2 of 3 chunks pending); the span workers may be "
        "stuck: use SpanParser(workers=0) to parse in the training process"
    )
    with pytest.raises(TimeoutError, match=r"within 0\.01 s \(2 of 3"):
        stuck.result(timeout=0.01)


def test_a_worker_error_a_closed_parser_and_a_dead_worker_each_surface_as_their_own_error():
    with pytest.raises(ValueError, match="bad row"):
        PendingSpans([done(error=ValueError("bad row"))], timeout_s=1.0).result()
    cancelled: concurrent.futures.Future = concurrent.futures.Future()
    cancelled.cancel()
    with pytest.raises(RuntimeError) as closed:
        PendingSpans([cancelled], timeout_s=1.0).result()
    assert str(closed.value) == "the SpanParser was closed before these rows were parsed"
    with pytest.raises(MtaError) as died:
        PendingSpans([done(error=BrokenProcessPool("gone"))], timeout_s=1.0).result()
    assert str(died.value) == (
        "a span worker process died (out of memory, or the parser was closed while it worked); the "
        "parser cannot go on: restart the run with fewer span workers or workers=0"
    )
