"""`mta annotate` under faults and hostile input: concurrent writers, planted manifests, swapped
or corrupt parts, a full disk, a directory as input, multi-megabyte rows, the rebuild hint."""

from __future__ import annotations

import errno
import json
import multiprocessing
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import EXAMPLES, REPO
from fixtures.annotate import EDGE_ROWS, write_jsonl
from mta.data import annotate as annotate_module
from mta.data import truncation
from mta.data.annotate import AnnotateSettings, run_annotate
from mta.data.annotations import read_annotations
from mta.data.encoding import TokenizerSide
from mta.data.span_extraction import SpanExtractor
from mta.errors import MtaError
from mta.store import locks, publish
from mta.store.publish import merge_shards

LINES = EXAMPLES.read_text(encoding="utf-8").splitlines()


def rows_file(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def listing(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones, and ``.mta/``, included) and its bytes."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    """Run ``mta ARGS`` through the real entry point; (exit code, stderr on one line)."""
    from mta_cli.main import main

    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setattr(sys, "argv", ["mta", *map(str, args)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, " ".join(capsys.readouterr().err.split())


def annotate_args(data: Path, out: Path, settings: AnnotateSettings, *extra) -> list:
    return [
        "annotate",
        data,
        "--teacher",
        settings.teacher,
        "--student",
        settings.student,
        "--max-length",
        settings.max_length,
        "--max-prompt-length",
        settings.max_prompt_length,
        "--workers",
        1,
        "-o",
        out,
        *extra,
    ]


@pytest.fixture(scope="module")
def settings(two_tokenizer_settings) -> AnnotateSettings:
    return two_tokenizer_settings


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return rows_file(tmp_path_factory.mktemp("input") / "small.jsonl", LINES[:6])


@pytest.fixture(scope="module")
def built(tmp_path_factory, small, settings) -> Path:
    """A finished artefact of ``small``; tests work on copies."""
    out = tmp_path_factory.mktemp("built") / "out"
    run_annotate(small, out, settings)
    return out


@pytest.fixture
def copy(tmp_path, built) -> Path:
    """A copy of ``built`` two levels below tmp_path (so ``../../victim.txt`` is tmp_path's)."""
    return Path(shutil.copytree(built, tmp_path / "deep" / "out"))


# --------------------------------------------------------------------------- A: locks

HOLDER = """
import sys
from pathlib import Path
from mta.store.locks import merge_lock, shard_lock
out, which = Path(sys.argv[1]), sys.argv[2]
if which == "merge":
    lock = merge_lock(out)
else:
    index, count = map(int, which.split("/"))
    lock = shard_lock(out, index, count)
with lock:
    print("held", flush=True)
    sys.stdin.read()
"""


def hold(out: Path, which: str) -> subprocess.Popen:
    """A separate process holding ``which`` ("I/N" or "merge") of ``out`` until killed."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), which],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "held"
    return process


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL


def test_a_second_writer_of_the_same_shard_is_refused_naming_the_holder(copy, small, settings, monkeypatch, capsys):
    before = listing(copy)
    holder = hold(copy, "0/1")
    try:
        code, message = cli(monkeypatch, capsys, *annotate_args(small, copy, settings, "--force"))
        assert code == 2
        assert f"another `mta annotate` (pid {holder.pid} on " in message
        assert str(copy / ".mta" / ".lock-shard-00000-of-00001") in message and "wait for it to finish" in message
        assert {k: v for k, v in listing(copy).items() if not k.startswith(".mta/.lock")} == before
    finally:
        kill(holder)
    # SIGKILL left the lock file (with the dead pid) behind, but the kernel released the lock.
    assert (copy / ".mta" / ".lock-shard-00000-of-00001").read_text().split()[0] == str(holder.pid)
    outcome = run_annotate(small, copy, settings, force=True)
    assert not outcome.reused and outcome.manifest is not None
    assert not [p for p in copy.rglob(".lock*")]  # released and removed
    assert read_annotations(copy).table.equals(read_annotations(outcome.directory).table)


def test_other_shards_run_beside_a_held_one_and_the_merge_waits_for_its_lock(
    tmp_path, small, settings, built, monkeypatch
):
    out = tmp_path / "sharded"
    out.mkdir()
    holder = hold(out, "0/2")
    try:
        assert run_annotate(small, out, settings, shard=1, num_shards=2).manifest is None
        with pytest.raises(MtaError, match=rf"pid {holder.pid} on .* is writing shard 0/2 of"):
            run_annotate(small, out, settings, shard=0, num_shards=2)
    finally:
        kill(holder)
    merger = hold(out, "merge")
    try:
        monkeypatch.setattr(locks, "MERGE_LOCK_WAIT_S", 0.0)  # refuse instead of waiting
        with pytest.raises(MtaError, match=rf"\.lock-merge has been held by pid {merger.pid} on "):
            run_annotate(small, out, settings, shard=0, num_shards=2)
        assert not (out / ".mta" / "manifest.json").exists()
    finally:
        kill(merger)
    last = run_annotate(small, out, settings, shard=0, num_shards=2)  # its shard was kept: reused
    assert last.manifest is not None and len(last.manifest["parts"]) == 2
    assert read_annotations(out).table.equals(read_annotations(built).table)


def _shard_writer(data, out, settings, shard, barrier) -> None:
    """Child process: annotate one shard, publishing it at the same moment as the other."""
    commit = annotate_module.commit_shard

    def together(out_dir, manifest):
        barrier.wait(timeout=120)
        return commit(out_dir, manifest)

    annotate_module.commit_shard = together
    annotate_module.run_annotate(data, out, settings, shard=shard, num_shards=2)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_two_shards_finishing_at_once_both_succeed_and_merge(tmp_path, small, settings, built):
    out = tmp_path / "together"
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    writers = [context.Process(target=_shard_writer, args=(small, out, settings, shard, barrier)) for shard in (0, 1)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert [writer.exitcode for writer in writers] == [0, 0]
    manifest = json.loads((out / ".mta" / "manifest.json").read_text())
    assert [part["file"][:19] for part in manifest["parts"]] == ["part-00000-of-00002", "part-00001-of-00002"]
    assert read_annotations(out).table.equals(read_annotations(built).table)
    assert sorted(listing(out)) == sorted(
        [
            ".mta/manifest.json",
            ".mta/shard-00000-of-00002.json",
            ".mta/shard-00001-of-00002.json",
            *(part["file"] for part in manifest["parts"]),
        ]
    )


# --------------------------------------------------------------------------- B: planted manifests


def plant(directory: Path, name: str, edit) -> None:
    path = directory / name
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


ENTRIES = ["../../victim.txt", "ABSOLUTE", "SYMLINK", "sub/part-00000-of-00001-0a1b2c3d.parquet"]


def hostile_entry(kind: str, directory: Path, victim: Path) -> str:
    if kind == "ABSOLUTE":
        return str(victim)
    if kind == "SYMLINK":  # a plain part name, but a link out of the directory
        (directory / "part-00000-of-00001-deadbeef.parquet").symlink_to(victim)
        return "part-00000-of-00001-deadbeef.parquet"
    return kind


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


@pytest.mark.parametrize("how", ["changed settings", "force", "read", "show"])
@pytest.mark.parametrize("kind", ENTRIES)
def test_a_manifest_naming_a_path_outside_is_refused_and_nothing_is_deleted(
    copy, small, settings, victim, kind, how, monkeypatch, capsys
):
    entry = hostile_entry(kind, copy, victim)
    plant(copy, ".mta/manifest.json", lambda m: m["parts"][0].update(file=entry))
    before = listing(copy)
    if how == "show":
        code, message = cli(monkeypatch, capsys, "show", copy)
        assert code == 2
    else:
        with pytest.raises(MtaError) as error:
            if how == "read":
                read_annotations(copy)
            elif how == "force":
                run_annotate(small, copy, settings, force=True)
            else:
                run_annotate(small, copy, AnnotateSettings(**{**settings.__dict__, "word_spans": "all"}))
        message = str(error.value)
    assert (
        f"{copy / '.mta' / 'manifest.json'}: parts[0].file is {entry!r}, which is not a part of this directory"
        in message
    )
    assert "annotate the input again into a new directory" in message
    assert victim.read_text() == "precious"
    assert listing(copy) == before  # nothing written, nothing deleted


@pytest.mark.parametrize("kind", ["../../victim.txt", "ABSOLUTE"])
@pytest.mark.parametrize("shard_file", ["shard-00000-of-00001.json", "shard-00001-of-00002.json"])
def test_a_shard_file_naming_a_path_outside_is_refused_and_nothing_is_deleted(
    copy, small, settings, victim, kind, shard_file
):
    entry = hostile_entry(kind, copy, victim)
    shard = json.loads((copy / ".mta" / "shard-00000-of-00001.json").read_text())
    if shard_file == "shard-00001-of-00002.json":  # a stray shard of another run, to be superseded
        shard.update(shard=1, num_shards=2, run_key="sha256:other")
    shard["part"]["file"] = entry
    (copy / ".mta" / shard_file).write_text(json.dumps(shard))
    before = listing(copy)
    for attempt in (
        lambda: run_annotate(small, copy, AnnotateSettings(**{**settings.__dict__, "word_spans": "all"})),
        lambda: run_annotate(small, copy, settings, force=True),
        lambda: merge_shards(copy),
    ):
        with pytest.raises(
            MtaError, match=rf"{shard_file}: part\.file is {re.escape(repr(entry))}, which is not a part"
        ):
            attempt()
    (copy / ".mta" / "manifest.json").unlink()  # the reader reads shard files to say what is missing
    with pytest.raises(MtaError, match=rf"{shard_file}: part\.file is {re.escape(repr(entry))}"):
        read_annotations(copy)
    assert victim.read_text() == "precious"
    assert {k: v for k, v in listing(copy).items() if k != ".mta/manifest.json"} == {
        k: v for k, v in before.items() if k != ".mta/manifest.json"
    }


# --------------------------------------------------------------------------- C, D: integrity


@pytest.fixture(scope="module")
def other_built(tmp_path_factory, settings) -> Path:
    """An artefact of other rows, with the same settings: its part is valid, but not ``built``'s."""
    data = rows_file(tmp_path_factory.mktemp("other") / "other.jsonl", LINES[6:12])
    out = tmp_path_factory.mktemp("other-built") / "out"
    run_annotate(data, out, settings)
    return out


def only_part(directory: Path) -> Path:
    (part,) = directory.glob("part-*.parquet")
    return part


def test_a_part_swapped_for_another_valid_one_is_refused_naming_it(
    copy, built, other_built, small, settings, monkeypatch, capsys
):
    from mta_cli.main import app

    part = only_part(copy)
    shutil.copyfile(only_part(other_built), part)
    recorded = json.loads((copy / ".mta" / "manifest.json").read_text())["parts"][0]["rows"]
    assert pq.read_table(part).num_rows == recorded  # a valid part, with the right number of rows
    with pytest.raises(MtaError) as error:
        read_annotations(copy)
    message = str(error.value)
    assert f"{part} does not match manifest.json: its sha256 is " in message
    assert "changed or replaced after `mta annotate` wrote it" in message
    assert f"-o {copy}-rebuilt`" in message and "--force" not in message
    code, shown = cli(monkeypatch, capsys, "show", copy)
    assert code == 2 and f"{part} does not match manifest.json" in shown

    # The suggested command works: it rebuilds the artefact beside the directory.
    command = shlex.split(message.split("`")[-2])
    assert command[:2] == ["mta", "annotate"]
    result = CliRunner().invoke(app, command[1:] + ["--workers", "1"])
    assert result.exit_code == 0, result.output
    rebuilt = Path(f"{copy}-rebuilt")
    assert read_annotations(rebuilt).table.equals(read_annotations(built).table)
    # And annotate into the directory itself does not reuse the tampered artefact.
    outcome = run_annotate(small, copy, settings)
    assert not outcome.reused
    assert read_annotations(copy).table.equals(read_annotations(rebuilt).table)
    assert not part.exists()  # superseded


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
@pytest.mark.parametrize("checksum", [True, False], ids=["sha256 recorded", "no sha256"])
def test_a_corrupt_part_is_refused_naming_it(copy, damage, checksum):
    part = only_part(copy)
    data = part.read_bytes()
    part.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00not parquet" * 50, "empty": b""}[damage])
    if not checksum:
        plant(copy, ".mta/manifest.json", lambda m: m["parts"][0].pop("sha256"))
    with pytest.raises(MtaError) as error:
        read_annotations(copy)
    expected = "does not match manifest.json" if checksum else "is not a readable Parquet file"
    assert f"{part} {expected}" in str(error.value)
    assert "Annotate the input again into a new directory" in str(error.value)


def test_a_row_count_that_disagrees_is_refused(copy):
    rows = json.loads((copy / ".mta" / "manifest.json").read_text())["parts"][0]["rows"]
    plant(copy, ".mta/manifest.json", lambda m: (m["parts"][0].pop("sha256"), m["parts"][0].update(rows=rows + 1)))
    with pytest.raises(MtaError, match=rf"part-.*\.parquet has {rows} rows, manifest\.json says {rows + 1}"):
        read_annotations(copy)


# --------------------------------------------------------------------------- E: a full disk


class FullDisk(pq.ParquetWriter):
    """A Parquet writer on a disk that fills up at the first row group."""

    def write_table(self, table, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_writing_the_part_loses_nothing(copy, small, settings, monkeypatch, capsys):
    before, table = listing(copy), read_annotations(copy).table
    monkeypatch.setattr(publish.pq, "ParquetWriter", FullDisk)
    code, message = cli(monkeypatch, capsys, *annotate_args(small, copy, settings, "--force"))
    assert code == 2
    assert f"disk full while writing {copy}/.mta/staging/part-00000-of-00001-" in message
    assert "nothing was lost" in message and "free space and re-run the same command" in message
    assert listing(copy) == before  # no temporary file, no lock file, no new part
    assert read_annotations(copy).table.equals(table)

    fresh = copy.parent / "fresh"
    with pytest.raises(MtaError, match="disk full while writing"):
        run_annotate(small, fresh, settings)
    assert not fresh.exists()


def test_a_full_disk_while_publishing_the_shard_loses_nothing(copy, small, settings, monkeypatch):
    before, table = listing(copy), read_annotations(copy).table

    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(publish, "atomic_write_json", full)
    with pytest.raises(MtaError, match=rf"disk full while writing {copy}; nothing was lost"):
        run_annotate(small, copy, settings, force=True)
    assert listing(copy) == before  # the new part, referenced by nothing, was removed
    assert read_annotations(copy).table.equals(table)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_really_full_disk_loses_nothing(tiny_disk, small, settings):
    out = tiny_disk / "out"
    run_annotate(small, out, settings)
    before, table = listing(out), read_annotations(out).table
    filler = tiny_disk / "filler"
    with open(filler, "wb", buffering=0) as handle:  # fill the disk to the last byte
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
    with pytest.raises(MtaError, match="disk full while writing .*; nothing was lost"):
        run_annotate(small, out, settings, force=True)
    assert listing(out) == before
    assert read_annotations(out).table.equals(table)
    filler.unlink()
    assert not run_annotate(small, out, settings, force=True).reused  # with space, it goes through


# --------------------------------------------------------------------------- F: input paths


def test_a_directory_as_input_says_what_to_give(tmp_path, built, settings, monkeypatch, capsys):
    folder = tmp_path / "dolly"
    folder.mkdir()
    rows_file(folder / "train.jsonl", LINES[:2])
    code, message = cli(monkeypatch, capsys, *annotate_args(folder, tmp_path / "out", settings))
    assert code == 2
    assert f"the input {folder} is a directory, not a JSONL file; it holds train.jsonl" in message
    assert f"`mta annotate {folder / 'train.jsonl'} -o OUT_DIR`" in message
    assert not (tmp_path / "out").exists()

    (folder / "train.jsonl").unlink()
    with pytest.raises(MtaError, match="is a directory, not a JSONL file; give the JSONL file itself"):
        run_annotate(folder, tmp_path / "out", settings)
    with pytest.raises(MtaError, match="is a directory holding an `mta annotate` output, not input rows"):
        run_annotate(built, tmp_path / "out", settings)
    with pytest.raises(MtaError, match="input file not found"):
        run_annotate(tmp_path / "nope.jsonl", tmp_path / "out", settings)


# --------------------------------------------------------------------------- G: cost of long rows


UNBOUNDED = {"WINDOW_CHARS_PER_TOKEN": 10**9, "PARSE_MARGIN_CHARS": 10**9}  # the former behaviour


def annotate_table(data: Path, out: Path, settings: AnnotateSettings, monkeypatch, **constants):
    with monkeypatch.context() as patched:
        for name, value in constants.items():
            patched.setattr(truncation, name, value)
        run_annotate(data, out, settings)
    return read_annotations(out).table


@pytest.mark.parametrize("limits", [(256, 160, False), (64, 48, True)], ids=["256", "64-truncate-prompt"])
def test_bounded_encoding_and_parsing_leave_ordinary_rows_as_they_were(tmp_path, settings, monkeypatch, limits):
    max_length, max_prompt_length, truncate_prompt = limits
    rows = [json.loads(line) for line in LINES] + EDGE_ROWS
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    settings = AnnotateSettings(
        **{
            **settings.__dict__,
            "max_length": max_length,
            "max_prompt_length": max_prompt_length,
            "truncate_prompt": truncate_prompt,
            "on_error": "skip",
        }
    )
    before = annotate_table(data, tmp_path / "unbounded", settings, monkeypatch, **UNBOUNDED)
    assert read_annotations(tmp_path / "unbounded").manifest["rows"]["response_cut"] >= 1
    assert annotate_table(data, tmp_path / "default", settings, monkeypatch).equals(before)
    # Tiny windows: every row goes through the head windows and their growth.
    stressed = annotate_table(
        data, tmp_path / "stressed", settings, monkeypatch, WINDOW_CHARS_PER_TOKEN=1, LOCALITY_CHARS=200
    )
    assert stressed.equals(before)


def test_a_multi_megabyte_response_is_encoded_and_parsed_only_near_the_cut(tmp_path, settings, monkeypatch):
    sentence = "The river carries cold water from the mountains down to the quiet sea. "
    huge = {"instruction": "Describe the river.", "input": "", "output": sentence * 45_000}  # 3.2 MB
    normal = EDGE_ROWS[7]
    data = write_jsonl(tmp_path / "huge.jsonl", [normal, huge])
    parsed, encoded = [], []
    pipe, encode = SpanExtractor.pipe, TokenizerSide.encode
    monkeypatch.setattr(
        SpanExtractor, "pipe", lambda self, texts, **kw: (parsed.extend(map(len, texts)), pipe(self, texts, **kw))[1]
    )
    monkeypatch.setattr(TokenizerSide, "encode", lambda self, text: (encoded.append(len(text)), encode(self, text))[1])
    out = tmp_path / "out"
    run_annotate(data, out, settings)
    table = read_annotations(out).table
    kept = table.column("text").to_pylist()[1]
    assert len(huge["output"]) > 3_000_000 and len(kept) < 2_000  # cut to max_length tokens
    assert max(parsed) <= len(kept) + truncation.PARSE_MARGIN_CHARS
    window = settings.max_length * truncation.WINDOW_CHARS_PER_TOKEN + truncation.LOCALITY_CHARS
    assert max(encoded) <= window  # the first window decided it; nothing near 3 MB was encoded

    # The same row with everything past 20k characters removed, annotated the former way.
    short = dict(huge, output=huge["output"][:20_000])
    reference = annotate_table(
        write_jsonl(tmp_path / "short.jsonl", [normal, short]), tmp_path / "ref", settings, monkeypatch, **UNBOUNDED
    )
    assert table.equals(reference)


def test_a_multi_megabyte_prompt_is_skipped_without_encoding_it_whole(tmp_path, settings, monkeypatch):
    prompt_row = {"prompt": "Summarise: " + "words and more words " * 150_000, "response": "Done."}
    encoded = []
    encode = TokenizerSide.encode
    monkeypatch.setattr(TokenizerSide, "encode", lambda self, text: (encoded.append(len(text)), encode(self, text))[1])
    data = write_jsonl(tmp_path / "rows.jsonl", [EDGE_ROWS[7], prompt_row])
    out = tmp_path / "out"
    run_annotate(data, out, AnnotateSettings(**{**settings.__dict__, "on_error": "skip"}))
    manifest = read_annotations(out).manifest
    assert manifest["skipped"] == {"prompt_too_long": 1}
    assert "the prompt is at least " in manifest["skipped_examples"][0]
    assert max(encoded) < 100_000


# --------------------------------------------------------------------------- H: the rebuild hint


def test_mismatched_annotations_name_a_command_into_a_new_directory_that_works(
    tmp_path, copy, small, settings, tiny_tokenizer_dir, other_tokenizer_dir
):
    from mta.models.tokenizers import load_tokenizer, tokenizer_fingerprint
    from mta.training.config.schema import Recipe
    from mta.training.train_data import check_manifest
    from mta_cli.main import app

    recipe = Recipe.model_validate(
        {
            "name": "longer",
            "output_dir": str(tmp_path / "run"),
            "teacher": {"path": "unused", "tokenizer": str(tiny_tokenizer_dir)},
            "student": {"path": "unused", "tokenizer": str(other_tokenizer_dir)},
            "data": {"train": str(copy), "max_length": 300, "max_prompt_length": 200},
            "train": {"max_steps": 1},
        }
    )
    fingerprints = {
        side: tokenizer_fingerprint(load_tokenizer(path))
        for side, path in (("teacher", tiny_tokenizer_dir), ("student", other_tokenizer_dir))
    }

    def check(directory: Path) -> None:
        check_manifest(
            read_annotations(directory),
            recipe,
            "data.train",
            str(tiny_tokenizer_dir),
            str(other_tokenizer_dir),
            fingerprints,
        )

    (copy.parent / "out-longer").mkdir()  # taken: the hint must pick another name
    before = listing(copy)
    with pytest.raises(MtaError) as error:
        check(copy)
    message = str(error.value)
    assert "its max_length is 256 but data.max_length is 300" in message
    assert "--force" not in message and "the existing one stays as it is" in message
    target = copy.parent / "out-longer-2"
    assert f"-o {target}`, then set data.train: {target}" in message
    assert (
        f"or point data.train at the rows (annotated on first use into {tmp_path / 'run' / 'data' / 'train'})"
        in message
    )

    command = shlex.split(message.split("`")[1])
    assert command[:3] == ["mta", "annotate", str(small)]
    result = CliRunner().invoke(app, command[1:] + ["--workers", "1"])
    assert result.exit_code == 0, result.output
    check(target)  # fits the recipe now
    assert listing(copy) == before  # the old artefact was not touched

    small.rename(small.with_suffix(".moved"))
    try:
        with pytest.raises(
            MtaError, match=rf"the input it was built from, {re.escape(str(small))}, is not there"
        ) as gone:
            check(copy)
        assert "mta annotate" not in str(gone.value).split("do not fit")[1]
    finally:
        small.with_suffix(".moved").rename(small)
