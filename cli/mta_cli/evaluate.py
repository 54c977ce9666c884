"""`mta evaluate` (placeholder: being written)."""

from mta.errors import MtaError


def evaluate() -> None:
    """Not written yet."""
    raise MtaError("`mta evaluate` is not written yet")
