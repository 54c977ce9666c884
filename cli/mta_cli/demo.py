"""`mta demo` (placeholder: being written)."""

from mta.errors import MtaError


def demo() -> None:
    """Not written yet."""
    raise MtaError("`mta demo` is not written yet")
