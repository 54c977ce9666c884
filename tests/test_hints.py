"""Every hint right (issue 50): each flag or command a help text or an error message names exists
on the command it names, and no hint sends output into an existing directory of another kind.

``hint_problems`` reads a text the way a user would: a ``mta CMD ...`` snippet's flags must be
options of CMD; a flag named bare in CMD's own help or error must be one of CMD's options. The
walker runs over every command's ``--help`` (its docstring and each option's help) and over the
documented error paths below, run in this process through the real entry point; a planted
message naming a flag distill does not have shows it can fail.
"""

from __future__ import annotations

import io
import json
import re

import click
import typer

from conftest import EXAMPLES
from fixtures.commands import run_mta
from mta_cli.main import app

COMMAND = typer.main.get_command(app)
# Other programs' commands in mta's texts (the launchers in `mta distill --help`, pip), and their flags.
EXTERNAL = re.compile(r"\b(deepspeed|torchrun|python -m [\w.]+|pip install)\b[^`]*")
EXTERNAL_FLAGS = {"--no-deps"}  # pip's, named bare beside a pip command
# "not --force, which elsewhere recomputes a cache": another command's flag, said to be one.
ELSEWHERE = re.compile(r"elsewhere")
SNIPPET = re.compile(r"\bmta ([a-z][\w-]*)((?: [^`;\n()]*)?)")
FLAG = re.compile(r"(?<![\w/.=-])(--[a-z][\w-]*|-[a-zA-Z])(?![\w-])")


def commands() -> dict[str, click.Command]:
    """``{"distill": ..., "models smollm2": ...}``: every command, groups' subcommands by path."""
    found: dict[str, click.Command] = {}
    for name, command in COMMAND.commands.items():
        found[name] = command
        for sub, inner in getattr(command, "commands", {}).items():
            found[f"{name} {sub}"] = inner
    return found


def options_of(command: click.Command) -> set[str]:
    return {flag for param in command.params for flag in (*param.opts, *param.secondary_opts)} | {"--help"}


def resolve(first: str, rest: str) -> tuple[str | None, str]:
    """The command a snippet ``mta FIRST REST`` runs and the rest of it (its arguments)."""
    known = commands()
    if first not in known:
        return None, rest
    words = rest.split()
    if words and f"{first} {words[0]}" in known:
        return f"{first} {words[0]}", rest.split(words[0], 1)[1]
    return first, rest


def hint_problems(text: str, speaker: str | None) -> list[str]:
    """What is wrong in ``text`` said by the command ``speaker`` (None: any command)."""
    known, problems = commands(), []
    text = EXTERNAL.sub(" ", text)
    for match in SNIPPET.finditer(text):
        name, rest = resolve(match.group(1), match.group(2))
        if name is None:
            if match.group(1).isupper() or match.group(1) in ("is", "and", "or", "to"):
                continue
            problems.append(f"`mta {match.group(1)}` is no command")
            continue
        for flag in FLAG.findall(rest):
            if flag not in options_of(known[name]):
                problems.append(f"`mta {name}` has no {flag}")
    if speaker is not None:
        bare = SNIPPET.sub(" ", text)
        anywhere = set().union(*(options_of(command) for command in known.values()))
        for flag in FLAG.findall(bare):
            if flag in options_of(known[speaker]) or flag in EXTERNAL_FLAGS:
                continue
            if flag in anywhere and ELSEWHERE.search(_sentence(bare, flag)):
                continue
            problems.append(f"{speaker} names {flag}, which it does not have")
    return problems


def _sentence(text: str, flag: str) -> str:
    """The clause of ``text`` around ``flag``'s first mention."""
    start = text.index(flag)
    left = max(text.rfind(mark, 0, start) for mark in ";.(")
    right = min((i for i in (text.find(mark, start) for mark in ";.)") if i >= 0), default=len(text))
    return text[left + 1 : right]


def test_the_walker_trips_on_a_planted_missing_flag():
    planted = "data.jsonl:3: malformed JSON (fix the row, or pass --on-error skip to skip and count it)"
    assert hint_problems(planted, "distill") == ["distill names --on-error, which it does not have"]
    assert hint_problems("run `mta distill --recipe R --frobnicate`", None) == ["`mta distill` has no --frobnicate"]
    assert hint_problems("run `mta distil --recipe R`", None) == ["`mta distil` is no command"]
    assert hint_problems(planted, "annotate") == []  # annotate has it
    assert hint_problems("not --force, which elsewhere recomputes a cache", "distill") == []
    assert hint_problems("not --force, which recomputes a cache", "distill") == [
        "distill names --force, which it does not have"
    ]


