"""A full disk (ENOSPC, EDQUOT) or a place that cannot be written (EROFS, EACCES) in any library's
form (Python's OSError, pyarrow's, safetensors' SafetensorError, tokenizers', torch's) is one line
(``mta.files``); a read-only output directory stops annotate, embed, evaluate, generate and
distill before any work, leaving the directory as it was.

The errors are raised at the os layer (``os.open``) or by the library's own exception with its
real text: this machine runs the tests as root, where a chmod cannot make anything read-only."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError

from conftest import EXAMPLES
from fixtures.commands import files_of, run_mta
from fixtures.distill import write_recipe
from mta.errors import MtaError
from mta.files import atomic_write_json, disk_full_is_reported, make_output_directory, write_failure

# The texts the libraries wrote on a real 64 KiB tmpfs, full and then remounted read-only.
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
SAFETENSORS_READ_ONLY = 'Error while serializing: I/O error: Read-only file system (os error 30) at path "{}"'
ARROW_FULL = "[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device"
TOKENIZERS_FULL = "No space left on device (os error 28)"
TORCH_READ_ONLY = "[enforce fail at inline_container.cc:747] . open file failed with strerror: Read-only file system"


def chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as error:
            raise outer from error
    except BaseException as error:
        return error


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda where: OSError(errno.ENOSPC, "No space left on device"), (errno.ENOSPC, True)),
        (lambda where: OSError(errno.EDQUOT, "Disk quota exceeded"), (errno.EDQUOT, True)),
        (lambda where: OSError(errno.ENOSPC, ARROW_FULL), (errno.ENOSPC, True)),
        (lambda where: SafetensorError(SAFETENSORS_FULL), (errno.ENOSPC, True)),
        (lambda where: Exception(TOKENIZERS_FULL), (errno.ENOSPC, True)),
        (lambda where: Exception("Disk quota exceeded (os error 122)"), (errno.EDQUOT, True)),
        (lambda where: chained(RuntimeError("saving failed"), OSError(errno.ENOSPC, "x")), (errno.ENOSPC, True)),
        (
            lambda where: SafetensorError(SAFETENSORS_READ_ONLY.format(where / ".tmpagAshZ")),
            (errno.EROFS, False),
        ),
        (lambda where: RuntimeError(TORCH_READ_ONLY), (errno.EROFS, False)),
        (
            lambda where: PermissionError(errno.EACCES, "Permission denied", str(where / "x.json")),
            (errno.EACCES, False),
        ),
        (lambda where: OSError(errno.EROFS, "Read-only file system", str(where) + ".partial"), (errno.EROFS, False)),
        # Not a write failure here: another error, or a file elsewhere this user may not read.
        (lambda where: FileNotFoundError(errno.ENOENT, "No such file or directory", str(where)), None),
        (lambda where: ValueError("the prompt is empty"), None),
        (lambda where: PermissionError(errno.EACCES, "Permission denied", "/data/input.jsonl"), None),
    ],
)
def test_every_library_form_of_a_full_or_read_only_disk_is_recognised(tmp_path, make, expected):
    where = tmp_path / "out"
    failure = write_failure(make(where), where)
    assert (failure and (failure.code, failure.full)) == expected


def test_a_read_only_file_system_while_writing_is_one_line_and_the_old_file_stays(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    path.write_text('{"old": true}\n')
    real_replace = os.replace

    def read_only_replace(source, target, **kwargs):
        if Path(target) == path:
            raise OSError(errno.EROFS, "Read-only file system", str(source), None, str(target))
        return real_replace(source, target, **kwargs)

    monkeypatch.setattr(os, "replace", read_only_replace)
    with pytest.raises(MtaError) as refused, disk_full_is_reported(path):
        atomic_write_json(path, {"new": True})
    assert str(refused.value) == (
        f"cannot write {path}: read-only file system; nothing was lost (every finished file is intact); "
        "make the directory writable by this user (or choose another output directory) and re-run the same command"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"] and path.read_text() == '{"old": true}\n'

    # A refused read of something elsewhere is not reported as this write's failure.
    with pytest.raises(PermissionError), disk_full_is_reported(path):
        raise PermissionError(errno.EACCES, "Permission denied", "/elsewhere/input.jsonl")


def refuse_under(monkeypatch, directory: Path, code: int) -> None:
    """``os.open`` of any path under ``directory`` fails as a read-only or forbidden one does."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if Path(os.fsdecode(path)).is_relative_to(directory) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)


