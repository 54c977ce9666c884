"""Spans of responses sampled during training, parsed while the step runs (docs/method.md §1).

A :class:`~mta.data.example_annotator.GeneratedRow` goes through annotate's own
``ExampleAnnotator`` (the same phrases, word spans and rules) into the artefact's row; only the
text differs: the generating side's ids are kept as generated and ``text`` is their decoded text
(:meth:`mta.data.encoding.TokenizerSide.decode_with_offsets`). :class:`SpanParser` runs it in a pool
of annotate's worker processes (``submit`` after generation, ``result()`` before the loss;
``workers=0``: in this process, the same rows); its use: docs/python-api.md.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool

import pyarrow as pa

from mta.data.annotate import AnnotateSettings, build_annotator
from mta.data.artefact_schema import SCHEMA
from mta.data.encoding import TokenizerSide
from mta.data.example_annotator import (
    ChunkResult,
    ExampleAnnotator,
    GeneratedRow,
    annotate_in_worker,
    init_annotator_worker,
)
from mta.data.span_extraction import resolve_spacy_model
from mta.errors import MtaError

__all__ = [
    "GeneratedRow",
    "PendingSpans",
    "SpanParser",
    "annotate_generated",
    "generated_row",
    "online_annotator",
]

RESULT_TIMEOUT_S = 600.0  # how long result() waits by default before it gives up on the workers
CLOSE_GRACE_S = 5.0  # how long close() lets a busy worker finish before it is terminated
_PR_SET_PDEATHSIG = 1


def load_sides(settings: AnnotateSettings) -> tuple[TokenizerSide, TokenizerSide]:
    """The (teacher, student) tokenizers of ``settings``, one object when they are the same
    (as ``mta annotate`` loads them)."""
    teacher = TokenizerSide.load(settings.teacher)
    student = teacher if settings.student == settings.teacher else TokenizerSide.load(settings.student)
    return teacher, student


def online_annotator(
    settings: AnnotateSettings,
    teacher: TokenizerSide | None = None,
    student: TokenizerSide | None = None,
) -> ExampleAnnotator:
    """The annotator ``mta annotate`` builds for ``settings`` (spaCy model, word spans), in this
    process; the tokenizers are loaded unless given."""
    if teacher is None or student is None:
        teacher, student = load_sides(settings)
    return build_annotator(settings, teacher, student, resolve_spacy_model(settings.spacy_model)[0])


def annotate_generated(annotator: ExampleAnnotator, rows: Sequence[GeneratedRow]) -> ChunkResult:
    """The artefact rows of generated rows, in order, in this process: ``batch`` has ``SCHEMA``
    and one row per ``rows`` entry; ``counts`` as annotate's (``response_cut`` = unfinished)."""
    return annotator.annotate(list(rows))


def generated_row(
    annotator: ExampleAnnotator,
    prompt: str,
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    *,
    finished: bool | None = None,
    side: str = "student",
    id: int = 0,
) -> dict:
    """One generated row as ``mta annotate`` writes it, as a dict of column -> value (what
    ``read_annotations(...).table.to_pylist()`` gives for a row). See :class:`GeneratedRow`."""
    row = GeneratedRow(prompt, prompt_ids, generated_ids, finished=finished, side=side, id=id)
    return annotate_generated(annotator, [row]).batch.to_pylist()[0]


def merge_results(results: Sequence[ChunkResult]) -> ChunkResult:
    """Chunk results in order as one: batches concatenated, counts summed."""
    counts: Counter = Counter()
    skipped = []
    for result in results:
        counts.update(result.counts)
        skipped.extend(result.skipped)
    if len(results) == 1:
        return ChunkResult(batch=results[0].batch, skipped=skipped, counts=counts)
    batches = [result.batch for result in results]
    batch = pa.concat_batches(batches) if batches else pa.RecordBatch.from_pylist([], schema=SCHEMA)
    return ChunkResult(batch=batch, skipped=skipped, counts=counts)


