"""Output that survives a pipe (issue 50): when stdout or stderr is not a terminal, rich tables
come out whole and messages are one line, never folded at 80 columns nor cut with "…".

Each table mta prints is rendered here through a console whose file is not a terminal (in this
process), one real command runs through a pipe, and a check that every command prints through
``mta_cli.consoles`` (a console made elsewhere would wrap at 80 again) is shown to trip.
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
from pathlib import Path

from rich.table import Table
from typer.testing import CliRunner

from conftest import REPO, subprocess_env
from mta_cli.consoles import PIPE_WIDTH, WholeConsole, stdout_console
from mta_cli.main import app

LONG = "a description long enough to be folded or cut at eighty columns, " * 3
CLI = REPO / "cli" / "mta_cli"


def rendered(renderable) -> str:
    buffer = io.StringIO()  # not a terminal
    WholeConsole(file=buffer).print(renderable)
    return buffer.getvalue()


def lines_with(text: str, *cells: str) -> list[str]:
    """The lines of ``text`` holding every one of ``cells`` whole."""
    return [line for line in text.splitlines() if all(cell in line for cell in cells)]


def test_a_console_not_on_a_terminal_keeps_table_rows_and_messages_whole():
    table = Table(title="t")
    for column in ("key", "description"):
        table.add_column(column)
    table.add_row("train.some_long_key_name", LONG.strip())
    text = rendered(table)
    assert len(lines_with(text, "train.some_long_key_name", LONG.strip())) == 1, text
    assert "…" not in text
    message = "error: " + LONG * 3
    assert rendered(message).strip() == message.strip()
    assert stdout_console(file=io.StringIO()).width == PIPE_WIDTH
    # On a terminal the width is the terminal's, as before.
    assert WholeConsole(file=io.StringIO(), force_terminal=True, width=90).width == 90


def test_the_plain_console_rich_gives_would_fold_the_same_table():
    # The planted case: rich's own console, not a terminal, folds at 80 (what issue 50 saw).
    from rich.console import Console

    table = Table()
    table.add_column("key")
    table.add_column("description")
    table.add_row("train.some_long_key_name", LONG.strip())
    buffer = io.StringIO()
    Console(file=buffer).print(table)
    assert not lines_with(buffer.getvalue(), LONG.strip())


runner = CliRunner()


def test_recipes_tables_whole_in_process():
    from mta.training.config.catalog import shipped_recipes
    from mta.training.config.reference import select_rows

    listed = runner.invoke(app, ["recipes", "list"])
    assert listed.exit_code == 0, listed.output
    for recipe in shipped_recipes():
        assert lines_with(listed.stdout, recipe.name, recipe.description), recipe.name
    keys = runner.invoke(app, ["recipes", "keys", "train"])
    assert keys.exit_code == 0, keys.output
    for row in select_rows("train"):
        assert lines_with(keys.stdout, row.key, row.description), row.key


def test_dry_run_plan_whole_in_process():
    result = runner.invoke(app, ["distill", "--recipe", str(REPO / "recipes" / "tiny.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert lines_with(result.stdout, "estimated memory per device (ZeRO-", "without CUDA context and buffers)")


def test_the_commands_own_tables_whole_through_a_non_terminal_console():
    from mta_cli.commands.annotate import print_summary
    from mta_cli.commands.show import span_table
    from mta_cli.results import comparison_table

    long_name = "runs/" + "very-long-directory-name/" * 6 + "final"
    text = rendered(comparison_table("evaluate", ["model", "dolly ROUGE-L"], [[long_name, "12.34 ± 0.56"]]))
    assert lines_with(text, long_name, "12.34 ± 0.56"), text
    buffer = io.StringIO()
    counts = {"rows": {"read": 1344, "written": 1344}, "spans": {"word_spans": 1344, "word_spans_dropped": 201}}
    print_summary(WholeConsole(file=buffer), counts)
    assert lines_with(buffer.getvalue(), "word spans", "1,344", "201"), buffer.getvalue()
    span = {"label": "NP", "char_start": 0, "char_end": len(LONG), "teacher_start": 0, "teacher_end": 2}
    span |= {"student_start": 0, "student_end": 2}
    pieces = {"teacher": ["a", "b"], "student": ["a", "b"]}
    text = rendered(span_table("phrase spans", [span], LONG, pieces))
    assert lines_with(text, LONG.strip()), text


def test_a_real_command_through_a_pipe_prints_whole_rows():
    from mta.training.config.reference import select_rows

    env = subprocess_env(COLUMNS="40", PYTHONPATH=f"{REPO / 'src'}:{REPO / 'cli'}")
    piped = subprocess.run(
        f"{sys.executable} -m mta_cli.main recipes keys train | cat",
        shell=True,
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    for row in select_rows("train"):
        assert lines_with(piped.stdout, row.key, row.description), row.key


def console_constructions(source: str) -> list[int]:
    """Lines of ``source`` that make a rich ``Console`` directly (not through mta_cli.consoles)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Console"
    ]


def test_every_command_prints_through_the_whole_consoles():
    assert console_constructions("from rich.console import Console\nConsole(stderr=True).print('x')\n") == [2]
    found = {
        str(path.relative_to(REPO)): lines
        for path in sorted(CLI.rglob("*.py"))
        if path.name != "consoles.py" and (lines := console_constructions(path.read_text(encoding="utf-8")))
    }
    assert found == {}, f"make consoles with mta_cli.consoles.stdout_console / stderr_console: {found}"


def test_an_error_line_in_a_log_is_one_line(tmp_path, monkeypatch, capsys):
    from fixtures.commands import run_mta

    monkeypatch.delenv("COLUMNS", raising=False)
    missing = tmp_path / ("a-directory-whose-name-is-long-" * 4) / "nothing-here"
    code, lines = run_mta(monkeypatch, capsys, "show", missing)
    assert code == 2
    (line,) = [line for line in lines if line.startswith("error:")]
    assert str(missing) in line, lines
    assert Path(str(missing)).name in line