@pytest.mark.parametrize("stops", ["creating a file in it", "creating a directory on the way"])
def test_an_output_directory_that_cannot_be_created_leaves_nothing(stops, tmp_path, monkeypatch):
    if stops == "creating a file in it":
        refuse_under(monkeypatch, tmp_path / "new", errno.EACCES)
    else:
        real_mkdir = os.mkdir

        def refusing_mkdir(path, *args, **kwargs):
            if Path(os.fsdecode(path)).is_relative_to(tmp_path / "new" / "deeper"):
                raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    with pytest.raises(MtaError) as refused:
        make_output_directory(tmp_path / "new" / "deeper" / "out")
    assert str(refused.value).startswith(f"cannot write -o {tmp_path / 'new' / 'deeper' / 'out'}: permission denied")
    assert list(tmp_path.iterdir()) == []  # the directories it made are gone again


def must_not_load(*args, **kwargs):
    raise AssertionError("a model was loaded")


def command(name: str, tmp_path: Path, model: Path, tokenizer: Path, data_dir: Path, out: Path) -> list:
    """The command line of ``name`` writing into ``out``."""
    if name == "annotate":
        return ["annotate", EXAMPLES, "--teacher", tokenizer, "--student", tokenizer, "-o", out, "--workers", "1"]
    if name == "embed":
        return ["embed", EXAMPLES, "--teacher", model, "-o", out]
    if name == "evaluate":
        return ["evaluate", model, "--data-dir", data_dir, "-o", out, "--benchmarks", "dolly", "--limit", "2"]
    if name == "generate":
        return ["generate", EXAMPLES, "--teacher", model, "--student", model, "-o", out / "pairs.jsonl"]
    loss = {"base": "ce", "dsa_weight": 0, "hra_weight": 0}
    recipe = write_recipe(
        tmp_path / "r.yaml", teacher=None, student=model, annotations=EXAMPLES, output_dir=out, loss=loss
    )
    return ["distill", "--recipe", recipe]


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("annotate", errno.EROFS),
        ("embed", errno.EROFS),
        ("evaluate", errno.EROFS),
        ("generate", errno.EACCES),
        ("distill", errno.EROFS),
    ],
)
def test_a_read_only_output_directory_is_one_line_before_any_work(
    name, code, tiny_model_dir, tiny_tokenizer_dir, data_dir, tmp_path, monkeypatch, capsys
):
    from transformers import AutoModel, AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", must_not_load)
    monkeypatch.setattr(AutoModel, "from_pretrained", must_not_load)
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("already here\n")
    refuse_under(monkeypatch, out, code)
    args = command(name, tmp_path, tiny_model_dir, tiny_tokenizer_dir, data_dir, out)
    exit_code, lines = run_mta(monkeypatch, capsys, *args)
    assert exit_code == 2, "\n".join(lines)
    (line,) = [line for line in lines if line.startswith("error:")]
    option = {"generate": "the directory of -o", "distill": "output_dir"}.get(name, "-o")
    assert line == (
        f"error: cannot write {option} {out}: {os.strerror(code).lower()}; nothing was written; make the "
        "directory writable by this user (or choose another output directory) and re-run the same command"
    )
    assert files_of(out) == {"kept.txt": b"already here\n"} and sorted(p.name for p in out.iterdir()) == ["kept.txt"]


def test_a_full_disk_is_one_line_in_the_probe_too(tmp_path, monkeypatch):
    refuse_under(monkeypatch, tmp_path / "out", errno.ENOSPC)
    with pytest.raises(MtaError, match=r"cannot write -o .*/out: the disk is full; nothing was written; free space"):
        make_output_directory(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
