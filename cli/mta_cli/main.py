"""Entry point of the ``mta`` command: one Typer app, one module per subcommand.

Each subcommand is a typed function whose docstring is its ``--help``; it parses arguments,
calls the library and reports. Errors the user can fix arrive as ``MtaError`` and leave as one
red line and exit code 2, never as a traceback.

Start-up: ``mta --help``, ``--version``, ``mta recipes ...`` and every ``--help`` import neither
torch nor the library's stages (each command imports what it uses inside its function;
``tests/test_startup_imports.py``). Exit: once the command has run, the objects still alive are
frozen (``gc.freeze``, an ``atexit`` hook), so the interpreter's final garbage collections skip
the half million objects torch and transformers hold (about 1 s on the development machine).
Everything is closed or flushed by then; only unreachable cycles are left to the operating
system, as on ``os._exit``.
"""

from __future__ import annotations

import atexit
import gc
import sys
from typing import Annotated

import typer
from rich.text import Text

from mta.errors import MtaError
from mta_cli.consoles import stderr_console
from mta_cli.options import render_deprecations

app = typer.Typer(
    name="mta",
    help="Multi-Granular Trajectory Alignment: annotate spans, distill, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def mta_version() -> str:
    """The installed package's version (``mta.versions``), else the source tree's."""
    from mta.versions import package_versions

    found = package_versions(("mta",))["mta"]
    if found is None:
        from mta import __version__ as found
    return found


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"mta {mta_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print mta's version and exit.")
    ] = False,
) -> None:
    pass


def _flags_show_no_type() -> None:
    """Needed: Typer's rich help (0.29) prints ``<bool>`` beside flags, which take no value."""
    from typer.core import TyperOption

    original = getattr(TyperOption, "display_type_rich", None)
    if original is None or getattr(original, "flags_show_no_type", False):
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return original(self, ctx)

    display_type_rich.flags_show_no_type = True
    TyperOption.display_type_rich = display_type_rich


_flags_show_no_type()


def _register() -> None:
    # Imported here so `import mta_cli.main` stays cheap and a broken subcommand module
    # names itself in the traceback instead of hiding the others.
    from mta_cli.commands import (
        annotate,
        data,
        demo,
        demo_embed,
        distill,
        embed,
        evaluate,
        generate,
        inspect,
        models,
        push,
        recipes,
        show,
        teacher,
    )

    app.command("annotate")(annotate.annotate)
    app.command("embed")(embed.embed)
    app.command("teacher")(teacher.teacher)
    app.command("show")(show.show)
    app.command("distill")(distill.distill)
    app.command("evaluate")(evaluate.evaluate)
    app.command("generate")(generate.generate)
    app.command("inspect")(inspect.inspect)
    app.command("push")(push.push)
    app.add_typer(models.app, name="models")
    app.add_typer(data.app, name="data")
    app.add_typer(recipes.app, name="recipes")
    app.command("init-student")(models.init_student)
    app.command("demo")(demo.demo)
    app.command("demo-embed")(demo_embed.demo_embed)


_register()


_FREEZE_AT_EXIT: list[bool] = []  # registered once per process


def main() -> None:
    render_deprecations()  # an old recipe key: the same one line as an old option
    if not _FREEZE_AT_EXIT:
        atexit.register(gc.freeze)  # runs after the handlers torch, DeepSpeed or trackers register
        _FREEZE_AT_EXIT.append(True)
    try:
        app()
    except MtaError as error:
        # Text, not markup: a message quotes keys such as loss.layers[0]; one line in a log.
        stderr_console().print(Text.assemble(("error:", "bold red"), f" {error}"), soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
