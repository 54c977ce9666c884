"""Input rows: stream a JSONL file, detect its format, and build ``prompt`` and ``response``.

The key that carries the response tells the formats apart: MiniLLM / DistiLLM (``instruction``,
``input``, ``output``, ``prompt``), raw Dolly (``instruction``, ``context``, ``response``), plain
``prompt`` / ``response``, TRL's ``prompt`` / ``completion`` (both strings, or both conversations
with exactly one assistant turn to complete) and ``messages`` (turns ending with the assistant
turn to learn). DistiLLM-2 pair rows (``prompt``, ``chosen``, ``rejected``) become two examples,
ids ``2n`` and ``2n + 1``; the first row decides whether a file holds pairs. The prompt comes from
:func:`mta.data.prompts.build_prompt`. A row that cannot be used becomes a :class:`RowProblem`
naming its line, so the caller stops (``--on-error fail``) or counts it (``skip``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mta.data.prompts import (  # the two reasons a prompt cannot be built are also row reasons
    ALPACA,
    INVALID_CONVERSATION,
    NO_PROMPT,  # noqa: F401 (re-exported: a reason beside the ones below)
    PromptProblem,
    PromptStyle,
    conversation,
    split_conversation,
)
from mta.errors import MtaError

# Why a row was skipped: the keys of the manifest's ``skipped`` counts.
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
INVALID_TEXT = "invalid_text"
PROMPT_TOO_LONG = "prompt_too_long"  # decided later, once the prompt is tokenised
MIXED_FORMATS = "mixed_formats"  # a pair row in a file of single rows, or the other way round
# INVALID_CONVERSATION (bad turns, no final assistant turn) and NO_PROMPT (nothing the template
# builds a prompt from) come from mta.data.prompts.


@dataclass(frozen=True)
class Example:
    """One usable row. ``id`` is its 0-based position among the file's non-blank lines; the two
    halves of the pair on row n have ids 2n (``role`` "chosen") and 2n + 1 ("rejected") and
    ``pair_id`` n (both None outside a pair file)."""

    id: int
    line: int
    prompt: str
    response: str
    pair_id: int | None = None
    role: str | None = None


@dataclass(frozen=True)
class RowProblem:
    """A row that cannot be annotated: ``reason`` is one of the module's reason constants."""

    id: int
    line: int
    reason: str
    message: str

    def describe(self, path: str | Path) -> str:
        return f"{path}:{self.line}: {self.message}"

    def error(self, path: str | Path, skip_hint: str | None = None) -> MtaError:
        return MtaError(f"{self.describe(path)} (fix the row, or {skip_hint or SKIP_HINT})")


Row = Example | RowProblem

# How a command that reads rows skips the bad ones (`mta annotate`, `mta generate`, `mta embed`);
# a caller without that option (`mta distill`) names its own way (``skip_hint``).
SKIP_HINT = "pass --on-error skip to skip and count it"


@dataclass(frozen=True)
class InputSummary:
    """What one pass over the file found: its content hash and its number of rows."""

    sha256: str
    rows: int


class _Invalid(PromptProblem):
    """Raised while reading one row; becomes a RowProblem with the row's line (as does the
    ``PromptProblem`` of a prompt that cannot be built)."""


def string_field(
    record: dict[str, Any],
    key: str,
    *,
    optional: bool = False,
    problem: Callable[[str, str], Exception] = _Invalid,
) -> str | None:
    """``record[key]``, a string; a missing or null one (unless ``optional``: None) or another
    type raises ``problem(reason, message)`` naming the key (and the JSON kind and value)."""
    value = record.get(key)
    if value is None:
        if optional:
            return None
        raise problem(MISSING_FIELD, f"field '{key}' is missing or null")
    if not isinstance(value, str):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise problem(WRONG_TYPE, f"field '{key}' must be a string, got {kind}: {_preview(value)}")
    return value


_JSON_KINDS = {list: "an array", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}


