"""Input rows: stream a JSONL file, detect its format, and build ``prompt`` and ``response``.

Three row formats are accepted, told apart by the key that carries the response:

- MiniLLM / DistiLLM: ``instruction``, optional ``input``, ``output``, optional ``prompt``
  (Vicuna rows have no ``input``);
- raw Dolly: ``instruction``, ``context``, ``response`` (and ``category``, unused);
- plain: ``prompt``, ``response``.

And one pair format (DistiLLM-2, what ``mta generate`` writes): ``prompt`` (or ``instruction``
+ optional ``input``), ``chosen`` (the teacher's response), ``rejected`` (the student's),
optional ``id``. Each pair row becomes two examples, ``chosen`` then ``rejected``, with ids
``2·n`` and ``2·n + 1`` (n: the row's position) and ``pair_id`` n. A file holds pair rows only
or none: the first row decides, and a row of the other kind is a problem naming its line.

Rows without a ``prompt`` get the Alpaca prompt of docs/method.md §1. A row that cannot be
used becomes a :class:`RowProblem` naming its line and what is wrong, so the caller decides
whether to stop (``--on-error fail``) or count it and go on (``skip``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Union

from mta.data.prompts import alpaca_prompt
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

    def error(self, path: str | Path) -> MtaError:
        return MtaError(
            f"{self.describe(path)} (fix the row, or pass --on-error skip to skip and count it)"
        )


Row = Union[Example, RowProblem]


@dataclass(frozen=True)
class InputSummary:
    """What one pass over the file found: its content hash and its number of rows."""

    sha256: str
    rows: int


class _Invalid(Exception):
    """Raised while reading one row; becomes a RowProblem with the row's line."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def _field(record: dict[str, Any], key: str, *, optional: bool = False) -> str | None:
    value = record.get(key)
    if value is None:
        if optional:
            return None
        raise _Invalid(MISSING_FIELD, f"field '{key}' is missing or null")
    if not isinstance(value, str):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise _Invalid(WRONG_TYPE, f"field '{key}' must be a string, got {kind}: {_preview(value)}")
    return value


_JSON_KINDS = {list: "an array", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}


