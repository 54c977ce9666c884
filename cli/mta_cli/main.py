"""Entry point of the ``mta`` command: one Typer app, one module per subcommand.

Each subcommand is a typed function whose docstring is its ``--help``; it parses arguments,
calls the library and reports. Errors the user can fix arrive as ``MtaError`` and leave as one
red line and exit code 2, never as a traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from mta.errors import MtaError

app = typer.Typer(
    name="mta",
    help="Multi-Granular Trajectory Alignment: annotate spans, distill, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _register() -> None:
    # Imported here so `import mta_cli.main` stays cheap and a broken subcommand module
    # names itself in the traceback instead of hiding the others.
    from mta_cli import annotate, data, demo, distill, evaluate, generate, models, recipes, show

    app.command("annotate")(annotate.annotate)
    app.command("show")(show.show)
    app.command("distill")(distill.distill)
    app.command("evaluate")(evaluate.evaluate)
    app.command("generate")(generate.generate)
    app.add_typer(models.app, name="models")
    app.add_typer(data.app, name="data")
    app.add_typer(recipes.app, name="recipes")
    app.command("init-student")(models.init_student)
    app.command("demo")(demo.demo)


_register()


def main() -> None:
    try:
        app()
    except MtaError as error:
        Console(stderr=True).print(f"[bold red]error:[/] {error}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
