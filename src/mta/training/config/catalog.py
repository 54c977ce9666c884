"""The recipes shipped inside the package: list them, pick one by name, copy one out to edit.

The shipped files live once in git, in the repository's top-level ``recipes/``; the wheel ships
them as package data ``mta/recipes/`` (``pyproject.toml`` maps the package ``mta.recipes`` to
that folder), and ``SHIPPED_DIR`` finds whichever of the two this mta runs from (an installed
wheel, or a clone installed with ``pip install -e .``). ``NAME.yaml`` sits beside the files its
relative paths name (``configs/*.json`` architectures, ``examples/tiny.jsonl`` rows), so a
shipped recipe works from an installed wheel exactly as from a clone; ``Recipe.resolve`` finds
those files beside the recipe, while outputs (``output_dir``) that do not exist there stay
relative to the working directory.

``find_recipe`` decides what ``--recipe SPEC`` means: an existing file wins (``SPEC`` as
given, then ``SPEC.yaml``), otherwise ``SPEC`` (with or without ``.yaml``) names a shipped
recipe. ``copy_recipe`` writes ``DEST/NAME.yaml`` with every input file it names beside it,
editing only the path values in the text (comments and layout are kept) so the copy works where
it lands.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mta.errors import MtaError
from mta.files import atomic_write_bytes, atomic_write_text
from mta.training.config.yaml_reader import load_yaml


def _shipped_dir() -> Path:
    """``mta/recipes/`` inside an installed wheel, else the clone's top-level ``recipes/``."""
    package = Path(__file__).resolve().parents[2]  # .../mta
    installed = package / "recipes"
    return installed if installed.is_dir() else package.parents[1] / "recipes"


SHIPPED_DIR = _shipped_dir()

# The keys whose values name inputs that exist before a run: what a copy must carry along.
# Outputs (output_dir, a tiny model's path, built under output_dir) are not copied, and a value
# that names nothing beside the recipe (a hub name, ${MTA_DATA_DIR}/...) is left as written.
INPUT_PATH_KEYS: tuple[tuple[str, ...], ...] = tuple(
    (role, *key)
    for role in ("teacher", "student")
    for key in (("path",), ("tokenizer",), ("config",), ("tiny", "tokenizer_corpus"))
) + (("data", "train"), ("data", "dev"))

_PLAIN_SAFE = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_./+-]*")


@dataclass(frozen=True)
class ShippedRecipe:
    name: str
    path: Path
    description: str


@dataclass(frozen=True)
class RecipeChoice:
    """The recipe file ``--recipe`` resolved to; ``shipped`` is set when it is a shipped one."""

    path: Path
    shipped: ShippedRecipe | None = None


@dataclass(frozen=True)
class CopiedFile:
    source: Path
    destination: Path
    unchanged: bool = False  # an identical file was already there


@dataclass(frozen=True)
class RecipeCopy:
    recipe: Path
    files: list[CopiedFile]
    rewritten: dict[str, tuple[str, str]] = field(default_factory=dict)  # key: (old, new)


def describe(text: str) -> str:
    """One line for a recipe: the first sentence of its header comment, else its ``name:``."""
    paragraph: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        words = line.lstrip("#").strip()
        if not words and paragraph:
            break
        if words:
            paragraph.append(words)
    if paragraph:
        return re.split(r"(?<=\.)\s+", " ".join(paragraph), maxsplit=1)[0]
    try:
        raw = load_yaml(text, "recipe")
    except MtaError:
        raw = None
    return str(raw.get("name", "")) if isinstance(raw, dict) else ""


def shipped_recipes(directory: Path = SHIPPED_DIR) -> list[ShippedRecipe]:
    """Every shipped recipe, by name (the file name without ``.yaml``)."""
    return [
        ShippedRecipe(path.stem, path, describe(path.read_text(encoding="utf-8")))
        for path in sorted(directory.glob("*.yaml"), key=lambda path: path.stem)
    ]


def shipped_recipe(name: str, directory: Path = SHIPPED_DIR) -> ShippedRecipe:
    """The shipped recipe ``name`` (``.yaml`` optional); ``MtaError`` lists the names otherwise."""
    recipes = shipped_recipes(directory)
    wanted = name.removesuffix(".yaml")
    for recipe in recipes:
        if recipe.name == wanted:
            return recipe
    raise MtaError(
        f"no shipped recipe named {name!r}; the shipped recipes are "
        f"{', '.join(recipe.name for recipe in recipes)} (`mta recipes list`)"
    )


def find_recipe(spec: str | Path, directory: Path = SHIPPED_DIR) -> RecipeChoice:
    """What ``--recipe SPEC`` names: an existing file first (``SPEC``, then ``SPEC.yaml``, from
    the working directory), else the shipped recipe of that name."""
    written = str(spec)
    candidates = [Path(written).expanduser()]
    if not written.endswith((".yaml", ".yml")):
        candidates.append(Path(written + ".yaml").expanduser())
    for candidate in candidates:
        if candidate.is_file():
            return RecipeChoice(candidate)
    recipes = shipped_recipes(directory)
    if "/" not in written and os.sep not in written:
        for recipe in recipes:
            if recipe.name == written.removesuffix(".yaml"):
                return RecipeChoice(recipe.path, recipe)
    raise MtaError(
        f"recipe {written!r} not found: no such file from {Path.cwd()} and no shipped recipe of "
        f"that name; give a recipe YAML file or one of the shipped names: "
        f"{', '.join(recipe.name for recipe in recipes)} (`mta recipes list`)"
    )


