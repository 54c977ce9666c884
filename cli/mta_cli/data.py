"""`mta data ...` (placeholder: being written)."""

import typer

app = typer.Typer(help="Fetch the evaluation sets.", no_args_is_help=True)
