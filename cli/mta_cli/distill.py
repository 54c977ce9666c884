"""`mta distill` (placeholder: being written)."""

from mta.errors import MtaError


def distill() -> None:
    """Not written yet."""
    raise MtaError("`mta distill` is not written yet")
