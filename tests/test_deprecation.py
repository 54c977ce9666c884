"""Renames (issue 55): every old spelling still works until mta.deprecation.REMOVED_IN with a
warning naming the new one (a CLI option, a recipe key, a Python name or module path), and no old
spelling is used inside the project itself."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mta import deprecation
from mta.errors import MtaError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
OFF_POLICY_KEYS = "mode|init_threshold|threshold_step|loss_eps|schedule|buffer_size|max_new_tokens|dev_rows"

# (kind, old spelling as CHANGELOG's rename table writes it, the patterns that find a use of it).
OLD_SPELLINGS: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "recipe key",
        "generation:",
        (
            r"^\s*generation:\s*(#.*|null|\{.*)?$",  # a YAML section (recipes, docs' code blocks)
            r"`generation:`",
            r"generation:\\n",  # YAML inside a Python string
            r"[\"']generation[\"']\s*:\s*\{\s*[\"']mode",  # a recipe section written as a dict
            r"\bgeneration=\{",
            rf"\bgeneration\.({OFF_POLICY_KEYS})\b",
            r"\b(recipe|loaded|spec)\.generation\b",
        ),
    ),
    ("metric", "generation/", (r"\bgeneration/(gold|generated|buffer|threshold|dev_ce|tokens_per_s|span_wait_s|\{)",)),
    ("plan field", "RunPlan.generation", (r"\bplan\.generation\b", r"\bgeneration_new_tokens\b")),
    ("module", "mta.training.sampling", (r"\bmta\.training\.sampling\b", r"\btraining/sampling/")),
    ("module", "mta.embedding.teacher_embeddings", (r"\bembedding\.teacher_embeddings\b", r"\bteacher_embeddings\.py")),
    ("module", "mta.training.teacher_cache.build", (r"\bteacher_cache\.build\b", r"\bteacher_cache/build\.py")),
    ("module", "mta.inspection.run", (r"\binspection\.run\b", r"\binspection/run\.py")),
    ("module", "mta.training.teacher_cache.encoding", (r"\bteacher_cache[./]encoding\b",)),
    ("module", "mta.losses.cross_vocabulary", (r"\bcross_vocabulary\b",)),
    (
        "module",
        "mta.pairs",
        (
            r"\bmta/pairs\.py",
            r"from mta\.pairs import (?!generate\b)",
            r"\bmta\.pairs\.(PairSettings|PairsPaths|generate_pairs)",
        ),
    ),
    ("name", "GenerationSpec", (r"\bGenerationSpec\b",)),
    ("name", "GenerationMode", (r"\bGenerationMode\b",)),
    ("name", "GenerationSchedule", (r"\bGenerationSchedule\b",)),
    ("name", "SamplingState", (r"\bSamplingState\b",)),
    ("name", "Recipe.generation_max_new_tokens", (r"\bgeneration_max_new_tokens\b",)),
    ("name", "check_generation_fits", (r"\bcheck_generation_fits\b",)),
    ("name", "generation_problem", (r"\bgeneration_problem\b",)),
    ("name", "alignment_terms", (r"\balignment_terms\b",)),
    ("name", "DistillationObjective.alignment", (r"\bobjective\.alignment\b", r"\bself\.alignment\b")),
    ("name", "mta.MTALoss.alignment", (r"\bMTALoss\.alignment\b", r"\b(loss|mta_loss)\.alignment\(", r"`alignment`")),
    ("name", "generation_summary", (r"\bgeneration_summary\b",)),
    ("name", "DEPRECATED_UNTIL", (r"\bDEPRECATED_UNTIL\b",)),
    ("option", "mta show -r", (r"\bmta show\b.*\s-r\s",)),
    ("option", "mta evaluate --task embedding --data", (r"\bmta evaluate\b.*--task embedding.*\s--data\b",)),
    ("option", "mta generate --data", (r"\bmta generate\b.*\s--data\b",)),
    ("option", "--output", (r"\bmta (init-student|models \w[\w-]*)\b.*\s--output\b",)),
]


def needle(pattern: str) -> str:
    """The longest literal text every match of ``pattern`` contains (outside its groups and
    classes; "" when it has a top-level ``|``), to skip a file without running the pattern: a
    pattern that starts with ``\\b`` is not scanned for its literal prefix, which made this check
    take seconds."""
    pieces, piece, position = [], "", 0
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":
            escaped = pattern[position + 1]
            position += 2
            if escaped in "bswdBSWD":
                pieces, piece = [*pieces, piece], ""
            else:
                piece += escaped
            continue
        if char in "([":
            depth, close = 0, {"(": ")", "[": "]"}[char]
            while position < len(pattern):
                if pattern[position] == "\\":
                    position += 2
                    continue
                depth += {char: 1, close: -1}.get(pattern[position], 0)
                position += 1
                if depth == 0:
                    break
            pieces, piece = [*pieces, piece], ""
            continue
        if char == "|":
            return ""
        if char in "*+?":
            piece = piece[:-1]
            pieces, piece = [*pieces, piece], ""
        elif char in ".^$":
            pieces, piece = [*pieces, piece], ""
        else:
            piece += char
        position += 1
    return max([*pieces, piece], key=len)


COMPILED = [
    (kind, old, [(needle(pattern), re.compile(pattern)) for pattern in patterns])
    for kind, old, patterns in OLD_SPELLINGS
]

# Where the project speaks: every tracked text file but the old artefacts, the recorded bench
# results, the history (CHANGELOG), this file and the mta package's map of moved modules. A line
# that keeps an old spelling working names its deprecation (REMOVED_IN, "deprecat") or the old
# version it reads ("0.2.0").
EXCLUDED = ("tests/data/", "bench/results/", "CHANGELOG.md", "tests/test_deprecation.py", "src/mta/__init__.py")
EXEMPT = re.compile(r"REMOVED_IN|deprecat|0\.2\.0", re.IGNORECASE)
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".txt", ".json", ".sh", ""}


def project_files(root: Path = REPO) -> list[Path]:
    listed = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True, check=True).stdout
    return [
        root / name
        for name in listed.splitlines()
        if not name.startswith(EXCLUDED) and Path(name).suffix in SUFFIXES and (root / name).is_file()
    ]


def old_spellings_used(files: list[Path], root: Path = REPO) -> list[str]:
    """``path:line: kind old`` for each line of ``files`` that uses an old spelling."""
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        present = [
            (kind, old, [pattern for literal, pattern in patterns if literal in text])
            for kind, old, patterns in COMPILED
        ]
        present = [(kind, old, patterns) for kind, old, patterns in present if patterns]
        for number, line in enumerate(text.splitlines() if present else [], 1):
            if EXEMPT.search(line):
                continue
            for kind, old, patterns in present:
                if any(pattern.search(line) for pattern in patterns):
                    found.append(f"{path.relative_to(root)}:{number}: {kind} {old}")
    return found


def test_no_old_spelling_is_used_inside_the_project():
    used = old_spellings_used(project_files())
    assert not used, "old spellings (use the new ones: CHANGELOG's rename table):\n" + "\n".join(used)


@pytest.mark.parametrize(
    "planted",
    [
        "generation:\n  mode: adaptive\n",  # a recipe section
        "mta distill --recipe tiny generation.mode=always\n",  # an override
        "from mta.training.sampling.policy import decide\n",  # a moved module
        "state = SamplingState(0.0)\n",  # a renamed name
        "terms = loss.alignment(hidden, teacher, mask, mask, spans)\n",  # a renamed method
        "    mta show rows/ -r 3\n",  # an old option
    ],
)
def test_the_old_spelling_check_trips_on_a_planted_use(tmp_path, planted):
    path = tmp_path / "planted.md"
    path.write_text(f"fine line\n{planted}", encoding="utf-8")
    assert [line.split(":")[1] for line in old_spellings_used([path], tmp_path)] == ["2"]
    kept = "".join(f"{line}  # deprecated\n" for line in planted.splitlines())  # a kept alias says so
    path.write_text(f"fine line\n{kept}", encoding="utf-8")
    assert old_spellings_used([path], tmp_path) == []


def test_changelogs_rename_table_lists_every_old_spelling_and_every_alias():
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    section = changelog.split("## [Unreleased]")[1].split("\n## [")[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    olds = {cell for line in table for cell in re.findall(r"`([^`]+)`", line.split("|")[1])}
    missing = [old for _, old, _ in OLD_SPELLINGS if old not in olds]
    missing += [".".join(old) for old in deprecation.RECIPE_KEYS if f"{'.'.join(old)}:" not in olds]
    missing += [old for old in deprecation.MODULES_MOVED if old not in olds]
    assert not missing, f"not in CHANGELOG's rename table: {missing}"


# --- each kind of old spelling still works, with a warning naming the new one ----------------


def test_an_old_option_works_with_a_line_naming_the_new_one(capsys):
    from mta_cli.options import deprecated_alias

    assert deprecated_alias(None, "rows.jsonl", old="--data", new="--held-out") == "rows.jsonl"
    err = capsys.readouterr().err
    assert err == f"warning: --data is deprecated and goes in mta {deprecation.REMOVED_IN}; use --held-out\n"
    assert deprecated_alias("a", None, old="--data", new="--held-out") == "a" and not capsys.readouterr().err
    with pytest.raises(MtaError, match="--data is the old spelling of --held-out"):
        deprecated_alias("a", "b", old="--data", new="--held-out")


def test_the_cli_prints_an_old_recipe_key_as_the_same_one_line(monkeypatch, capsys):
    from mta_cli.options import render_deprecations

    others: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: others.append(str(message)))
    render_deprecations()
    render_deprecations()  # once: a second call wraps nothing again
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        deprecation.warn("r.yaml: recipe key generation", "off_policy")
        warnings.warn("another library's", UserWarning, stacklevel=1)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"warning: {deprecation.message('r.yaml: recipe key generation', 'off_policy')}"
    assert len(err) == 1 and others == ["another library's"]  # any other warning shown as before


def _recipe(tmp_path: Path, section: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(TINY.read_text(encoding="utf-8") + section, encoding="utf-8")
    return path


def test_an_old_recipe_section_loads_as_the_new_one_with_a_warning(tmp_path):
    from mta.training.config.loading import load_recipe

    old = _recipe(tmp_path, "generation:\n  mode: always\n  buffer_size: 7\n", "old.yaml")
    with pytest.warns(
        deprecation.MtaDeprecationWarning, match=r"old\.yaml: recipe key generation is deprecated"
    ) as caught:
        recipe = load_recipe(old)
    assert str(caught[0].message).endswith(f"goes in mta {deprecation.REMOVED_IN}; use off_policy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = load_recipe(_recipe(tmp_path, "off_policy:\n  mode: always\n  buffer_size: 7\n", "new.yaml"))
    assert recipe.off_policy == new.off_policy and recipe.off_policy.buffer_size == 7
    # An override by the old key path.
    with pytest.warns(
        deprecation.MtaDeprecationWarning,
        match=r"override generation\.buffer_size is deprecated .* use off_policy\.buffer_size",
    ):
        assert load_recipe(TINY, ["generation.buffer_size=9"]).off_policy.buffer_size == 9


def test_an_old_key_keeps_its_line_in_errors_and_both_spellings_are_refused(tmp_path):
    from mta.training.config.loading import load_recipe

    path = _recipe(tmp_path, "generation:\n  mode: sometimes\n")
    line = path.read_text(encoding="utf-8").splitlines().index("  mode: sometimes") + 1
    with pytest.warns(deprecation.MtaDeprecationWarning), pytest.raises(MtaError) as error:
        load_recipe(path)
    assert f"line {line}: off_policy.mode: 'sometimes' is not allowed" in str(error.value)
    both = _recipe(tmp_path, "generation:\n  mode: always\noff_policy:\n  mode: always\n", "both.yaml")
    with pytest.raises(MtaError, match="generation is the old spelling of off_policy: give one of them"):
        load_recipe(both)


def test_a_recipe_extending_a_parent_with_the_old_key_merges_them(tmp_path):
    from mta.training.config.loading import load_recipe

    _recipe(tmp_path, "generation:\n  mode: always\n  buffer_size: 3\n", "parent.yaml")
    child = tmp_path / "child.yaml"
    child.write_text("extends: parent\noff_policy:\n  buffer_size: 5\n", encoding="utf-8")
    with pytest.warns(deprecation.MtaDeprecationWarning, match="parent.yaml: recipe key generation"):
        recipe = load_recipe(child)
    assert (recipe.off_policy.mode, recipe.off_policy.buffer_size) == ("always", 5)


def test_a_checkpoints_saved_recipe_with_the_old_key_reads_silently(tmp_path):
    from mta.training.config.loading import load_recipe
    from mta.training.config.resume_rules import read_saved_recipe

    with warnings.catch_warnings():  # mta inspect reading a 0.2.0 student's recipe.yaml
        warnings.simplefilter("error")
        assert load_recipe(_recipe(tmp_path, "generation:\n  mode: always\n"), saved=True).off_policy.mode == "always"

    (tmp_path / "recipe.yaml").write_text("name: x\ngeneration:\n  mode: adaptive\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = read_saved_recipe(tmp_path)
    assert saved == {"name": "x", "off_policy": {"mode": "adaptive"}}


def _forget(module: str) -> None:
    for name in [name for name in sys.modules if name == module or name.startswith(module + ".")]:
        del sys.modules[name]
    parent, _, child = module.rpartition(".")
    if parent in sys.modules and child in vars(sys.modules[parent]):
        delattr(sys.modules[parent], child)


@pytest.mark.parametrize("old, new", sorted(deprecation.MODULES_MOVED.items()))
def test_a_moved_module_imports_by_its_old_path_as_the_same_module(old, new):
    _forget(old)
    try:
        with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} is deprecated .*; use {re.escape(new)}$"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
    finally:
        _forget(old)


def test_a_moved_modules_submodule_is_the_new_submodule_not_a_second_copy():
    _forget("mta.training.sampling")
    try:
        with pytest.warns(DeprecationWarning, match="use mta.training.off_policy.policy$"):
            from mta.training.sampling.policy import OffPolicyState
        from mta.training.off_policy import policy

        assert OffPolicyState is policy.OffPolicyState
    finally:
        _forget("mta.training.sampling")


def test_an_old_public_name_works_with_a_warning_naming_the_new_one():
    import mta.pairs
    from mta.api import MTALoss
    from mta.pairs import generate

    vars(mta.pairs).pop("PairSettings", None)
    try:
        with pytest.warns(
            DeprecationWarning, match="mta.pairs.PairSettings is deprecated .* use mta.pairs.generate.PairSettings"
        ):
            from mta.pairs import PairSettings
        assert PairSettings is generate.PairSettings
    finally:
        vars(mta.pairs).pop("PairSettings", None)
    with pytest.raises(AttributeError):
        mta.pairs.no_such_name  # noqa: B018
    with pytest.warns(DeprecationWarning, match=r"^MTALoss\.alignment is deprecated .*; use MTALoss\.trajectory$"):
        assert MTALoss.alignment is MTALoss.trajectory


def test_the_projectors_of_an_older_checkpoint_load_under_their_new_name():
    import torch

    from mta.api import MTALoss

    def loss(seed: int) -> MTALoss:
        torch.manual_seed(seed)
        options = dict(student_hidden_size=8, teacher_hidden_size=12, vocab_size=16, same_tokenizer=True)
        return MTALoss([(1, 2, "word")], **options)

    saved = loss(0).objective.state_dict()
    assert any(key.startswith("trajectory.projectors.") for key in saved)
    old = {key.replace("trajectory.", "alignment.", 1): value for key, value in saved.items()}
    fresh = loss(1).objective
    fresh.load_state_dict(old, strict=True)
    assert all(torch.equal(fresh.state_dict()[key], value) for key, value in saved.items())
