"""Option types and parsers shared by several commands (``mta annotate``, ``embed``,
``generate``, ``evaluate``)."""

from __future__ import annotations

from enum import Enum

import typer

from mta.errors import MtaError


class OnError(str, Enum):
    fail = "fail"
    skip = "skip"


class EngineChoice(str, Enum):  # mta.generation.vllm_engine.ENGINES
    hf = "hf"
    vllm = "vllm"


ENGINE_OPTION = typer.Option(
    EngineChoice.hf,
    "--engine",
    help="Generation engine: hf (transformers) or vllm (its own environment: `make install-vllm`, or "
    "MTA_VLLM_PYTHON). Sampled rows agree in distribution, not row for row; greedy ones agree.",
)


class TemplateChoice(str, Enum):  # mta.data.prompts.TEMPLATES
    alpaca = "alpaca"
    chat = "chat"
    none = "none"


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard I/N`` as ``(I, N)``; ``MtaError`` showing the form when it is not one."""
    index, sep, count = text.partition("/")
    try:
        if not sep:
            raise ValueError
        return int(index), int(count)
    except ValueError:
        raise MtaError(f"--shard '{text}' must look like I/N, e.g. 0/8 (I counts from 0)") from None


def deprecated_alias(new_value, old_value, *, old: str, new: str):
    """The value of an option given by its new spelling ``new`` or by its old one ``old``, a
    hidden alias kept until ``mta.deprecation.REMOVED_IN``: the old one prints the deprecation
    line on stderr. Both given with different values is an ``MtaError``."""
    if old_value is None:
        return new_value
    if new_value is not None and new_value != old_value:
        raise MtaError(f"{old} is the old spelling of {new}: give one of them")
    import sys

    from mta.deprecation import message

    print(f"warning: {message(old, new)}", file=sys.stderr, flush=True)
    return old_value


# --force of a stage whose output is a cache (annotate, embed).
FORCE_CACHE_OPTION = typer.Option(
    False,
    "--force",
    help="Recompute even if a matching artefact exists (a cache: not `mta distill --overwrite`, "
    "which removes another run's outputs).",
)


def render_deprecations() -> None:
    """Show mta's deprecation warnings (an old recipe key) as the one line an old option prints."""
    import sys
    import warnings

    from mta.deprecation import MtaDeprecationWarning

    shown = warnings.showwarning
    if getattr(shown, "renders_deprecations", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, MtaDeprecationWarning):
            print(f"warning: {message}", file=sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    show.renders_deprecations = True  # type: ignore[attr-defined]
    warnings.showwarning = show


# A Hugging Face Hub dataset id in place of a data file (mta.data.sources.input_reference).
SPLIT_OPTION = typer.Option(
    None, "--split", help="The split of a Hub dataset id (owner/name) [default: train]; not used for a local file."
)
SUBSET_OPTION = typer.Option(None, "--subset", help="The subset (datasets' config name) of a Hub dataset id.")
REVISION_OPTION = typer.Option(
    None, "--revision", help="The branch, tag or commit of a Hub dataset id [default: main]; the commit is recorded."
)


def parse_fields(texts: list[str] | None) -> dict[str, str] | None:
    """``--field KEY=COLUMN`` options as ``{KEY: COLUMN}`` (None when none is given)."""
    if not texts:
        return None
    fields = {}
    for text in texts:
        key, sep, column = text.partition("=")
        if not sep or not key.strip() or not column.strip():
            raise MtaError(f"--field '{text}' must look like KEY=COLUMN, e.g. --field prompt=question")
        fields[key.strip()] = column.strip()
    return fields