def _preview(value: Any, width: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def prompt_and_response(record: dict[str, Any], style: PromptStyle = ALPACA) -> tuple[str, str]:
    """The (prompt, response) of one decoded row, its prompt built under ``style``; raises
    ``_Invalid`` or ``PromptProblem`` when it has no usable shape."""
    if "output" in record:  # MiniLLM / DistiLLM, Vicuna
        response = string_field(record, "output")
        prompt = _instruction_prompt(record, style, "input")
    elif "response" in record:
        response = string_field(record, "response")
        if "instruction" in record:  # raw Dolly
            prompt = _instruction_prompt(record, style, "context")
        elif "prompt" in record:  # plain prompt / response
            prompt = style.build(prompt=string_field(record, "prompt"))
        else:
            raise _Invalid(
                MISSING_FIELD,
                "a row with 'response' needs 'prompt' (prompt/response rows) or 'instruction' (Dolly rows)",
            )
    elif "completion" in record:  # TRL prompt / completion, standard or conversational
        prompt, response = _trl_prompt_and_completion(record, style)
    elif "messages" in record:  # a conversation ending with the assistant turn to learn
        turns, response = split_conversation(conversation(record["messages"], "messages"), "messages")
        prompt = style.build(turns=turns)
    else:
        keys = ", ".join(sorted(record)) or "none"
        raise _Invalid(
            MISSING_FIELD,
            f"no response field: expected 'output' (MiniLLM rows), 'response' (Dolly or "
            f"prompt/response rows), 'completion' (TRL prompt/completion rows) or 'messages' "
            f"(conversations); the row has keys: {keys}",
        )
    for name, text in (("prompt", prompt), ("response", response)):
        _check_encodable(name, text)
    return prompt, response


def _instruction_prompt(record: dict[str, Any], style: PromptStyle, context_key: str) -> str:
    """The prompt of a MiniLLM, Dolly or pair row: its ``prompt`` under alpaca and none, the
    instruction (+ ``context_key``) when it has no prompt, and the instruction under chat."""
    prompt = string_field(record, "prompt", optional=True)
    instruction = context = None
    if style.template == "chat" or (prompt is None and style.template == "alpaca"):
        instruction = string_field(record, "instruction", optional=prompt is not None)
        if instruction is not None:
            context = string_field(record, context_key, optional=True)
    return style.build(prompt=prompt, instruction=instruction, context=context)


def _trl_prompt_and_completion(record: dict[str, Any], style: PromptStyle) -> tuple[str, str]:
    """TRL's ``prompt`` / ``completion``: two strings, or the prompt's turns and one assistant
    turn."""
    if not isinstance(record.get("completion"), list):
        return style.build(prompt=string_field(record, "prompt")), string_field(record, "completion")
    completion = conversation(record["completion"], "completion")
    if [turn["role"] for turn in completion] != ["assistant"]:
        raise PromptProblem(
            INVALID_CONVERSATION,
            "field 'completion' must hold exactly one assistant turn (the response), got "
            f"{' + '.join(turn['role'] for turn in completion) or 'no turn'}",
        )
    turns = conversation(record.get("prompt"), "prompt")
    if not turns:
        raise PromptProblem(
            INVALID_CONVERSATION, "field 'prompt' holds no turn: there is no prompt before the completion"
        )
    return style.build(turns=turns), completion[0]["content"]


def is_pair_record(record: Any) -> bool:
    """Whether a decoded row is in the pair format (it has ``chosen`` or ``rejected``)."""
    return isinstance(record, dict) and ("chosen" in record or "rejected" in record)


def pair_prompt_and_responses(record: dict[str, Any], style: PromptStyle = ALPACA) -> tuple[str, str, str]:
    """The (prompt, chosen, rejected) of a pair row; raises ``_Invalid`` when it is not one."""
    chosen, rejected = string_field(record, "chosen"), string_field(record, "rejected")
    if record.get("prompt") is None and "instruction" not in record:
        raise _Invalid(MISSING_FIELD, "a pair row with 'chosen' and 'rejected' needs 'prompt' or 'instruction'")
    prompt = _instruction_prompt(record, style, "input")
    for name, text in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        _check_encodable(name, text)
    return prompt, chosen, rejected


def _check_encodable(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _Invalid(
            INVALID_TEXT,
            f"the {name} holds an unpaired surrogate {text[error.start]!r} at character "
            f"{error.start} (a broken \\u escape)",
        ) from None


def _parse_line(raw: bytes, row_id: int, line: int, pairs: bool = False, style: PromptStyle = ALPACA) -> list[Row]:
    """The example(s) of one line (two for a pair row), or its problem; ``pairs``: the file's
    kind, as its first row decides; ``style``: how prompts are built."""
    record = decode_line(raw)
    if isinstance(record, _Invalid):
        return [RowProblem(row_id, line, record.reason, record.message)]
    try:
        if is_pair_record(record) != pairs:
            raise _Invalid(
                MIXED_FORMATS,
                "a pair row (chosen/rejected) in a file whose first row is not one"
                if not pairs
                else "a row without chosen/rejected in a file of pair rows (its first row is one); a "
                "file holds one kind of row",
            )
        if pairs:
            prompt, chosen, rejected = pair_prompt_and_responses(record, style)
            return [
                Example(2 * row_id + half, line, prompt, response, pair_id=row_id, role=role)
                for half, (role, response) in enumerate((("chosen", chosen), ("rejected", rejected)))
            ]
        prompt, response = prompt_and_response(record, style)
    except PromptProblem as invalid:
        return [RowProblem(row_id, line, invalid.reason, invalid.message)]
    return [Example(row_id, line, prompt, response)]


def decode_line(raw: bytes) -> Any:
    """One JSONL line's JSON object, or the ``PromptProblem`` (an ``_Invalid``) saying why it is none."""
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return _Invalid(
            INVALID_UTF8, f"invalid UTF-8: byte 0x{raw[error.start]:02x} at byte {error.start + 1} of the line"
        )
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as error:
        return _Invalid(INVALID_JSON, f"malformed JSON: {_json_problem(error)}")
    except ValueError as error:  # a number past Python's int digit limit (sys.get_int_max_str_digits)
        advice = " (write a number this long as a JSON string)" if "digits" in str(error) else ""
        return _Invalid(INVALID_JSON, f"unreadable JSON: {_one_line(error)}{advice}")
    if not isinstance(record, dict):
        return _Invalid(NOT_AN_OBJECT, f"expected a JSON object, got a {type(record).__name__} ({_preview(record)})")
    return record


def _json_problem(error: json.JSONDecodeError) -> str:
    """``Unterminated string starting at column 9`` / ``Expecting ',' delimiter at column 12``:
    json's message (which leaves its position out) with the column, read as one sentence."""
    where = "" if error.msg.endswith(" at") else " at"
    return f"{error.msg}{where} column {error.colno}"


def _one_line(error: Exception) -> str:
    """An error's text on one line, its advice to change interpreter settings left out."""
    return " ".join(str(error).split("; use sys.set_int_max_str_digits")[0].split())


def _strip_line(number: int, raw: bytes) -> bytes:
    if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
        raw = raw[3:]
    return raw.rstrip(b"\r\n")


def check_input_file(path: Path) -> None:
    """Refuse an input that is not a readable file, saying what it is and what to give instead."""
    if path.is_dir():
        from mta.store.layout import holds_artefact  # either layout (.mta/manifest.json or manifest.json)

        if holds_artefact(path):
            raise MtaError(
                f"{path} is a directory holding an `mta annotate` output, not input rows; annotate "
                "the JSONL file it was made from (its manifest.json records the path under "
                "'input'), or use the directory as it is (`mta show`, a recipe's data.train)"
            )
        found = sorted(p.name for p in path.glob("*.jsonl") if p.is_file())
        hint = (
            f"it holds {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}: e.g. "
            f"`mta annotate {path / found[0]} -o OUT_DIR`"
            if found
            else "give the JSONL file itself (one JSON object per line)"
        )
        raise MtaError(f"the input {path} is a directory, not a JSONL file; {hint}")
    if not path.exists():
        raise MtaError(f"input file not found: {path}")
    if not path.is_file():
        raise MtaError(f"the input {path} is not a regular file; give a JSONL file")


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as error:
        raise MtaError(f"cannot read the input file {path}: {error.strerror}") from error


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes without the newline) of every non-blank line of a JSONL file."""
    with _open(path) as handle:
        for number, raw in enumerate(handle, 1):
            raw = _strip_line(number, raw)
            if raw.strip():
                yield number, raw


def read_rows(path: str | Path, *, shard: int = 0, num_shards: int = 1, style: PromptStyle = ALPACA) -> Iterator[Row]:
    """Stream the rows of ``path`` whose id is ``shard`` modulo ``num_shards``, in file order,
    their prompts built under ``style`` (:mod:`mta.data.prompts`).

    Only the selected rows are decoded, so every shard reads the file but parses its share.
    """
    pairs = None
    for row_id, (line, raw) in enumerate(jsonl_lines(Path(path))):
        if pairs is None:  # the first row decides the file's kind, for every shard
            pairs = is_pair_record(decode_line(raw))
        if row_id % num_shards == shard:
            yield from _parse_line(raw, row_id, line, pairs, style)


def is_pair_file(path: str | Path) -> bool:
    """Whether the file's rows are pairs (its first row decides; see the module docstring)."""
    for _, raw in jsonl_lines(Path(path)):
        return is_pair_record(decode_line(raw))
    return False


def summarize_input(path: str | Path) -> InputSummary:
    """sha256 of the file's bytes and its number of rows, in one streaming pass."""
    digest = hashlib.sha256()
    rows = 0
    with _open(Path(path)) as handle:
        for number, raw in enumerate(handle, 1):
            digest.update(raw)
            rows += bool(_strip_line(number, raw).strip())
    return InputSummary(sha256=digest.hexdigest(), rows=rows)


def first_problem(
    path: str | Path, *, shard: int = 0, num_shards: int = 1, style: PromptStyle = ALPACA
) -> RowProblem | None:
    """The first unusable row of a shard, found before any expensive work starts."""
    rows = read_rows(path, shard=shard, num_shards=num_shards, style=style)
    return next((row for row in rows if isinstance(row, RowProblem)), None)


# --------------------------------------------------------------------------- other column names, other sources
# (mta.data.sources: Parquet, CSV and datasets rows go through the same line parser as JSONL.)

# The keys the row formats read: what a field mapping (data.fields, --field KEY=COLUMN) may
# read an input's other column names as.
FIELD_NAMES = (
    "prompt",
    "response",
    "instruction",
    "input",
    "output",
    "context",
    "chosen",
    "rejected",
    "completion",
    "messages",
)


def field_problems(fields: Mapping[str, Any]) -> list[str]:
    """What is wrong with a ``{format key: input column}`` mapping, one phrase each (none: fine)."""
    problems = []
    for key, column in fields.items():
        if key not in FIELD_NAMES:
            problems.append(f"'{key}' is not a key the row formats read (they read: {', '.join(FIELD_NAMES)})")
        if not isinstance(column, str) or not column:
            problems.append(f"'{key}' must name a column, got {column!r}")
    return problems


def map_fields(record: Any, fields: Mapping[str, str]) -> Any:
    """``record`` with each mapped column under its format key (``{"prompt": "question"}``: the
    value of ``question`` is the prompt). The mapped columns' own names and the format keys'
    original values are dropped, so each key has one value; other columns stay as they are."""
    if not fields or not isinstance(record, dict):
        return record
    columns = set(fields.values())
    mapped = {key: value for key, value in record.items() if key not in columns and key not in fields}
    for key, column in fields.items():
        if column in record:
            mapped[key] = record[column]
    return mapped


def record_bytes(record: Any) -> bytes:
    """A record as the JSON line :func:`read_rows` would parse, so one parser reads every
    source. A value JSON has no type for (a timestamp, bytes) becomes an object naming its
    type: a format key holding one is a wrong-type problem, any other column is unused."""
    return json.dumps(record, default=lambda value: {"unsupported type": type(value).__name__}).encode("utf-8")


def read_mapped_rows(
    path: str | Path,
    fields: Mapping[str, str],
    *,
    shard: int = 0,
    num_shards: int = 1,
    style: PromptStyle = ALPACA,
) -> Iterator[Row]:
    """:func:`read_rows` for a JSONL file whose columns ``fields`` reads as the format keys."""
    pairs = None
    for row_id, (line, raw) in enumerate(jsonl_lines(Path(path))):
        if pairs is None:
            pairs = is_pair_record(map_fields(decode_line(raw), fields))
        if row_id % num_shards == shard:
            record = decode_line(raw)
            if not isinstance(record, _Invalid):
                raw = record_bytes(map_fields(record, fields))
            yield from _parse_line(raw, row_id, line, pairs, style)


def is_mapped_pair_file(path: str | Path, fields: Mapping[str, str]) -> bool:
    """:func:`is_pair_file` with the file's columns read through ``fields``."""
    for _, raw in jsonl_lines(Path(path)):
        return is_pair_record(map_fields(decode_line(raw), fields))
    return False


def record_rows(records: Iterable[tuple[int, Any]], *, pairs: bool, style: PromptStyle = ALPACA) -> Iterator[Row]:
    """The rows of records that are no JSONL lines (Parquet, CSV, datasets rows): ``(index,
    record)`` pairs, columns already mapped, ``pairs`` as the first record decides. The index is
    the row's id and stands where a line number would (``RowProblem.line``)."""
    for index, record in records:
        yield from _parse_line(record_bytes(record), index, index, pairs, style)
