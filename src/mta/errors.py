"""The one exception type the CLI turns into a clean message and a non-zero exit, and the
helper its messages use to name what the user probably meant."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MtaError(Exception):
    """A problem the user can fix: the message names the file, line or key and the fix."""


def close_match(word: str, choices: Iterable[str]) -> str | None:
    """The choice ``word`` most likely misspells (``max-length`` -> ``max_length``), if any."""
    choices = list(choices)
    normal = {choice.lower().replace("-", "_"): choice for choice in choices}
    spelled = str(word).strip().lower().replace("-", "_").replace(" ", "_")
    if spelled in normal:
        return normal[spelled]
    found = difflib.get_close_matches(spelled, choices, n=1, cutoff=0.75)
    return found[0] if found else None