class PendingSpans:
    """A submitted batch: :meth:`result` waits for its rows (the chunks' futures, in order)."""

    def __init__(self, futures: Sequence[concurrent.futures.Future], timeout_s: float):
        self._futures = list(futures)
        self._timeout_s = timeout_s

    def done(self) -> bool:
        return all(future.done() for future in self._futures)

    def result(self, timeout: float | None = None) -> ChunkResult:
        """The rows of the batch, in submission order (``batch``: ``SCHEMA``, one row per
        submitted row). Raises what a worker raised, ``MtaError`` when a worker died,
        ``RuntimeError`` when the parser was closed first, and ``TimeoutError`` after ``timeout``
        seconds (default: the parser's ``result_timeout_s``)."""
        timeout = self._timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        results: list[ChunkResult] = []
        try:
            # One future at a time: concurrent.futures.wait() never counts a future that
            # shutdown(cancel_futures=True) cancelled as done, future.result() raises at once.
            for future in self._futures:
                results.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"span parsing gave no answer within {timeout:g} s ({len(self._futures) - len(results)} "
                f"of {len(self._futures)} chunks pending); the span workers may be stuck: use "
                "SpanParser(workers=0) to parse in the training process"
            ) from None
        except concurrent.futures.CancelledError as error:
            raise RuntimeError("the SpanParser was closed before these rows were parsed") from error
        except BrokenProcessPool as error:
            raise MtaError(
                "a span worker process died (out of memory, or the parser was closed while it "
                "worked); the parser cannot go on: restart the run with fewer span workers or "
                "workers=0"
            ) from error
        return merge_results(results)


def _completed(result: ChunkResult | None = None, error: BaseException | None = None) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future


def limit_worker_threads() -> None:
    """One core per worker: no OpenMP/BLAS/torch thread pools and no Rust tokenizer threads.
    A worker forked from a trainer inherits torch's settings but must not enter a parallel
    region whose threads did not survive the fork."""
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch = sys.modules.get("torch")  # never imported here: only limited where the parent has it
    if torch is not None:
        torch.set_num_threads(1)


