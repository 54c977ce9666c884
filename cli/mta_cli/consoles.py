"""Where the commands print, the one place their rich consoles are made: :func:`stdout_console`
for results (tables, ``wrote …``, ``done: …``), :func:`stderr_console` for the log, warnings
and errors.

On a terminal they are rich's consoles as they are. Elsewhere (a pipe, ``> file``, Slurm, CI) a
line is never wrapped or cut: the width is :data:`PIPE_WIDTH`, so a table comes out whole at its
natural width (``mta recipes keys train | grep lr`` finds every key and description on one
line) and an error is one line, however long. rich drops colours there by itself.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, ConsoleDimensions

# Wider than any table or message mta prints: when the file is not a terminal nothing folds.
PIPE_WIDTH = 100_000


class WholeConsole(Console):
    """A rich ``Console`` whose lines are never wrapped or cut when its file is not a terminal
    (decided at each print, so a console made before ``sys.stdout`` is replaced still follows it).
    ``$COLUMNS`` counts on a terminal only; a ``width`` given here always counts."""

    def __init__(self, *args: Any, width: int | None = None, **options: Any) -> None:
        super().__init__(*args, width=width, **options)
        self._width_given = width is not None

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        if not self._width_given and not (self.is_terminal or self.is_jupyter):
            return ConsoleDimensions(PIPE_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def stdout_console(**options: Any) -> WholeConsole:
    """The console for a command's results (stdout)."""
    return WholeConsole(**options)


def stderr_console(**options: Any) -> WholeConsole:
    """The console for a command's log, progress, warnings and errors (stderr)."""
    return WholeConsole(stderr=True, **options)