def test_every_help_names_flags_and_commands_that_exist():
    problems = {}
    for name, command in commands().items():
        texts = [command.help or ""] + [getattr(param, "help", None) or "" for param in command.params]
        found = [problem for text in texts for problem in hint_problems(text, name)]
        if found:
            problems[name] = found
    assert problems == {}


def error_of(monkeypatch, capsys, *args) -> str:
    code, lines = run_mta(monkeypatch, capsys, *args)
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, lines
    return errors[0]


def test_documented_error_paths_name_only_what_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(EXAMPLES.read_text(encoding="utf-8").splitlines()[0] + '\n{"prompt": "unterminated\n')

    # distill on a broken row: the way out is annotate's --on-error, named as annotate's.
    message = error_of(
        monkeypatch, capsys, "distill", "--recipe", "tiny", "-o", tmp_path / "run", f"data.train={bad}", "data.dev=null"
    )
    assert "bad.jsonl:2: malformed JSON: Unterminated string starting at column 12" in message
    assert "mta annotate" in message and "--on-error skip" in message
    assert hint_problems(message, "distill") == []

    # annotate names its own flag; a length that leaves no room for prompts names the other one.
    message = error_of(monkeypatch, capsys, "annotate", bad, "-r", "tiny", "-o", tmp_path / "ann")
    assert "--on-error skip" in message and hint_problems(message, "annotate") == []
    message = error_of(monkeypatch, capsys, "annotate", EXAMPLES, "-r", "tiny", "--max-length", "64")
    assert "--max-prompt-length" in message and hint_problems(message, "annotate") == []

    # -o and output_dir= naming two directories.
    message = error_of(monkeypatch, capsys, "distill", "--recipe", "tiny", "-o", "a", "output_dir=b")
    assert "-o a" in message and hint_problems(message, "distill") == []

    # init-student without a size, and with both.
    for options, expected in ((["--layers", "2", "--keep", "0,1"], "not both"), ([], "--layers K")):
        message = error_of(
            monkeypatch, capsys, "init-student", "--from", tmp_path / "nowhere", "-o", tmp_path / "s", *options
        )
        assert expected in message and hint_problems(message, "init-student") == []
    assert "not both" not in message

    # show on a model directory: never "annotate into that directory".
    model = tmp_path / "final"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    message = error_of(monkeypatch, capsys, "show", model)
    assert f"-o {model}" not in message and "-o NEW_DIR" in message and "a model" in message
    assert hint_problems(message, "show") == []


def test_a_directory_without_a_tokenizer_is_explained_by_annotate_as_by_evaluate(tmp_path, monkeypatch, capsys):
    weights = tmp_path / "weights-only"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    message = error_of(
        monkeypatch, capsys, "annotate", EXAMPLES, "--teacher", weights, "--student", weights, "-o", tmp_path / "a"
    )
    assert f"{weights} has no tokenizer (tokenizer.json / tokenizer_config.json)" in message
    assert "sentencepiece" not in message and "save_pretrained" in message


def test_a_second_distill_into_a_locked_directory_is_refused_before_models_load(tmp_path, monkeypatch, capsys):
    from mta.files import exclusive_lock
    from mta.training.lifecycle.run_directory import RUN_LOCK

    run = tmp_path / "run"
    run.mkdir()
    with exclusive_lock(run / RUN_LOCK, wait_s=0):  # another run holds it
        message = error_of(monkeypatch, capsys, "distill", "--recipe", "tiny", "-o", run)
        assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK]  # no models built, no data annotated
    assert "is training into" in message


def test_dev_samples_print_from_the_prompts_start_on_one_line():
    from mta_cli.reporting import PROMPT_CHARS, sample_parts

    prompt = "### Instruction:\nName a fruit.\n\n### Response:\n"
    shown, generation = sample_parts({"prompt": prompt, "generation": "A banana."})
    assert shown == repr(prompt) and generation == repr("A banana.") and "\n" not in shown
    long = "word " * 100
    shown = sample_parts({"prompt": long, "generation": ""})[0]
    assert shown.startswith("'word word") and shown.endswith("…'") and len(eval(shown)) == PROMPT_CHARS


def test_show_argument_and_row_default_read_as_a_user_types_them():
    show = commands()["show"]
    (argument,) = [param for param in show.params if param.param_type_name == "argument"]
    assert argument.metavar == "DIR"
    (row,) = [param for param in show.params if "--row" in param.opts]
    assert "[default: 0]" in row.help and "(0)" not in row.help


def test_the_annotate_summary_says_what_dropped_means():
    from mta_cli.commands.annotate import print_summary
    from mta_cli.consoles import WholeConsole

    buffer = io.StringIO()
    print_summary(WholeConsole(file=buffer), {"rows": {"read": 1}, "spans": {"word_spans": 3, "word_spans_dropped": 1}})
    assert "(+1 dropped)" in buffer.getvalue() and "dropped: spans left out because" in buffer.getvalue()
