"""`mta recipes ...`: the recipes shipped with mta; list them, copy one out to edit."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="The recipes shipped with mta: `mta distill --recipe NAME` runs one by name.",
    no_args_is_help=True,
)


@app.command("list")
def list_recipes() -> None:
    """List the shipped recipes: name and the first line of each file's header comment.

    Run one with `mta distill --recipe NAME`; copy one to edit with `mta recipes copy NAME`.
    """
    from mta.training.config.catalog import SHIPPED_DIR, shipped_recipes

    table = Table(title=f"shipped recipes ({SHIPPED_DIR})", title_justify="left")
    table.add_column("name", style="bold cyan", no_wrap=True)
    table.add_column("description")
    for recipe in shipped_recipes():
        table.add_row(recipe.name, recipe.description)
    Console().print(table)


@app.command("copy")
def copy(
    name: str = typer.Argument(..., help="a shipped recipe (`mta recipes list`)", show_default=False),
    dest: Path = typer.Argument(Path("."), help="directory to copy into"),
    force: bool = typer.Option(False, "--force", help="overwrite files that exist and differ"),
) -> None:
    """Copy a shipped recipe to DEST/NAME.yaml with every file it names (architecture configs,
    example rows) beside it, its relative paths pointing at the copies; comments are kept.

    Existing files that differ are not overwritten unless --force. Then edit the copy and run
    `mta distill --recipe DEST/NAME.yaml`.
    """
    from mta.training.config.catalog import copy_recipe

    copied = copy_recipe(name, dest, force=force)
    console = Console()
    console.print(f"[green]copied:[/] {copied.recipe}")
    for file in copied.files:
        note = "  [dim](identical, kept)[/]" if file.unchanged else ""
        console.print(f"  {file.destination}{note}", highlight=False)
    for key, (old, new) in copied.rewritten.items():
        console.print(f"  {key}: {old} -> {new}", highlight=False)
    console.print(f"run it with: mta distill --recipe {copied.recipe}", highlight=False)
