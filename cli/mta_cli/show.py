"""`mta show` (placeholder: being written)."""

from mta.errors import MtaError


def show() -> None:
    """Not written yet."""
    raise MtaError("`mta show` is not written yet")
