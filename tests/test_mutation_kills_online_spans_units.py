"""The span parser's own logic (mta.data.online_spans), in this process and in milliseconds, for
mutation testing (bench/mutation.py): which tokenizers and spaCy model the annotator is built
from, how a batch is split over the workers and collected, how the pool is started (fork hands
the workers the built annotator, spawn a builder) and closed (queued chunks cancelled, running
ones given the grace, then terminated, killed a second later), and what a worker process sets up
for itself (one thread per library, SIGTERM when the trainer dies, the annotator installed).

spaCy and the tokenizers are stand-ins (a row's artefact row carries only its id), the process
pool runs each task as it is submitted and its worker processes record what close() asks of
them; the worker set-up functions run here, their effects undone after each test. The parsing
itself, against what `mta annotate` writes, and a real pool of forked workers are tested in
tests/test_online_spans.py.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

import pytest

from fixtures.online_spans import NO_ROWS, chunk, done, late
from fixtures.store import annotate_rows
from mta.data import example_annotator, online_spans
from mta.data.annotate import AnnotateSettings
from mta.data.artefact_schema import SCHEMA
from mta.data.encoding import TokenizerSide
from mta.data.example_annotator import ChunkResult, ExampleAnnotator, GeneratedRow, annotate_in_worker
from mta.data.online_spans import (
    CLOSE_GRACE_S,
    PendingSpans,
    SpanParser,
    annotate_generated,
    generated_row,
    load_sides,
    merge_results,
    online_annotator,
)
from mta.errors import MtaError

LINUX = sys.platform.startswith("linux")
LIBC = ctypes.CDLL(None) if LINUX else None
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2  # <linux/prctl.h>
SETTINGS = AnnotateSettings(teacher="teacher-tok", student="student-tok", spacy_model="en_core_web_sm")


# --------------------------------------------------------------------------- stand-ins


class IdAnnotator(ExampleAnnotator):
    """An annotator without spaCy or tokenizers: each row's artefact row carries its id (one row
    per row, in order); a negative id is refused as a real annotator refuses a row it cannot
    encode (ValueError). Records every chunk it is given. An ExampleAnnotator, as the worker
    initializer tells an inherited annotator from a builder by that class."""

    def __init__(self, label: str = "built"):  # ExampleAnnotator's own wants a spaCy pipeline
        self.label = label
        self.chunks: list = []

    def annotate(self, rows):
        self.chunks.append(rows)
        ids = [row.id for row in rows]
        if any(i < 0 for i in ids):
            raise ValueError(f"bad row in {self.label}")
        return ChunkResult(batch=annotate_rows(ids), counts=Counter(rows=len(ids)))


class Side:
    """A tokenizer side: its name, and how often its byte tables were built (``token_bytes``);
    one that cannot decode refuses as TokenizerSide does (MtaError)."""

    def __init__(self, name: str, decodes: bool = True):
        self.name = name
        self.decodes = decodes
        self.tables_built = 0

    @property
    def token_bytes(self):
        if not self.decodes:
            raise MtaError(f"{self.name} cannot decode")
        self.tables_built += 1
        return {}


def rows(*ids: int) -> list[GeneratedRow]:
    return [GeneratedRow(f"prompt {i}", [1, 2], [3], id=i) for i in ids]


def ids_of(result: ChunkResult) -> list[int]:
    return result.batch.column("id").to_pylist()


@pytest.fixture
def built(monkeypatch):
    """Tokenizers and the annotator as stand-ins: ``loads`` lists the tokenizers loaded,
    ``builds`` each build_annotator call's (settings, teacher, student, spaCy package) with the
    annotator it made; a spaCy model name resolves to ``<name>-package``."""
    record = SimpleNamespace(loads=[], builds=[])

    def load(cls, name):
        record.loads.append(name)
        return Side(name)

    def build(settings, teacher, student, spacy_name):
        annotator = IdAnnotator(f"build {len(record.builds)}")
        record.builds.append(((settings, teacher, student, spacy_name), annotator))
        return annotator

    monkeypatch.setattr(TokenizerSide, "load", classmethod(load))
    monkeypatch.setattr(online_spans, "build_annotator", build)
    monkeypatch.setattr(online_spans, "resolve_spacy_model", lambda name: (f"{name}-package", "3.8.0"))
    return record


class Worker:
    """A pool's worker process as close() sees it: it stops at its first join ("join"), once
    terminated ("terminate") or only once killed ("kill"); every call goes to ``log``."""

    def __init__(self, name: str, stops_on: str, log: list):
        self.name, self.stops_on, self.log = name, stops_on, log
        self.alive = True
        self.signals: set[str] = set()

    def join(self, timeout=None):
        assert timeout is not None, "join() without a timeout waits forever on a stuck worker"
        self.log.append(("join", self.name, timeout))
        if self.stops_on == "join" or self.stops_on in self.signals:
            self.alive = False

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self):
        self.log.append(("terminate", self.name))
        self.signals.add("terminate")

    def kill(self):
        self.log.append(("kill", self.name))
        self.signals.add("kill")


class ManagerThread:
    def __init__(self, log: list):
        self.log = log

    def join(self, timeout=None):
        self.log.append(("join", "manager", timeout))


@pytest.fixture
def pools(monkeypatch):
    """concurrent.futures.ProcessPoolExecutor replaced by one that runs each task when it is
    submitted, in this process, under the annotator its workers' initializer arguments install
    (as init_annotator_worker does). Each pool made is listed; ``held`` pools keep their tasks
    queued, ``broken`` ones refuse new tasks; ``log`` records shutdown and its workers' calls."""
    made: list = []
    monkeypatch.setattr(example_annotator, "_WORKER_ANNOTATOR", None)

    class InlinePool:
        def __init__(self, max_workers=None, mp_context=None, initializer=None, initargs=()):
            self.max_workers, self.mp_context = max_workers, mp_context
            self.initializer, self.initargs = initializer, initargs
            self.log: list = []
            self.tasks: list = []
            self.queued: list = []
            self.held = self.broken = False
            self._processes = {pid: Worker(f"w{pid}", "join", self.log) for pid in range(max_workers or 0)}
            self._executor_manager_thread = ManagerThread(self.log)
            source = initargs[0]
            worker = source if isinstance(source, ExampleAnnotator) else source()
            monkeypatch.setattr(example_annotator, "_WORKER_ANNOTATOR", worker)
            made.append(self)

        def submit(self, fn, *args):
            if self.broken:
                raise BrokenProcessPool("a worker died")
            self.tasks.append((fn, args))
            if self.held:
                future: concurrent.futures.Future = concurrent.futures.Future()
                self.queued.append(future)
                return future
            try:
                return done(fn(*args))
            except Exception as error:
                return done(error=error)

        def shutdown(self, wait=True, *, cancel_futures=False):
            if wait:
                raise AssertionError("shutdown(wait=True) waits for the chunks in flight")
            self.log.append(("shutdown", cancel_futures))
            if cancel_futures:
                for future in self.queued:
                    future.cancel()

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", InlinePool)
    return made


