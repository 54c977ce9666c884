"""`mta recipes ...`: the recipes shipped with mta; list them, copy one out to edit; every key a
recipe may set (`mta recipes keys`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.table import Table

from mta_cli.consoles import stdout_console

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
    stdout_console().print(table)


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
    console = stdout_console()
    console.print(f"[green]copied:[/] {copied.recipe}")
    for file in copied.files:
        note = "  [dim](identical, kept)[/]" if file.unchanged else ""
        console.print(f"  {file.destination}{note}", highlight=False)
    for key, (old, new) in copied.rewritten.items():
        console.print(f"  {key}: {old} -> {new}", highlight=False)
    console.print(f"run it with: mta distill --recipe {copied.recipe}", highlight=False)


@app.command("keys")
def keys(
    section: str = typer.Argument(
        None,
        help="a section (train, loss, data, ...) or a dotted key (train.asam); default: every key",
        show_default=False,
    ),
    task: str = typer.Option(None, "--task", help="llm or embedding; default: both", show_default=False),
    markdown: bool = typer.Option(
        False, "--markdown", help="print docs/recipe-keys.md instead (every key of both tasks, as Markdown)"
    ),
) -> None:
    """Every key a recipe may set, from the schemas: type, default, allowed values, whether a
    `mta distill --resume` may change it, and what it does; one table per task.

    `mta recipes keys --markdown > docs/recipe-keys.md` writes the reference in the repository.
    """
    from mta.training.config.reference import reference_markdown, select_rows

    if markdown:
        if section is not None or task is not None:
            raise typer.BadParameter("--markdown prints the whole reference: give no SECTION or --task with it")
        sys.stdout.write(reference_markdown())
        return
    rows = select_rows(section, task)
    console = stdout_console()
    for name in dict.fromkeys(row.task for row in rows):
        table = Table(title=f"task: {name}", title_justify="left")
        table.add_column("key", style="bold cyan", no_wrap=True)
        table.add_column("type")
        table.add_column("default")
        table.add_column("allowed")
        table.add_column("resume")
        table.add_column("description")
        for row in rows:
            if row.task == name:
                resume = "[green]yes[/]" if row.resumable else "no"
                table.add_row(row.key, row.type, row.default, row.allowed, resume, row.description)
        console.print(table)
