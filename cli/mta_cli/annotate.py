"""`mta annotate` (placeholder: being written)."""

from mta.errors import MtaError


def annotate() -> None:
    """Not written yet."""
    raise MtaError("`mta annotate` is not written yet")