# --------------------------------------------------------------------------- the annotator


def test_one_tokenizer_is_loaded_when_both_sides_name_it(built):
    teacher, student = load_sides(SETTINGS)
    assert built.loads == ["teacher-tok", "student-tok"]
    assert (teacher.name, student.name) == ("teacher-tok", "student-tok")
    built.loads.clear()
    teacher, student = load_sides(AnnotateSettings(teacher="same-tok", student="same-tok"))
    assert built.loads == ["same-tok"] and teacher is student and teacher.name == "same-tok"


def test_the_online_annotator_is_built_from_the_settings_tokenizers_and_spacy_package(built):
    annotator = online_annotator(SETTINGS)
    (args, made), *others = built.builds
    assert annotator is made and not others
    assert args[0] is SETTINGS and args[3] == "en_core_web_sm-package"
    assert [side.name for side in args[1:3]] == ["teacher-tok", "student-tok"]
    # Both tokenizers given: nothing is loaded, they are what the annotator gets.
    teacher, student = Side("t"), Side("s")
    built.loads.clear()
    online_annotator(SETTINGS, teacher, student)
    assert built.loads == [] and built.builds[-1][0][1:3] == (teacher, student)
    # Only one given: both are loaded from the settings (the annotator never gets a side of None).
    for given in ({"teacher": teacher}, {"student": student}):
        built.loads.clear()
        online_annotator(SETTINGS, **given)
        assert built.loads == ["teacher-tok", "student-tok"]
        assert [side.name for side in built.builds[-1][0][1:3]] == ["teacher-tok", "student-tok"]


