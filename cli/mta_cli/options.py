"""Option types and parsers shared by several commands (``mta annotate``, ``embed``,
``generate``, ``evaluate``)."""

from __future__ import annotations

from enum import Enum

from mta.errors import MtaError


class OnError(str, Enum):
    fail = "fail"
    skip = "skip"


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