def _scalars(text: str, source: Path) -> dict[tuple[str, ...], yaml.ScalarNode]:
    """The scalar value node of every ``INPUT_PATH_KEYS`` key the recipe text sets."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as error:
        raise MtaError(f"{source}: not valid YAML: {error}") from error
    found = {}
    for key in INPUT_PATH_KEYS:
        node = root
        for part in key:
            if not isinstance(node, yaml.MappingNode):
                node = None
                break
            node = next((value for name, value in node.value if name.value == part), None)
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:str":
            found[key] = node
    return found


def _landing(written: str) -> str:
    """Where a file named ``written`` relative to the recipe goes, relative to the copy:
    the same path, with any leading ``..`` dropped so it stays inside DEST."""
    parts = posixpath.normpath(written.replace(os.sep, "/")).split("/")
    while parts and parts[0] in ("..", "."):
        parts.pop(0)
    return "/".join(parts)


def _quoted_like(node: yaml.ScalarNode, value: str) -> str:
    if node.style == "'":
        return "'" + value.replace("'", "''") + "'"
    if node.style == '"' or not _PLAIN_SAFE.fullmatch(value):
        return json.dumps(value)
    return value


def _files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def plan_copy(name: str, dest: Path, directory: Path = SHIPPED_DIR) -> tuple[str, RecipeCopy]:
    """The text of ``DEST/NAME.yaml`` and the files to copy beside it (nothing is written)."""
    recipe = shipped_recipe(name, directory)
    text = recipe.path.read_text(encoding="utf-8")
    here = recipe.path.parent
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) in the recipe's text
    rewritten: dict[str, tuple[str, str]] = {}
    files: list[tuple[Path, Path]] = []  # (source, destination)
    landed: dict[str, Path] = {}  # target inside DEST: the source copied there
    for key, node in _scalars(text, recipe.path).items():
        written = node.value
        if not written or os.path.isabs(written) or "$" in written or written.startswith("~"):
            continue
        source = here / written
        if not source.exists():
            continue  # an output, or a hub name: it means the same wherever the copy lands
        target = _landing(written)
        if not target:
            raise MtaError(
                f"{recipe.path}: {'.'.join(key)}={written!r} names the recipe's own "
                f"directory; name a file or a directory inside it"
            )
        if landed.setdefault(target, source.resolve()) != source.resolve():
            raise MtaError(
                f"{recipe.path}: two different files would both be copied to {dest / target}; rename one of them"
            )
        for file in _files_under(source):
            files.append((file, dest / target / file.relative_to(source) if source.is_dir() else dest / target))
        if target != written:
            edits.append((node.start_mark.index, node.end_mark.index, _quoted_like(node, target)))
            rewritten[".".join(key)] = (written, target)
    for start, end, value in sorted(edits, reverse=True):
        text = text[:start] + value + text[end:]
    parent = _extends(text, recipe.path)
    if parent is not None:  # the shared part it extends is copied beside it, as it is
        parent_text, parent_plan = plan_copy(parent, dest, directory)
        shipped_parent = shipped_recipe(parent, directory).path
        if parent_text != shipped_parent.read_text(encoding="utf-8"):
            raise MtaError(
                f"{shipped_parent}: a recipe that others extend must name its files inside its own directory"
            )
        files += [(file.source, file.destination) for file in parent_plan.files]
        files.append((shipped_parent, parent_plan.recipe))
    unique = {destination: source for source, destination in files}
    copied = [
        CopiedFile(source, destination, destination.is_file() and destination.read_bytes() == source.read_bytes())
        for destination, source in sorted(unique.items())
    ]
    return text, RecipeCopy(dest / f"{recipe.name}.yaml", copied, rewritten)


def _extends(text: str, source: Path) -> str | None:
    """The shipped recipe a shipped recipe's ``extends:`` names (a sibling file), or None."""
    raw = load_yaml(text, str(source))
    parent = raw.get("extends") if isinstance(raw, dict) else None
    if parent is None:
        return None
    if not isinstance(parent, str) or not (source.parent / f"{parent.removesuffix('.yaml')}.yaml").is_file():
        raise MtaError(f"{source}: extends: {parent!r}: a shipped recipe extends a recipe beside it")
    return parent


def copy_recipe(name: str, dest: str | Path = ".", *, force: bool = False, directory: Path = SHIPPED_DIR) -> RecipeCopy:
    """Copy the shipped recipe ``name`` to ``DEST/NAME.yaml`` with every file it names.

    Existing files are never overwritten without ``force`` (an identical one is left as it is);
    the recipe is written last, so it never points at a file that is not there yet.
    """
    dest = Path(dest)
    text, plan = plan_copy(name, dest, directory)
    clashes = [file.destination for file in plan.files if file.destination.exists() and not file.unchanged]
    if plan.recipe.exists() and plan.recipe.read_text(encoding="utf-8") != text:
        clashes.insert(0, plan.recipe)
    if clashes and not force:
        raise MtaError(
            f"not copying the recipe {name!r}: these files already exist and differ from what "
            f"the copy would write: {', '.join(map(str, clashes))}; pass --force to overwrite "
            f"them, or copy to another directory"
        )
    for file in plan.files:
        if not file.unchanged:
            atomic_write_bytes(file.destination, file.source.read_bytes())
    atomic_write_text(plan.recipe, text)
    return plan