def test_generated_rows_go_to_the_annotator_as_given_and_come_back_as_its_rows():
    annotator = IdAnnotator()
    given = tuple(rows(4, 2))
    result = annotate_generated(annotator, given)
    assert ids_of(result) == [4, 2] and result.counts == Counter(rows=2)
    assert [list(sent) for sent in annotator.chunks] == [list(given)]

    row = generated_row(annotator, "Q: ", [5, 6], [7, 8, 9], finished=True, side="teacher", id=11)
    assert set(row) == set(SCHEMA.names) and row["id"] == 11
    (sent,) = annotator.chunks[-1]
    assert (sent.prompt, sent.prompt_ids.tolist(), sent.generated_ids.tolist()) == ("Q: ", [5, 6], [7, 8, 9])
    assert (sent.finished, sent.side, sent.id) == (True, "teacher", 11)
    generated_row(annotator, "Q: ", [5], [7])  # the defaults: the student generated, EOS decides
    (sent,) = annotator.chunks[-1]
    assert (sent.finished, sent.side, sent.id) == (None, "student", 0)


# --------------------------------------------------------------------------- collecting


def test_a_single_chunk_keeps_its_skipped_rows():
    merged = merge_results([chunk([-3, 1, -4], rows=1, skipped=2)])
    assert [problem.id for problem in merged.skipped] == [-3, -4] and ids_of(merged) == [1]


def test_a_chunk_that_finishes_within_the_timeout_is_waited_for():
    pending = PendingSpans([done(chunk([0])), late(chunk([1]), 0.05)], timeout_s=5.0)
    assert ids_of(pending.result()) == [0, 1]
    assert ids_of(PendingSpans([late(chunk([2]), 0.05)], timeout_s=0.0).result(timeout=5.0)) == [2]


def test_a_batch_never_waits_longer_than_its_timeout():
    slow = PendingSpans([late(chunk([0]), 1.0), late(chunk([1]), 1.0)], timeout_s=0.05)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\(2 of 2 chunks pending\)"):
        slow.result()
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize(
    ("count", "parts", "chunks"),
    [
        (5, 2, [[0, 1, 2], [3, 4]]),
        (7, 3, [[0, 1, 2], [3, 4, 5], [6]]),
        (9, 4, [[0, 1, 2], [3, 4, 5], [6, 7, 8]]),  # ceil(9 / 4) = 3 a chunk: fewer chunks than parts
        (4, 4, [[0], [1], [2], [3]]),
        (2, 5, [[0], [1]]),  # more parts than rows: a row each
        (3, 1, [[0, 1, 2]]),
        (3, 0, [[0, 1, 2]]),  # no parts counts as one
        (0, 3, []),
    ],
)
def test_rows_are_split_in_order_into_at_most_parts_chunks_of_near_equal_size(count, parts, chunks):
    assert online_spans.split_rows(tuple(range(count)), parts) == chunks


# --------------------------------------------------------------------------- the worker process


@pytest.fixture
def worker_process(monkeypatch):
    """The test process made ready to play a span worker, and restored after: the thread
    variables at 8, torch a stand-in, SIGINT and SIGTERM handled, no parent-death signal, the
    parent alive (``os.getppid`` 4242) and ``os._exit`` recorded (``exits``), not done."""
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(variable, "8")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    torch = SimpleNamespace(threads=[])
    torch.set_num_threads = torch.threads.append
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(example_annotator, "_WORKER_ANNOTATOR", None)
    exits: list = []

    def exit_(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "getppid", lambda: 4242)
    monkeypatch.setattr(os, "_exit", exit_)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, lambda *_: None)  # a trainer's handler, inherited by fork
    before = parent_death_signal() if LINUX else None
    if LINUX:
        set_parent_death_signal(0)
    try:
        yield SimpleNamespace(torch=torch, exits=exits)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        if LINUX:
            set_parent_death_signal(before)


def parent_death_signal() -> int:
    value = ctypes.c_int(-1)
    assert LIBC.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) == 0
    return value.value


