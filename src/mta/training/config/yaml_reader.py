"""The one YAML reader for recipes, override values and the recipes saved beside checkpoints.

Hostile or broken YAML is refused before anything is built from it: a document whose aliases
expand past ``MAX_YAML_VALUES`` values (a "billion laughs" bomb), nests deeper than
``MAX_YAML_DEPTH``, refers to itself or repeats a key in one mapping.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from mta.errors import MtaError

# Bounds far above any real recipe (the shipped ones hold about 100 values, 5 levels deep) and far
# below what hurts: a "billion laughs" document of a few lines expands to 10**9 values.
MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 32

_MERGE_TAG = "tag:yaml.org,2002:merge"


class Refused(Exception):
    """A document the loader will not construct; ``mark`` is where (PyYAML's 0-based mark)."""

    def __init__(self, mark: Any, message: str):
        super().__init__(message)
        self.line = mark.line + 1
        self.message = message


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that checks the composed document before constructing any value.

    Aliases share nodes, so composing is linear in the text; only construction (and everything
    after it) would pay for the expansion. The check counts the values the document holds with
    every alias expanded, memoised per node, so a bomb is refused in microseconds.
    """

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        # PyYAML composes recursively: bound the depth before Python's recursion limit is hit.
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise Refused(
                    self.peek_event().start_mark,
                    f"nested more than {MAX_YAML_DEPTH} levels deep; a recipe needs a handful",
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            _check_composed(node)
        return node


def _check_composed(root: yaml.Node) -> None:
    """Refuse self-reference, duplicate keys, and more than ``MAX_YAML_VALUES`` expanded values
    or ``MAX_YAML_DEPTH`` expanded levels; raises ``Refused`` at the offending node."""
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded values, expanded height)
    open_nodes: set[int] = set()

    def visit(node: yaml.Node, level: int) -> tuple[int, int]:
        key = id(node)
        if key in open_nodes:
            raise Refused(node.start_mark, "an alias refers to a node that contains it (a recursive structure)")
        if key not in done:  # first met where it is written: at most MAX_YAML_DEPTH deep (composing)
            open_nodes.add(key)
            if isinstance(node, yaml.MappingNode):
                _refuse_duplicate_keys(node)
                children = [child for pair in node.value for child in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            else:
                children = []
            values, height = 1, 0
            for child in children:
                child_values, child_height = visit(child, level + 1)
                values += child_values
                height = max(height, child_height)
                if values > MAX_YAML_VALUES:
                    raise Refused(
                        node.start_mark,
                        f"this value holds more than {MAX_YAML_VALUES:,} values once its aliases are "
                        "expanded (an alias bomb?); a recipe needs few aliases: write the values out",
                    )
            open_nodes.discard(key)
            done[key] = (values, height + 1)
        values, height = done[key]
        if level + height - 1 > MAX_YAML_DEPTH:
            raise Refused(node.start_mark, f"aliases nest the values more than {MAX_YAML_DEPTH} levels deep")
        return values, height

    visit(root, 1)


def _refuse_duplicate_keys(node: yaml.MappingNode) -> None:
    seen: dict[tuple[str, str], int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
            continue
        line = key_node.start_mark.line + 1
        first = seen.setdefault((key_node.tag, key_node.value), line)
        if first != line:
            raise Refused(
                key_node.start_mark,
                f"key {key_node.value!r} is given twice in one mapping (also line {first}); YAML "
                "would silently keep only the last: remove one",
            )


def load_yaml(text: str, where: str) -> Any:
    """Parse YAML like ``yaml.safe_load``, refusing hostile or broken documents with ``MtaError``.

    ``where`` starts the message (a file name, or ``override 'k=v'``). The one YAML reader for
    recipes, the values of overrides and the recipes saved beside checkpoints.
    """
    loader = None
    try:
        loader = BoundedLoader(text)  # PyYAML's reader already refuses control characters here
        return loader.get_single_data()
    except Refused as refused:
        raise MtaError(f"{where}: line {refused.line}: {refused.message}") from None
    except yaml.YAMLError as error:
        raise MtaError(f"{where}: not valid YAML: {yaml_problem(error, text)}") from error
    except RecursionError:  # a guard only: the depth bound comes first
        raise MtaError(f"{where}: nested too deeply to be a recipe") from None
    finally:
        if loader is not None:
            loader.dispose()


def yaml_problem(error: yaml.YAMLError, text: str) -> str:
    """PyYAML's error as one line: where (line, column) and what, without its multi-line quote."""
    if isinstance(error, yaml.reader.ReaderError):
        before = text[: error.position]
        line, column = before.count("\n") + 1, error.position - (before.rfind("\n") + 1) + 1
        character = error.character  # PyYAML gives the code point (an int) for text and bytes alike
        return (
            f"line {line}, column {column}: the control character U+{character:04X} is not allowed in YAML "
            "(a binary file, or a character pasted in by mistake?); remove it"
        )
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        what = ", ".join(part for part in (error.context, error.problem) if part)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        return f"{where}{what}" if what else where + type(error).__name__
    return " ".join(str(error).split())


def yaml_text(value: Any) -> str:
    """``value`` as YAML flow text: ``true``, ``null``, ``[1, 2]``, ``{a: 1}``."""
    return (
        yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=math.inf).removesuffix("\n...\n").strip()
    )