def die_with_parent() -> None:
    """Ask Linux to end this worker when the process that started it dies (even by SIGKILL), so
    a crashed trainer leaves no parsers behind; elsewhere nothing is done."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's handler, inherited by fork
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was already gone before prctl took effect
        os._exit(1)


def init_online_worker(source: ExampleAnnotator | Callable[[], ExampleAnnotator]) -> None:
    """A span worker's initializer: one thread, ended with its trainer, ``source``'s annotator."""
    limit_worker_threads()
    die_with_parent()
    init_annotator_worker(source)  # SIGINT left to the trainer; the annotator installed


def split_rows(rows: Sequence[GeneratedRow], parts: int) -> list[list[GeneratedRow]]:
    """``rows`` in at most ``parts`` contiguous chunks of near-equal size, in order."""
    size = max(1, math.ceil(len(rows) / max(parts, 1)))
    return [list(rows[start : start + size]) for start in range(0, len(rows), size)]


class SpanParser:
    """Parses generated rows into artefact rows, in worker processes while the trainer works.

    settings: what decides the spans and the tokenizers (``AnnotateSettings.from_recipe``);
    its ``workers`` is ignored, this class's ``workers`` counts the processes (0: parse in the
    calling process at :meth:`submit`). teacher / student: already loaded tokenizers, else
    loaded from ``settings``. start_method: "fork" (default where available: the workers
    inherit spaCy and the vocabulary tables, no second load) or "spawn" (each worker loads
    them; nothing is inherited from the trainer). result_timeout_s: how long
    :meth:`PendingSpans.result` waits by default.

    Use it as a context manager, started once per run, ideally before the models are loaded and
    DeepSpeed starts its threads: the workers are forked at :meth:`start` (all at once: they
    are never forked again), use one thread each and no torch threads, ignore Ctrl-C (the
    trainer's to handle), and end with the trainer even when it is killed (Linux: when the
    thread that started them ends, so start it from the thread that trains). "spawn" needs the
    launching script's ``if __name__ == "__main__":`` guard, as multiprocessing always does.
    :meth:`close`
    cancels what is queued, lets running chunks finish for ``CLOSE_GRACE_S`` (none when the
    block is left by an exception) and then terminates the workers, so leaving the block never
    waits on a stuck worker.
    """

    def __init__(
        self,
        settings: AnnotateSettings,
        *,
        workers: int = 0,
        teacher: TokenizerSide | None = None,
        student: TokenizerSide | None = None,
        start_method: str | None = None,
        result_timeout_s: float = RESULT_TIMEOUT_S,
    ):
        if workers < 0:
            raise MtaError(f"span workers must be 0 (parse in the training process) or more, got {workers}")
        methods = multiprocessing.get_all_start_methods()
        start_method = start_method or ("fork" if "fork" in methods else "spawn")
        if start_method not in ("fork", "spawn", "forkserver") or start_method not in methods:
            raise MtaError(f"start_method '{start_method}' is not available here (have: {', '.join(methods)})")
        if teacher is None or student is None:
            teacher, student = load_sides(settings)
        self.settings = settings
        self.workers = workers
        self.start_method = start_method
        self.result_timeout_s = result_timeout_s
        self._sides = (teacher, student)
        self._build = functools.partial(
            build_annotator, settings, teacher, student, resolve_spacy_model(settings.spacy_model)[0]
        )
        self._annotator: ExampleAnnotator | None = None
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> SpanParser:
        """Load spaCy (and, with workers, start and wait for them). Idempotent."""
        if self._closed:
            raise RuntimeError("this SpanParser was closed; make a new one")
        if self._annotator is not None:
            return self
        self._annotator = self._build()
        for side in self._sides:  # built here so forked workers inherit the tables
            try:
                _ = side.token_bytes
            except MtaError:
                pass  # a side that cannot decode is refused when a row asks it to
        if self.workers:
            fork = self.start_method == "fork"
            self._executor = concurrent.futures.ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context(self.start_method),
                initializer=init_online_worker,
                initargs=(self._annotator if fork else self._build,),
            )
            try:
                # Forks every worker now (not in the middle of a step) and checks they came up.
                warm = [self._executor.submit(annotate_in_worker, []) for _ in range(self.workers)]
                PendingSpans(warm, self.result_timeout_s).result()
            except BaseException:
                self.close()
                raise
        return self

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stop the workers: queued chunks are cancelled, running ones get ``grace_s`` seconds
        in all, then their workers are terminated (killed a second later if need be).
        Idempotent; never blocks longer than ``grace_s`` plus a few seconds."""
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is None:
            return
        # The executor has no public way to stop a worker (Python 3.14 adds terminate_workers).
        processes = list((getattr(executor, "_processes", None) or {}).values())
        manager = getattr(executor, "_executor_manager_thread", None)  # shutdown() forgets it
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        # The executor's own thread reaps the workers too; once it is done no child is left.
        if manager is not None:
            manager.join(2.0)

    def __enter__(self) -> SpanParser:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # Leaving on an error (Ctrl-C included): nothing will collect the rows, stop at once.
        self.close(CLOSE_GRACE_S if exc_type is None else 0.0)

    # ------------------------------------------------------------------ work

    @property
    def annotator(self) -> ExampleAnnotator:
        """The in-process annotator (what workers=0 and the forked workers use)."""
        self.start()
        assert self._annotator is not None
        return self._annotator

    def submit(self, rows: Sequence[GeneratedRow]) -> PendingSpans:
        """Start parsing ``rows`` (split over the workers) and return at once; with workers=0
        the rows are parsed here, now. Errors surface at :meth:`PendingSpans.result`."""
        annotator = self.annotator
        rows = list(rows)
        if self._executor is None or not rows:
            try:
                return PendingSpans([_completed(annotator.annotate(rows))], self.result_timeout_s)
            except Exception as error:  # reported where a worker's error would be
                return PendingSpans([_completed(error=error)], self.result_timeout_s)
        try:
            futures = [self._executor.submit(annotate_in_worker, chunk) for chunk in split_rows(rows, self.workers)]
        except BrokenProcessPool as error:
            futures = [_completed(error=error)]
        return PendingSpans(futures, self.result_timeout_s)

    def parse(self, rows: Sequence[GeneratedRow]) -> ChunkResult:
        """:meth:`submit` and wait."""
        return self.submit(rows).result()
