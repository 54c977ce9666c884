"""The store's trust rules on manifests (mta.store.manifests), each refusal's whole message: what
mutation testing (bench/mutation.py) found the annotate tests leave unchecked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mta.errors import MtaError
from mta.store import manifests
from mta.store.layout import META, STAGING
from mta.store.manifests import (
    check_directory,
    checked_manifest,
    incomplete_message,
    part_is_intact,
    read_manifest,
    read_manifest_json,
    read_shard_manifest,
    shard_files,
    shard_sets,
)

PART = "part-00000-of-00002-run1.parquet"
DIGEST = "0" * 64


def shard(index: int = 0, total: int = 2, **changes) -> dict:
    """A shard manifest of shard ``index`` of ``total``, with ``changes`` laid over it."""
    part = f"part-{index:05d}-of-{total:05d}-run1.parquet"
    return {
        "shard": index,
        "num_shards": total,
        "run_key": "key",
        "counts": {"rows": 1},
        "skipped_examples": [],
        "description": {"artefact": "annotations"},
        "part": {"file": part, "rows": 1, "sha256": DIGEST},
        **changes,
    }


def write_json(path: Path, value) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def refusal(path: Path, directory: Path, entry: str, problem: str) -> str:
    return (
        f"{path}: {entry} {problem}. The file was changed by hand or by another program, so "
        f"{directory} is refused (nothing in it was read or deleted); annotate the input again "
        "into a new directory (`mta annotate DATA.jsonl ... -o NEW_DIR`)"
    )


def refused_message(call, *args) -> str:
    with pytest.raises(MtaError) as refused:
        call(*args)
    return str(refused.value)


# --- reading the JSON -------------------------------------------------------------------------------


def test_a_manifest_file_is_none_when_absent_and_refused_when_corrupt_or_unreadable(tmp_path):
    path = tmp_path / "manifest.json"
    assert read_manifest_json(path) is None
    path.write_text("{", encoding="utf-8")
    assert refused_message(read_manifest_json, path).startswith(f"{path} is corrupt (Expecting ")
    assert refused_message(read_manifest_json, path).endswith("); delete it and re-run `mta annotate`")
    path.write_bytes(b'{"a": "\xff"}')
    assert refused_message(read_manifest_json, path).startswith(f"{path} is corrupt ('utf-8' codec can't decode")
    path.unlink()
    path.mkdir()
    assert refused_message(read_manifest_json, path) == f"cannot read {path}: Is a directory"


# --- manifest.json ----------------------------------------------------------------------------------


def test_a_manifest_that_is_not_an_object_or_has_no_part_list_is_refused_naming_the_directory(tmp_path):
    path = tmp_path / META / "manifest.json"
    assert refused_message(checked_manifest, path, [1]) == refusal(
        path, tmp_path, "the content", "is a JSON list, not an object"
    )
    assert refused_message(checked_manifest, path, {"parts": None}) == refusal(
        path, tmp_path, "parts", "is None, not a list of part entries"
    )
    legacy = tmp_path / "manifest.json"  # layout 1: beside the parts
    assert refused_message(checked_manifest, legacy, {}) == refusal(
        legacy, tmp_path, "parts", "is None, not a list of part entries"
    )


@pytest.mark.parametrize(
    ("entry", "key", "problem"),
    [
        (3, "parts[1]", "is 3, not a part entry {file, rows, sha256}"),
        ({"rows": 1}, "parts[1].file", "is None, which is not a part of this directory"),
        ({"file": "../" + PART, "rows": 1}, "parts[1].file", f"is '../{PART}', which is not a part"),
        ({"file": "notes.txt", "rows": 1}, "parts[1].file", "is 'notes.txt', which is not a part"),
        ({"file": PART, "rows": -1}, "parts[1].rows", "is -1, not a row count"),
        ({"file": PART, "rows": True}, "parts[1].rows", "is True, not a row count"),
        ({"file": PART, "rows": "1"}, "parts[1].rows", "is '1', not a row count"),
        ({"file": PART, "rows": 1, "sha256": "abc"}, "parts[1].sha256", "is 'abc', not a hex sha256"),
        ({"file": PART, "rows": 1, "sha256": "A" * 64}, "parts[1].sha256", f"is '{'A' * 64}', not a hex sha256"),
        ({"file": PART, "rows": 1, "sha256": 7}, "parts[1].sha256", "is 7, not a hex sha256"),
    ],
)
def test_a_part_entry_that_is_not_a_plain_part_with_rows_and_a_sha256_is_refused(tmp_path, entry, key, problem):
    path = tmp_path / META / "manifest.json"
    good = {"file": PART, "rows": 0, "sha256": None}
    message = refused_message(checked_manifest, path, {"parts": [good, entry]})
    assert message.startswith(f"{path}: {key} {problem}")
    assert f"so {tmp_path} is refused" in message
    if key.endswith(".file"):
        assert "(a plain file name part-IIIII-of-NNNNN-<run>.parquet inside it)" in message


def test_good_part_entries_pass_as_they_are(tmp_path):
    manifest = {"parts": [{"file": PART, "rows": 0}, {"file": PART, "rows": 5, "sha256": DIGEST}]}
    assert checked_manifest(tmp_path / META / "manifest.json", manifest) is manifest


@pytest.mark.parametrize("where", [".", STAGING])
def test_a_part_name_that_is_a_link_out_of_the_directory_is_refused(tmp_path, where):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / PART).write_bytes(b"x")
    out = tmp_path / "out"
    (out / META / STAGING).mkdir(parents=True)
    link = out / PART if where == "." else out / META / STAGING / PART
    link.symlink_to(elsewhere / PART)
    path = out / META / "manifest.json"
    message = refused_message(checked_manifest, path, {"parts": [{"file": PART, "rows": 1}]})
    assert message.startswith(f"{path}: parts[0].file is '{PART}', which is not a part of this directory")


def test_read_manifest_checks_the_parts_and_is_none_without_a_manifest(tmp_path):
    assert read_manifest(tmp_path) is None
    write_json(tmp_path / META / "manifest.json", {"parts": [{"file": "x", "rows": 1}]})
    assert "parts[0].file is 'x'" in refused_message(read_manifest, tmp_path)


# --- shard manifests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "key", "problem"),
    [
        ({"shard": "0"}, "shard", "is '0', not a int"),
        ({"num_shards": 2.5}, "num_shards", "is 2.5, not a int"),
        ({"run_key": None}, "run_key", "is None, not a str"),
        ({"counts": []}, "counts", "is [], not a dict"),
        ({"skipped_examples": {}}, "skipped_examples", "is {}, not a list"),
        ({"description": "x"}, "description", "is 'x', not a dict"),
        ({"shard": 1}, "shard/num_shards", "are 1/2, not the file's name"),
        ({"part": {"file": PART, "rows": None}}, "part.rows", "is None, not a row count"),
    ],
)
def test_a_shard_manifest_with_a_field_of_the_wrong_kind_or_name_is_refused(tmp_path, changes, key, problem):
    path = write_json(tmp_path / META / "shard-00000-of-00002.json", shard(**changes))
    assert refused_message(read_shard_manifest, tmp_path, 0, 2) == refusal(path, tmp_path, key, problem)


def test_a_shard_manifest_that_is_not_an_object_is_refused(tmp_path):
    path = write_json(tmp_path / META / "shard-00000-of-00002.json", [])
    assert refused_message(read_shard_manifest, tmp_path, 0, 2) == refusal(
        path, tmp_path, "the content", "is a JSON list, not an object"
    )


def test_shard_files_are_found_by_their_exact_names_in_either_layout(tmp_path):
    assert read_shard_manifest(tmp_path, 0, 2) is None
    modern = write_json(tmp_path / META / "shard-00001-of-00002.json", shard(1))
    write_json(tmp_path / META / "shard-1-of-2.json", {"not": "a shard"})  # not a shard file's name
    legacy = write_json(tmp_path / "shard-00000-of-00002.json", shard(0))
    assert shard_files(tmp_path) == {modern: shard(1)}
    assert shard_files(tmp_path, legacy=True) == {legacy: shard(0)}
    assert read_shard_manifest(tmp_path, 1, 2) == shard(1)


def test_check_directory_refuses_a_bad_file_of_either_layout(tmp_path):
    check_directory(tmp_path)  # an empty directory: nothing to refuse
    write_json(tmp_path / "shard-00000-of-00002.json", shard(0, run_key=3))
    assert "run_key is 3, not a str" in refused_message(check_directory, tmp_path)
    (tmp_path / "shard-00000-of-00002.json").unlink()
    write_json(tmp_path / "manifest.json", {"parts": 1})
    assert refused_message(check_directory, tmp_path) == refusal(
        tmp_path / "manifest.json", tmp_path, "parts", "is 1, not a list of part entries"
    )
    (tmp_path / "manifest.json").unlink()
    write_json(tmp_path / META / "shard-00001-of-00002.json", shard(1, counts=None))
    assert "counts is None, not a dict" in refused_message(check_directory, tmp_path)


# --- parts and sets ---------------------------------------------------------------------------------


def test_a_part_is_intact_when_present_with_the_recorded_sha256_or_none_recorded(tmp_path, monkeypatch):
    from mta.hashing import file_sha256

    entry = {"file": PART, "rows": 1}
    assert not part_is_intact(tmp_path, {**entry, "sha256": None})  # missing
    (tmp_path / PART).write_bytes(b"rows")
    assert part_is_intact(tmp_path, {**entry, "sha256": None})
    assert part_is_intact(tmp_path, {**entry, "sha256": file_sha256(tmp_path / PART)})
    assert not part_is_intact(tmp_path, {**entry, "sha256": DIGEST})

    def unreadable(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(manifests, "file_sha256", unreadable)
    assert not part_is_intact(tmp_path, {**entry, "sha256": DIGEST})


def test_an_incomplete_directory_names_its_fullest_set_and_the_shards_it_misses(tmp_path):
    shards = [shard(i, 12, run_key="big") for i in (0,)] + [shard(i, 3, run_key="small") for i in (0, 2)]
    by_set = shard_sets(shards)
    assert by_set == {("big", 12): {0}, ("small", 3): {0, 2}}
    assert incomplete_message(tmp_path, by_set) == (
        f"{tmp_path} is incomplete: 2 of 3 shards are written (missing: 1). Run the missing shards "
        "with `mta annotate ... --shard I/3`; the last one writes manifest.json (or run "
        "`mta annotate --merge` afterwards)"
    )
    assert incomplete_message(tmp_path, {("big", 12): {0}}).startswith(
        f"{tmp_path} is incomplete: 1 of 12 shards are written (missing: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 ...). "
    )
    assert "(missing: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)." in incomplete_message(tmp_path, {("k", 11): {0}})
