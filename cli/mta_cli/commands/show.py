"""`mta show`: one annotated row in the terminal, spans highlighted, both tokenisations."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from mta_cli.consoles import stdout_console
from mta_cli.options import deprecated_alias
from mta_cli.quiet import VERBOSE_HELP, quiet_third_party

PHRASE_STYLES = {"NP": "bold black on cyan", "VP": "bold black on magenta"}
WORD_STYLE = "underline"
TOKEN_STYLES = ("on grey23", "on grey35")  # alternate so token boundaries are visible
VISIBLE_WHITESPACE = str.maketrans({" ": "·", "\n": "↵", "\t": "→"})


def show(
    directory: Path = typer.Argument(
        ..., metavar="DIR", help="A directory `mta annotate -o DIR` wrote.", show_default=False
    ),
    row: int | None = typer.Option(
        None, "--row", help="Row position in the artefact, from 0 [default: 0].", show_default=False
    ),
    row_old: int | None = typer.Option(None, "-r", hidden=True),  # deprecated: -r is --recipe elsewhere
    words: bool = typer.Option(False, "--words", help="Also list the word spans."),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Print one row: its text with phrase (NP cyan, VP magenta) and word (underlined) spans,
    the teacher's and the student's tokens, and each span's token range on both sides.
    """
    quiet_third_party(verbose)
    row = deprecated_alias(row, row_old, old="-r", new="--row") or 0
    from mta.data.annotations import read_annotations

    console = stdout_console()
    annotations = read_annotations(directory)
    record = annotations.row(row)
    manifest = annotations.manifest
    for side in ("teacher", "student"):  # both are printed: a record that is not one is refused first
        described = manifest.get(side)
        if not (isinstance(described, dict) and isinstance(described.get("name"), str)):
            from mta.errors import MtaError

            raise MtaError(
                f"{directory}: its manifest's {side!r} is {described!r}, not the tokenizer record "
                "{name, fingerprint} `mta annotate` writes; the manifest was changed by hand or by "
                "another program: annotate the input again into a new directory"
            )
    text = record["text"]

    console.print(
        f"[bold]row {row}[/] of {len(annotations)}  id {record['id']}  "
        f"{len(text)} chars (prompt {record['prompt_chars']})  "
        f"{len(record['phrase_spans'])} phrases, {len(record['word_spans'])} words",
        highlight=False,
    )
    console.print(Text("text (prompt dimmed):", style="bold"))
    console.print(_highlighted_text(record))

    pieces = {}
    for side in ("teacher", "student"):
        pieces[side] = _token_pieces(manifest[side], text, record[f"{side}_input_ids"])
        ids = record[f"{side}_input_ids"]
        console.print(
            Text(
                f"\n{side}: {manifest[side]['name']}  {len(ids)} ids, prompt {record[f'{side}_prompt_len']}",
                style="bold",
            )
        )
        console.print(_token_line(pieces[side], record[f"{side}_prompt_len"]))

    console.print(span_table("phrase spans", record["phrase_spans"], text, pieces))
    if words:
        console.print(span_table("word spans", record["word_spans"], text, pieces))


def _highlighted_text(record: dict) -> Text:
    text = Text(record["text"])
    text.stylize("dim", 0, record["prompt_chars"])
    for span in record["phrase_spans"]:
        text.stylize(PHRASE_STYLES[span["label"]], span["char_start"], span["char_end"])
    for span in record["word_spans"]:
        text.stylize(WORD_STYLE, span["char_start"], span["char_end"])
    return text


def _token_pieces(description: dict, text: str, ids: list[int]) -> list[str]:
    """Each id as the text it covers (re-tokenised with offsets); ids alone if the tokenizer
    cannot be loaded or is not the one the artefact was built with."""
    from mta.data.encoding import TokenizerSide
    from mta.errors import MtaError

    try:
        side = TokenizerSide.load(description["name"])
    except MtaError:
        return [str(i) for i in ids]
    if side.fingerprint != description.get("fingerprint"):
        return [str(i) for i in ids]
    encoding = side.encode(text)
    pieces = [text[start:end] for start, end in encoding.offsets.tolist()]
    if len(ids) == len(pieces) + 1:
        pieces.append(side.tokens([ids[-1]])[0])  # the EOS of a complete response
    return pieces


def _token_line(pieces: list[str], prompt_len: int) -> Text:
    line = Text()
    for index, piece in enumerate(pieces):
        style = TOKEN_STYLES[index % 2] + (" dim" if index < prompt_len else "")
        line.append(piece.translate(VISIBLE_WHITESPACE) or "∅", style=style)
    return line


def span_table(title: str, spans: list[dict], text: str, pieces: dict[str, list[str]]) -> Table:
    table = Table(title=title, show_lines=False)
    for column in ("#", "label", "chars", "text", "teacher tokens", "student tokens"):
        table.add_column(column, overflow="fold")
    for index, span in enumerate(spans):
        cells = []
        for side in ("teacher", "student"):
            start, end = span[f"{side}_start"], span[f"{side}_end"]
            joined = "|".join(piece.translate(VISIBLE_WHITESPACE) for piece in pieces[side][start:end])
            cells.append(f"[{start},{end}) {joined}")
        table.add_row(
            str(index),
            Text(span["label"], style=PHRASE_STYLES.get(span["label"], WORD_STYLE)),
            f"[{span['char_start']},{span['char_end']})",
            text[span["char_start"] : span["char_end"]],
            Text(cells[0]),
            Text(cells[1]),
        )
    return table