def set_parent_death_signal(number: int) -> None:
    assert LIBC.prctl(PR_SET_PDEATHSIG, number, 0, 0, 0) == 0


THREAD_VARIABLES = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def thread_settings() -> dict:
    return {name: os.environ.get(name) for name in [*THREAD_VARIABLES, "TOKENIZERS_PARALLELISM"]}


def test_a_worker_uses_one_thread_per_library_and_torch_only_where_the_parent_has_it(worker_process, monkeypatch):
    online_spans.limit_worker_threads()
    assert thread_settings() == {**THREAD_VARIABLES, "TOKENIZERS_PARALLELISM": "false"}
    assert worker_process.torch.threads == [1]
    monkeypatch.delitem(sys.modules, "torch")  # a parent that never imported torch
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    online_spans.limit_worker_threads()  # the variables limited again, torch never imported
    assert "torch" not in sys.modules and thread_settings()["OMP_NUM_THREADS"] == "1"


@pytest.mark.skipif(not LINUX, reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_asks_for_sigterm_when_its_parent_dies_and_exits_if_it_already_has(worker_process, monkeypatch):
    online_spans.die_with_parent()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # not the trainer's handler
    assert parent_death_signal() == signal.SIGTERM and worker_process.exits == []
    set_parent_death_signal(0)
    monkeypatch.setattr(os, "getppid", lambda: 1)  # orphaned before prctl: adopted by init
    with pytest.raises(SystemExit):
        online_spans.die_with_parent()
    assert worker_process.exits == [1] and parent_death_signal() == signal.SIGTERM


def test_elsewhere_or_without_prctl_a_worker_only_resets_sigterm(worker_process, monkeypatch):
    monkeypatch.setattr(os, "getppid", lambda: 1)  # would exit if prctl had been reached
    monkeypatch.setattr(sys, "platform", "darwin")
    online_spans.die_with_parent()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and worker_process.exits == []
    if LINUX:
        assert parent_death_signal() == 0
    monkeypatch.setattr(sys, "platform", "linux")
    signal.signal(signal.SIGTERM, lambda *_: None)

    def no_libc(*args, **kwargs):
        raise OSError("no C library")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    online_spans.die_with_parent()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and worker_process.exits == []
    if LINUX:
        assert parent_death_signal() == 0  # neither time asked for


def test_a_worker_is_set_up_with_one_thread_parent_death_and_the_annotator_it_builds(worker_process):
    annotator = IdAnnotator("the worker's")
    online_spans.init_online_worker(lambda: annotator)  # spawn: the worker builds its own
    assert thread_settings() == {**THREAD_VARIABLES, "TOKENIZERS_PARALLELISM": "false"}
    assert worker_process.torch.threads == [1]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # Ctrl-C is the trainer's
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if LINUX:
        assert parent_death_signal() == signal.SIGTERM
    assert ids_of(annotate_in_worker(rows(3, 1))) == [3, 1] and len(annotator.chunks) == 1


# --------------------------------------------------------------------------- the parser


def test_negative_workers_are_refused_and_none_is_the_default(built, pools):
    with pytest.raises(MtaError) as refused:
        SpanParser(SETTINGS, workers=-1)
    assert str(refused.value) == "span workers must be 0 (parse in the training process) or more, got -1"
    parser = SpanParser(SETTINGS)
    assert parser.workers == 0 and parser.settings is SETTINGS
    assert ids_of(parser.parse(rows(2, 0, 1))) == [2, 0, 1] and pools == []  # parsed here: no pool


def test_the_start_method_is_fork_where_there_is_one_else_spawn_and_must_exist(built, monkeypatch):
    if "fork" in multiprocessing.get_all_start_methods():
        assert SpanParser(SETTINGS).start_method == "fork"
    for method in ("spawn", "forkserver"):
        if method in multiprocessing.get_all_start_methods():
            assert SpanParser(SETTINGS, start_method=method).start_method == method
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn", "forkserver"])
    assert SpanParser(SETTINGS).start_method == "spawn"
    for method in ("fork", "threads"):
        with pytest.raises(MtaError) as refused:
            SpanParser(SETTINGS, start_method=method)
        assert str(refused.value) == f"start_method '{method}' is not available here (have: spawn, forkserver)"


def test_the_tokenizers_are_loaded_unless_both_are_given_and_spacy_is_built_at_start(built):
    parser = SpanParser(SETTINGS, workers=0, teacher=Side("t"), student=Side("s"))
    assert built.loads == [] and built.builds == []  # nothing loaded before start
    for given in ({}, {"teacher": Side("t")}, {"student": Side("s")}):
        built.loads.clear()
        SpanParser(SETTINGS, **given)
        assert built.loads == ["teacher-tok", "student-tok"]
    assert parser.start() is parser and parser.start() is parser  # idempotent: built once
    ((args, made),) = built.builds
    assert parser.annotator is made and args[0] is SETTINGS and args[3] == "en_core_web_sm-package"
    assert [side.name for side in args[1:3]] == ["t", "s"]


def test_start_builds_both_byte_tables_for_the_workers_to_inherit_even_if_a_side_cannot_decode(built, pools):
    teacher, student = Side("t"), Side("s", decodes=False)
    SpanParser(SETTINGS, workers=0, teacher=teacher, student=student).start()
    assert teacher.tables_built == 1 and pools == []  # workers=0: no pool
    other = Side("u")
    with SpanParser(SETTINGS, workers=2, teacher=other, student=Side("v")):
        assert other.tables_built == 1 and len(pools) == 1


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_forked_workers_get_the_built_annotator_and_each_is_warmed_up(built, pools):
    parser = SpanParser(SETTINGS, workers=3, start_method="fork", teacher=Side("t"), student=Side("s")).start()
    (pool,) = pools
    assert pool.max_workers == 3 and pool.mp_context.get_start_method() == "fork"
    assert pool.initializer is online_spans.init_online_worker
    assert pool.initargs == (parser.annotator,) and len(built.builds) == 1  # inherited, no second load
    assert pool.tasks == [(annotate_in_worker, ([],))] * 3  # one empty chunk a worker, at start
    assert parser.annotator.chunks == [[]] * 3


def test_spawned_workers_build_their_own_annotator_from_the_same_settings(built, pools):
    teacher, student = Side("t"), Side("s")
    parser = SpanParser(SETTINGS, workers=1, start_method="spawn", teacher=teacher, student=student).start()
    (pool,) = pools
    assert pool.mp_context.get_start_method() == "spawn" and pool.initializer is online_spans.init_online_worker
    (parent_args, parent), (worker_args, worker) = built.builds
    assert worker_args == parent_args == (SETTINGS, teacher, student, "en_core_web_sm-package")
    assert parser.annotator is parent and worker is not parent
    assert ids_of(parser.parse(rows(1, 2))) == [1, 2]
    assert [row.id for row in worker.chunks[-1]] == [1, 2] and parent.chunks == []  # parsed by the worker


def test_a_worker_that_fails_to_start_closes_the_parser(built, pools, monkeypatch):
    def broken(*args):
        raise MtaError("no spaCy model in the worker")

    monkeypatch.setattr(online_spans, "annotate_in_worker", broken)
    parser = SpanParser(SETTINGS, workers=2, teacher=Side("t"), student=Side("s"))
    with pytest.raises(MtaError, match="no spaCy model in the worker"):
        parser.start()
    assert ("shutdown", True) in pools[0].log
    with pytest.raises(RuntimeError) as closed:
        parser.start()
    assert str(closed.value) == "this SpanParser was closed; make a new one"


def test_a_batch_is_split_over_the_workers_in_order_and_comes_back_whole(built, pools):
    with SpanParser(SETTINGS, workers=2, teacher=Side("t"), student=Side("s")) as parser:
        (pool,) = pools
        del pool.tasks[:]
        batch = rows(5, 3, 9, 1, 7)
        pending = parser.submit(batch)
        assert [(fn, [row.id for row in chunk]) for fn, (chunk,) in pool.tasks] == [
            (annotate_in_worker, [5, 3, 9]),
            (annotate_in_worker, [1, 7]),
        ]
        result = pending.result()
        assert ids_of(result) == [5, 3, 9, 1, 7] and result.counts == Counter(rows=5)
        empty = parser.submit([]).result()  # nothing to send: parsed here
        assert len(pool.tasks) == 2 and empty.batch.equals(NO_ROWS)


def test_errors_surface_at_result_as_a_workers_would(built, pools):
    parser = SpanParser(SETTINGS, teacher=Side("t"), student=Side("s"))
    pending = parser.submit(rows(1, -1))  # parsed here, now: the error waits for result()
    with pytest.raises(ValueError, match="bad row"):
        pending.result()
    with SpanParser(SETTINGS, workers=2, teacher=Side("t"), student=Side("s")) as parser:
        pending = parser.submit(rows(1, 2, -1))
        with pytest.raises(ValueError, match="bad row"):
            pending.result()
        pools[0].broken = True
        pending = parser.submit(rows(1))
        with pytest.raises(MtaError, match="a span worker process died"):
            pending.result()


def test_a_queued_batch_times_out_after_the_parsers_timeout_and_is_cancelled_by_close(built, pools):
    parser = SpanParser(SETTINGS, workers=2, teacher=Side("t"), student=Side("s"), result_timeout_s=0.05)
    parser.start()
    pools[0].held = True
    pending = parser.submit(rows(1, 2, 3))
    with pytest.raises(TimeoutError, match=r"within 0\.05 s \(2 of 2 chunks pending\)"):
        pending.result()
    parser.close()
    with pytest.raises(RuntimeError, match="closed before these rows were parsed"):
        pending.result()


def test_close_gives_running_chunks_the_grace_then_terminates_then_kills(built, pools):
    parser = SpanParser(SETTINGS, workers=3, teacher=Side("t"), student=Side("s")).start()
    (pool,) = pools
    pool._processes = {
        pid: Worker(name, stops_on, pool.log)
        for pid, (name, stops_on) in enumerate([("done", "join"), ("busy", "terminate"), ("stuck", "kill")])
    }
    parser.close(grace_s=0.8)
    grace = [entry for entry in pool.log if len(entry) == 3 and entry[2] not in (1.0, 2.0)]
    assert len(grace) == 3 and all(0.4 < timeout <= 0.8 for _, _, timeout in grace)  # 0.8 s in all
    assert [entry if entry not in grace else entry[:2] for entry in pool.log] == [
        ("shutdown", True),  # queued chunks cancelled, the workers not waited for
        *(("join", "done"), ("join", "busy"), ("join", "stuck")),
        *(("terminate", "busy"), ("terminate", "stuck")),
        *(("join", "done", 1.0), ("join", "busy", 1.0), ("join", "stuck", 1.0)),  # a second to go
        *(("kill", "stuck"), ("join", "stuck", 1.0)),
        ("join", "manager", 2.0),  # the pool's own thread, which reaps them too
    ]
    parser.close()  # idempotent: nothing left to stop
    assert pool.log[-1] == ("join", "manager", 2.0) and len(pool.log) == 12
    with pytest.raises(RuntimeError, match="closed; make a new one"):
        parser.start()


def test_close_works_without_the_pools_private_attributes_and_without_a_pool(built, pools):
    parser = SpanParser(SETTINGS, workers=1, teacher=Side("t"), student=Side("s")).start()
    del pools[0]._processes, pools[0]._executor_manager_thread  # another Python's pool
    parser.close(grace_s=0.0)
    assert pools[0].log == [("shutdown", True)]
    parser = SpanParser(SETTINGS, workers=1, teacher=Side("t"), student=Side("s")).start()
    pools[1]._processes = None  # what shutdown() leaves
    parser.close(grace_s=0.0)
    assert pools[1].log == [("shutdown", True), ("join", "manager", 2.0)]
    SpanParser(SETTINGS, teacher=Side("t"), student=Side("s")).close()  # never started


def test_leaving_the_block_closes_with_the_grace_or_at_once_on_an_error(built):
    grace: list = []
    with SpanParser(SETTINGS, teacher=Side("t"), student=Side("s")) as parser:
        assert parser.annotator is built.builds[0][1]  # started on entry
        parser.close = grace.append
    with pytest.raises(KeyboardInterrupt):
        with SpanParser(SETTINGS, teacher=Side("t"), student=Side("s")) as parser:
            parser.close = grace.append
            raise KeyboardInterrupt
    assert grace == [CLOSE_GRACE_S, 0.0] and CLOSE_GRACE_S > 0
