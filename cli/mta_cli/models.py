"""`mta models ...` and `mta init-student` (placeholder: being written)."""

import typer

from mta.errors import MtaError

app = typer.Typer(help="Fetch, convert and build models.", no_args_is_help=True)


def init_student() -> None:
    """Not written yet."""
    raise MtaError("`mta init-student` is not written yet")
