"""The ``mta`` command line: a thin Typer layer over the ``mta`` library."""
