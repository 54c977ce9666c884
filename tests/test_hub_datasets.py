"""Hub dataset ids wherever a data file is accepted (mta.data.sources.HubDataset, issue 31).

The Hub cache here is a real one: the layout huggingface_hub writes (``datasets--OWNER--NAME/
blobs/<sha256>``, ``snapshots/<commit>/...`` symlinks to the blobs, ``refs/main``), built by the
test, read with ``HF_DATASETS_OFFLINE=1``. Checked:

- a Hub split annotates to exactly the rows of the JSONL of the same content, and the manifest
  records the id, the commit (never "main") and the split; the command line takes ``--split``,
  ``--revision`` and ``--field``;
- an existing local path of an id's spelling wins; an id that is not cached fails offline within
  seconds naming the offline setting, and so does one when the Hub cannot be reached; a cached id
  still loads then; a wrong split names the splits there are;
- a recipe's ``data.train`` / ``data.dev`` read their splits (``data.train_split``,
  ``data.dev_split``); ``mta generate`` and ``mta evaluate`` read a Hub set and record its commit;
- an in-memory ``datasets.Dataset`` annotates through the Python API as its JSONL does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

from conftest import EXAMPLES, subprocess_env
from fixtures.hub import cache_dataset, qa_rows
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.data.sources import HubDataset, input_reference
from mta.errors import MtaError
from mta.models import hub

REPO = "acme/qa"
COMMIT = "4c1b2d8e9f0a1b2c3d4e5f60718293a4b5c6d7e8"
FIELDS = {"prompt": "question", "response": "answer"}
LINES = EXAMPLES.read_text(encoding="utf-8").splitlines()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"prompt": r["question"], "response": r["answer"]}) + "\n" for r in rows))
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A Hub cache holding acme/qa (train: 4 example rows, test: 2 others), offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache_dataset(cache, REPO, COMMIT, {"train": qa_rows(LINES[:4]), "test": qa_rows(LINES[4:6])})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return cache


@pytest.fixture(scope="module")
def settings(tiny_tokenizer_dir) -> AnnotateSettings:
    return AnnotateSettings(
        teacher=str(tiny_tokenizer_dir),
        student=str(tiny_tokenizer_dir),
        max_length=512,
        max_prompt_length=384,
        workers=1,
    )


def test_a_hub_split_annotates_offline_to_the_rows_of_its_jsonl_and_records_the_commit(hub_cache, tmp_path, settings):
    reference = read_annotations(
        run_annotate(write_jsonl(tmp_path / "train.jsonl", qa_rows(LINES[:4])), tmp_path / "j", settings).directory
    )
    mapped = AnnotateSettings(**{**settings.__dict__, "fields": FIELDS})
    outcome = run_annotate(input_reference(REPO), tmp_path / "hub-train", mapped)
    annotations = read_annotations(outcome.directory)
    assert annotations.table.equals(reference.table)
    recorded = annotations.manifest["input"]
    assert {k: recorded[k] for k in ("hub_id", "revision", "split", "subset", "format", "rows")} == {
        "hub_id": REPO,
        "revision": COMMIT,
        "split": "train",
        "subset": None,
        "format": "hub",
        "rows": 4,
    }
    # The same id, split and commit again: reused; the test split is another artefact.
    assert run_annotate(HubDataset(REPO, "train", revision=COMMIT), tmp_path / "hub-train", mapped).reused
    test = read_annotations(run_annotate(HubDataset(REPO, "test"), tmp_path / "hub-test", mapped).directory)
    assert test.manifest["input"]["split"] == "test" and test.table.num_rows == 2


def test_a_local_path_wins_over_an_id_and_split_options_need_an_id(hub_cache, tmp_path, settings, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(Path("acme").mkdir() or Path("acme") / "qa", qa_rows(LINES[6:8]))  # a file named like the id
    assert input_reference(REPO) == Path(REPO)
    annotations = read_annotations(run_annotate(input_reference(REPO), tmp_path / "local", settings).directory)
    assert annotations.manifest["input"]["format"] == "jsonl" and annotations.table.num_rows == 2
    with pytest.raises(MtaError, match="is a local path; split test applies to a Hugging Face Hub dataset id"):
        input_reference(REPO, split="test")
    assert input_reference("data/train.jsonl") == Path("data/train.jsonl")  # a missing file, not an id


def test_what_the_cache_cannot_give_fails_within_seconds_saying_why(hub_cache, tmp_path, settings, monkeypatch):
    mapped = AnnotateSettings(**{**settings.__dict__, "fields": FIELDS})
    started = time.monotonic()
    with pytest.raises(
        MtaError,
        match=r"dataset 'acme/other' is not a local path and not in the Hugging Face cache .*HF_DATASETS_OFFLINE=1",
    ):
        run_annotate(HubDataset("acme/other"), tmp_path / "o", mapped)
    with pytest.raises(MtaError, match="at revision 'v2' is not a local path"):
        run_annotate(HubDataset(REPO, revision="v2"), tmp_path / "o", mapped)
    with pytest.raises(MtaError, match=r"Unknown split \"validation\". Should be one of \['train', 'test'\]"):
        run_annotate(HubDataset(REPO, "validation"), tmp_path / "o", mapped)
    with pytest.raises(MtaError, match="has no column 'query'"):
        run_annotate(
            HubDataset(REPO), tmp_path / "o", AnnotateSettings(**{**settings.__dict__, "fields": {"prompt": "query"}})
        )
    # Online, with the Hub unreachable (a closed port): a cached id still loads, another fails fast.
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hub, "endpoint", lambda: "http://127.0.0.1:9")
    hub.unreachable_reason.cache_clear()
    try:
        with pytest.raises(
            MtaError,
            match=r"Hub at http://127.0.0.1:9 cannot be reached .*hf download --repo-type dataset acme/other",
        ):
            run_annotate(HubDataset("acme/other"), tmp_path / "o", mapped)
        assert hub.dataset_snapshot(REPO) == (hub_cache / "datasets--acme--qa" / "snapshots" / COMMIT, COMMIT)
    finally:
        hub.unreachable_reason.cache_clear()
    assert time.monotonic() - started < 20
    assert not (tmp_path / "o").exists()


def test_the_command_line_annotates_an_id_offline(hub_cache, tmp_path, tiny_tokenizer_dir):
    command = [sys.executable, "-m", "mta_cli.main", "annotate", REPO, "--split", "test", "--revision", COMMIT]
    command += ["--teacher", str(tiny_tokenizer_dir), "--student", str(tiny_tokenizer_dir), "--workers", "1"]
    command += ["--field", "prompt=question", "--field", "response=answer", "-o", str(tmp_path / "cli")]
    env = subprocess_env(
        HF_HUB_CACHE=str(hub_cache), HF_DATASETS_CACHE=str(tmp_path / "dc"), HF_DATASETS_OFFLINE="1", COLUMNS="400"
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    recorded = read_annotations(tmp_path / "cli").manifest["input"]
    assert (recorded["hub_id"], recorded["revision"], recorded["split"], recorded["rows"]) == (REPO, COMMIT, "test", 2)
    missing = subprocess.run(
        command[:4] + ["acme/none"] + command[5:], env=env, capture_output=True, text=True, timeout=300
    )
    assert missing.returncode != 0 and "not in the Hugging Face cache" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_recipe_reads_the_train_and_dev_splits_of_an_id(hub_cache, tmp_path, settings, tiny_tokenizer_dir):
    from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint
    from mta.training.config.schema import Recipe
    from mta.training.train_data import load_split

    recipe = Recipe.model_validate(
        {
            "name": "hub",
            "output_dir": str(tmp_path / "run"),
            "teacher": {"path": "unused", "tokenizer": str(tiny_tokenizer_dir)},
            "student": {"path": "unused", "tokenizer": str(tiny_tokenizer_dir)},
            "data": {
                "train": REPO,
                "dev": REPO,
                "dev_split": "test",
                "max_length": settings.max_length,
                "max_prompt_length": settings.max_prompt_length,
                "fields": FIELDS,
            },
            "train": {"max_steps": 1},
        }
    )
    fingerprint = tokenizer_fingerprint(load_tokenizer(tiny_tokenizer_dir))
    splits = {
        split: load_split(
            recipe,
            split,
            teacher_tokenizer=str(tiny_tokenizer_dir),
            student_tokenizer=str(tiny_tokenizer_dir),
            fingerprints={"teacher": fingerprint, "student": fingerprint},
        )
        for split in ("train", "dev")
    }
    assert {name: (a.manifest["input"]["split"], a.table.num_rows) for name, a in splits.items()} == {
        "train": ("train", 4),
        "dev": ("test", 2),
    }
    assert splits["train"].directory == tmp_path / "run" / "data" / "train"


def test_generate_and_evaluate_read_a_hub_set_and_record_its_commit(hub_cache, tmp_path, tiny_model_dir, one_thread):
    from mta.evaluation import EvalSettings, evaluate_checkpoints
    from mta.pairs.generate import PairSettings, generate_pairs

    few = dict(max_new_tokens=3, max_prompt_length=32, batch_size=4, device="cpu", dtype="fp32")
    outcome = generate_pairs(
        tiny_model_dir,
        tiny_model_dir,
        HubDataset(REPO, "test"),
        tmp_path / "pairs.jsonl",
        PairSettings(fields=FIELDS, **few),
    )
    pairs = [json.loads(line) for line in outcome.path.read_text().splitlines()]
    assert [p["prompt"] for p in pairs] == [r["question"] for r in qa_rows(LINES[4:6])]

    settings = EvalSettings(
        benchmarks=[REPO], seeds=[1], limit=2, fields={"prompt": "question", "output": "answer"}, **few
    )
    results = evaluate_checkpoints([tiny_model_dir], out_dir=tmp_path / "eval", settings=settings)
    described = results["sets"]["qa"]
    assert (described["hub_id"], described["revision"], described["split"], described["rows"]) == (
        REPO,
        COMMIT,
        "test",
        2,
    )
    assert results["checkpoints"][next(iter(results["checkpoints"]))]["sets"]["qa"]["rougeL"]["mean"] >= 0


def test_an_in_memory_dataset_annotates_as_its_jsonl(tmp_path, settings):
    import mta

    rows = qa_rows(LINES[:3])
    reference = read_annotations(
        run_annotate(write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "j", settings).directory
    )
    table = datasets.Dataset.from_list(rows)
    mapped = AnnotateSettings(**{**settings.__dict__, "fields": FIELDS})
    directory = mta.annotate(table, tmp_path / "memory", mapped)
    annotations = read_annotations(directory)
    assert annotations.table.equals(reference.table)
    assert annotations.manifest["input"]["format"] == "in-memory"
    assert run_annotate(datasets.Dataset.from_list(rows), tmp_path / "memory", mapped).reused  # keyed on the rows
    other = datasets.Dataset.from_list(qa_rows(LINES[1:4]))
    assert not run_annotate(other, tmp_path / "memory2", mapped).reused
    annotator_rows = mta.Annotator(mapped).annotate(table)
    assert [r["teacher_input_ids"] for r in annotator_rows] == reference.table.column("teacher_input_ids").to_pylist()
    with pytest.raises(MtaError, match="DatasetDict with splits train: give one split"):
        mta.annotate(datasets.DatasetDict({"train": table}), tmp_path / "dict", mapped)