def _preview(value: Any, width: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def prompt_and_response(record: dict[str, Any]) -> tuple[str, str]:
    """The (prompt, response) of one decoded row; raises ``_Invalid`` when it has no usable shape."""
    if "output" in record:  # MiniLLM / DistiLLM, Vicuna
        response = _field(record, "output")
        prompt = _field(record, "prompt", optional=True)
        if prompt is None:
            prompt = alpaca_prompt(_field(record, "instruction"), _field(record, "input", optional=True))
    elif "response" in record:
        response = _field(record, "response")
        if "prompt" in record:  # plain prompt / response
            prompt = _field(record, "prompt")
        elif "instruction" in record:  # raw Dolly
            prompt = alpaca_prompt(
                _field(record, "instruction"), _field(record, "context", optional=True)
            )
        else:
            raise _Invalid(
                MISSING_FIELD,
                "a row with 'response' needs 'prompt' (prompt/response rows) or 'instruction' "
                "(Dolly rows)",
            )
    else:
        keys = ", ".join(sorted(record)) or "none"
        raise _Invalid(
            MISSING_FIELD,
            f"no response field: expected 'output' (MiniLLM rows) or 'response' (Dolly or "
            f"prompt/response rows); the row has keys: {keys}",
        )
    for name, text in (("prompt", prompt), ("response", response)):
        _check_encodable(name, text)
    return prompt, response


def is_pair_record(record: Any) -> bool:
    """Whether a decoded row is in the pair format (it has ``chosen`` or ``rejected``)."""
    return isinstance(record, dict) and ("chosen" in record or "rejected" in record)


def pair_prompt_and_responses(record: dict[str, Any]) -> tuple[str, str, str]:
    """The (prompt, chosen, rejected) of a pair row; raises ``_Invalid`` when it is not one."""
    chosen, rejected = _field(record, "chosen"), _field(record, "rejected")
    prompt = _field(record, "prompt", optional=True)
    if prompt is None:
        if "instruction" not in record:
            raise _Invalid(MISSING_FIELD, "a pair row with 'chosen' and 'rejected' needs 'prompt' or 'instruction'")
        prompt = alpaca_prompt(_field(record, "instruction"), _field(record, "input", optional=True))
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


def _parse_line(raw: bytes, row_id: int, line: int, pairs: bool = False) -> list[Row]:
    """The example(s) of one line (two for a pair row), or its problem; ``pairs``: the file's
    kind, as its first row decides."""
    record = _decoded(raw)
    if isinstance(record, _Invalid):
        return [RowProblem(row_id, line, record.reason, record.message)]
    try:
        if is_pair_record(record) != pairs:
            raise _Invalid(
                MIXED_FORMATS,
                "a pair row (chosen/rejected) in a file whose first row is not one" if not pairs else
                "a row without chosen/rejected in a file of pair rows (its first row is one); a "
                "file holds one kind of row",
            )
        if pairs:
            prompt, chosen, rejected = pair_prompt_and_responses(record)
            return [Example(2 * row_id + half, line, prompt, response, pair_id=row_id, role=role)
                    for half, (role, response) in enumerate((("chosen", chosen), ("rejected", rejected)))]
        prompt, response = prompt_and_response(record)
    except _Invalid as invalid:
        return [RowProblem(row_id, line, invalid.reason, invalid.message)]
    return [Example(row_id, line, prompt, response)]


def _decoded(raw: bytes) -> Any:
    """One line's JSON object, or the ``_Invalid`` saying why it is none."""
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return _Invalid(INVALID_UTF8, f"invalid UTF-8: byte 0x{raw[error.start]:02x} at byte {error.start + 1} of the line")
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as error:
        return _Invalid(INVALID_JSON, f"malformed JSON at column {error.colno}: {error.msg}")
    if not isinstance(record, dict):
        return _Invalid(NOT_AN_OBJECT, f"expected a JSON object, got a {type(record).__name__} ({_preview(record)})")
    return record


def _strip_line(number: int, raw: bytes) -> bytes:
    if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
        raw = raw[3:]
    return raw.rstrip(b"\r\n")


def check_input_file(path: Path) -> None:
    """Refuse an input that is not a readable file, saying what it is and what to give instead."""
    if path.is_dir():
        if (path / "manifest.json").is_file():
            raise MtaError(
                f"{path} is a directory holding an `mta annotate` output, not input rows; annotate "
                "the JSONL file it was made from (its manifest.json records the path under "
                "'input'), or use the directory as it is (`mta show`, a recipe's data.train)"
            )
        found = sorted(p.name for p in path.glob("*.jsonl") if p.is_file())
        hint = (
            f"it holds {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}: e.g. "
            f"`mta annotate {path / found[0]} -o OUT_DIR`"
            if found else "give the JSONL file itself (one JSON object per line)"
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


def _data_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes without the newline) of every non-blank line."""
    with _open(path) as handle:
        for number, raw in enumerate(handle, 1):
            raw = _strip_line(number, raw)
            if raw.strip():
                yield number, raw


def read_rows(path: str | Path, *, shard: int = 0, num_shards: int = 1) -> Iterator[Row]:
    """Stream the rows of ``path`` whose id is ``shard`` modulo ``num_shards``, in file order.

    Only the selected rows are decoded, so every shard reads the file but parses its share.
    """
    pairs = None
    for row_id, (line, raw) in enumerate(_data_lines(Path(path))):
        if pairs is None:  # the first row decides the file's kind, for every shard
            pairs = is_pair_record(_decoded(raw))
        if row_id % num_shards == shard:
            yield from _parse_line(raw, row_id, line, pairs)


def is_pair_file(path: str | Path) -> bool:
    """Whether the file's rows are pairs (its first row decides; see the module docstring)."""
    for _, raw in _data_lines(Path(path)):
        return is_pair_record(_decoded(raw))
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


def first_problem(path: str | Path, *, shard: int = 0, num_shards: int = 1) -> RowProblem | None:
    """The first unusable row of a shard, found before any expensive work starts."""
    rows = read_rows(path, shard=shard, num_shards=num_shards)
    return next((row for row in rows if isinstance(row, RowProblem)), None)
