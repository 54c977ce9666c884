"""Writing files and directories so a crash never leaves a half-written artefact.

One policy for every stage:

- A finished **file** is written to a hidden temporary name in its own directory, flushed and
  ``fsync``-ed, then renamed onto its real name (``os.replace`` is atomic on one filesystem), and
  the directory is ``fsync``-ed so the rename itself survives a power cut. Readers see the old
  file or the new one, never a part.
- A finished **directory** (a model, a checkpoint) is built in a hidden staging directory beside
  it; every file in it is ``fsync``-ed, then the staging directory is renamed onto the real name.
  An existing directory is moved aside first and removed only once the new one is in place.
- Work in progress goes to an append-only **journal**: one JSON line per finished unit, flushed
  as it is written. A crash can only truncate the last line, which reading skips.
- A writer that must be alone holds an **exclusive lock** (``fcntl.flock`` on a lock file that
  names its pid and host); the kernel releases it when the process dies, even by SIGKILL.

Temporary names start with ``.`` and end in ``.tmp`` / ``.partial``: nothing reads them, and a
killed process may leave one behind (it is never taken for a finished file).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mta.errors import MtaError


def fsync_directory(directory: str | Path) -> None:
    """Make a rename or a new entry in ``directory`` durable (a no-op where unsupported)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def fsync_file(path: str | Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def fsync_tree(directory: str | Path) -> None:
    """``fsync`` every file under ``directory`` and every directory in it."""
    for root, _, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                fsync_file(path)
        fsync_directory(root)


def temporary_beside(path: str | Path) -> Path:
    """A new, empty hidden file in ``path``'s directory, so renaming it onto ``path`` is atomic.

    Created with the umask's permissions (not mkstemp's 0600): artefacts are meant to be shared.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    temporary.touch(exist_ok=False)
    return temporary


def publish(temporary: str | Path, path: str | Path) -> None:
    """``fsync`` ``temporary``, rename it onto ``path`` and make the rename durable."""
    fsync_file(temporary)
    os.replace(temporary, path)
    fsync_directory(Path(path).parent)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; it becomes ``path`` on success only."""
    temporary = temporary_beside(path)
    try:
        yield temporary
        publish(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as temporary:
        temporary.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, payload: Any) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def staging_directory(final: str | Path, *, suffix: str = ".partial") -> Path:
    """A new, empty hidden directory beside ``final`` (same filesystem, so renaming is atomic)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.{secrets.token_hex(6)}{suffix}"
    staging.mkdir(mode=0o755)
    return staging


def publish_directory(staging: str | Path, final: str | Path) -> None:
    """``fsync`` everything in ``staging``, then make it ``final``.

    An existing ``final`` is renamed aside and deleted only after the new one is in place, so at
    every moment ``final`` is either the old directory or the new one.
    """
    staging, final = Path(staging), Path(final)
    fsync_tree(staging)
    if final.exists():
        retired = staging_directory(final, suffix=".old")
        os.replace(final, retired / final.name)
        os.replace(staging, final)
        fsync_directory(final.parent)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final)
        fsync_directory(final.parent)


@contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield an empty staging directory beside ``final``; on success it becomes ``final``.

    On any error it is deleted and ``final`` keeps whatever it held before.
    """
    staging = staging_directory(final)
    try:
        yield staging
        publish_directory(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_path(path: str | Path) -> None:
    """Remove ``path``, whatever it is: a link as a link (never what it points to), a file, or a
    directory tree (links inside it are removed as links too). An absent path is a no-op."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def removal_problems(path: str | Path) -> list[str]:
    """Why this process could not ``remove_path(path)``, found before anything is removed: every
    directory that loses an entry must be writable and searchable, every one to empty readable.
    Links are not followed. Empty when it can (or when ``path`` does not exist)."""
    path = Path(path)
    if not os.path.lexists(path):
        return []
    problems = []

    def check(directory: str | Path, mode: int, missing: str) -> None:
        if not os.access(directory, mode):
            problems.append(f"{directory} is not {missing} by this user")

    check(path.parent, os.W_OK | os.X_OK, "writable")
    if path.is_dir() and not path.is_symlink():
        for root, _, _ in os.walk(path, onerror=lambda error: problems.append(f"{error.filename}: {error.strerror}")):
            check(root, os.R_OK | os.W_OK | os.X_OK, "readable and writable")
    return problems


# --------------------------------------------------------------------------- no link followed out


def outside_link(root: str | Path, path: str | Path) -> Path | None:
    """The first directory between ``root`` and ``path`` (``root`` itself excluded: the user gave
    it) that is a symbolic link resolving outside ``root``, else None. ``path`` must lie under
    ``root`` as written."""
    root, path = Path(os.path.abspath(root)), Path(os.path.abspath(path))
    real_root = Path(os.path.realpath(root))
    current = root
    for part in path.relative_to(root).parts[:-1]:
        current = current / part
        if current.is_symlink() and not Path(os.path.realpath(current)).is_relative_to(real_root):
            return current
    return None


def open_inside(root: str | Path, path: str | Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` for a file mta creates or appends to inside the directory ``root``
    it was given, never following a link out of it: ``path`` itself is opened with
    ``O_NOFOLLOW`` (a planted link there is refused, never written through), and no directory
    between ``root`` and it may be a link leading outside ``root``. A directory (or a link) where
    the file should be is one ``MtaError`` naming it, not a traceback."""
    path = Path(path)
    escaping = outside_link(root, path)
    if escaping is not None:
        raise MtaError(
            f"{escaping} is a symbolic link to {os.path.realpath(escaping)}, outside {root}: mta writes only "
            f"inside the directories it is given and never follows a link out of them; remove the link"
        )
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as error:
        if error.errno == errno.ELOOP or path.is_symlink():
            raise MtaError(
                f"{path} is a symbolic link (to {os.readlink(path)}): mta never writes through a link it did not "
                "make; remove it and re-run"
            ) from None
        if error.errno == errno.EISDIR or path.is_dir():
            raise MtaError(f"{path} is a directory where mta keeps a file; remove it and re-run") from None
        raise


# --------------------------------------------------------------------------- reading back mta's own artefacts


def corrupt_artefact(path: str | Path, rebuild: str, error: BaseException | None = None) -> MtaError:
    """The one line for an artefact mta wrote that does not read back: the file, what is wrong
    with it in a few words, and ``rebuild`` (the command, or the step, that makes it again)."""
    said = str(error).strip().splitlines()[0][:200] if error is not None and str(error).strip() else ""
    why = f" ({said or type(error).__name__})" if error is not None else ""
    return MtaError(f"{path} is corrupt{why}; {rebuild}")


@contextmanager
def reading_artefact(path: str | Path, rebuild: str) -> Iterator[None]:
    """Around reading one of mta's own artefacts (a JSON or YAML file, safetensors, a tensor of a
    known shape): any error but a missing file becomes :func:`corrupt_artefact`'s one line."""
    try:
        yield
    except (MtaError, FileNotFoundError):
        raise
    except Exception as error:  # every parser's own kind: JSON, YAML, safetensors, torch shapes
        raise corrupt_artefact(path, rebuild, error) from error


def read_artefact_json(path: str | Path, rebuild: str, *, kind: type = dict) -> Any | None:
    """The JSON of one of mta's own artefacts, or None when there is no such file; a file that is
    not valid UTF-8 JSON of type ``kind`` (an object by default) is one line naming it and
    ``rebuild``."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:  # not about its content: a directory in its place, no permission
        raise MtaError(f"cannot read {path}: {error.strerror}") from error
    with reading_artefact(path, rebuild):
        content = json.loads(text.decode("utf-8"))
    if not isinstance(content, kind):
        raise corrupt_artefact(path, rebuild, TypeError(f"a JSON {type(content).__name__}, not {kind.__name__}"))
    return content


def read_jsonl_lenient(path: str | Path) -> list[dict]:
    """Every parseable object line of ``path``; an absent file and broken lines read as nothing."""
    rows = []
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    row = json.loads(line)
                except ValueError:  # malformed, or a number past Python's int digit limit
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except FileNotFoundError:
        pass
    return rows


class Journal:
    """Append-only JSONL, one line per finished unit of work, flushed at once.

    ``fresh=True`` starts an empty journal (the previous file, if any, is replaced). ``inside``:
    the directory the user gave (default: the journal's own), out of which no link is followed
    (:func:`open_inside`).
    """

    def __init__(self, path: str | Path, *, fresh: bool = False, inside: str | Path | None = None):
        self.path = Path(path)
        root = Path(inside) if inside is not None else self.path.parent
        escaping = outside_link(root, self.path)  # before mkdir creates anything through it
        if escaping is not None:
            open_inside(root, self.path, os.O_RDONLY)  # raises, naming the link
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else os.O_APPEND)
        self._handle = os.fdopen(open_inside(root, self.path, flags), "a", encoding="utf-8")
        # A crash may have left a partial last line: start ours on a fresh one.
        if self._handle.tell() > 0:
            with open(self.path, "rb") as check:
                check.seek(-1, os.SEEK_END)
                if check.read(1) != b"\n":
                    self._handle.write("\n")

    def append(self, rows: Iterable[dict]) -> None:
        self._handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- a full or read-only disk

# Every library reports a failed write its own way: Python and pyarrow as an OSError with the
# errno ("[Errno 28] ... Detail: [errno 28] No space left on device"), the Rust ones (safetensors'
# SafetensorError, tokenizers' Exception) as text only ("I/O error: No space left on device (os
# error 28)"), torch as a RuntimeError naming the strerror ("open file failed with strerror:
# Read-only file system") or, for a full disk, nothing but "unexpected pos".
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_NOT_WRITABLE = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_ERRNO_IN_TEXT = re.compile(r"(?:os error|errno) (\d+)", re.IGNORECASE)
_PATH_IN_TEXT = re.compile(r'at path "([^"]+)"')  # safetensors names the file it was writing
# torch's zip writer reports a full disk as a RuntimeError without the errno.
_TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed")
_NEARLY_FULL_BYTES = 16 * 2**20


@dataclass(frozen=True)
class WriteFailure:
    """Why a write failed, when the disk said so: ``full`` (``ENOSPC``, ``EDQUOT``: free space and
    re-run) or not (``EROFS``, ``EACCES``, ``EPERM``: the place cannot be written at all)."""

    code: int
    full: bool

    @property
    def reason(self) -> str:
        return {**_FULL, **_NOT_WRITABLE}[self.code]

    def headline(self, what: str | Path) -> str:
        """``disk full while writing WHAT`` / ``cannot write WHAT: read-only file system``."""
        if self.full:
            quota = " (disk quota exceeded)" if self.code == errno.EDQUOT else ""
            return f"disk full{quota} while writing {what}"
        return f"cannot write {what}: {self.reason}"

    @property
    def fix(self) -> str:
        if self.code == errno.EDQUOT:
            return "free space or raise the quota"
        if self.full:
            return "free space"
        return "make the directory writable by this user (or choose another output directory)"


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _codes(error: BaseException) -> Iterator[int]:
    """The errnos ``error`` carries: its ``errno``, any ``os error N`` / ``errno N`` in its text,
    and the codes whose strerror its text quotes."""
    if isinstance(error, OSError) and isinstance(error.errno, int):
        yield error.errno
    text = str(error)
    yield from (int(number) for number in _ERRNO_IN_TEXT.findall(text))
    lowered = text.lower()
    yield from (code for code in (*_FULL, *_NOT_WRITABLE) if os.strerror(code).lower() in lowered)


def _paths(error: BaseException) -> list[Path]:
    """The files ``error`` names as the ones it failed on (none when it names none)."""
    named = [getattr(error, "filename", None), getattr(error, "filename2", None)]
    named += _PATH_IN_TEXT.findall(str(error))
    return [Path(os.fsdecode(name)) for name in named if isinstance(name, (str, bytes, os.PathLike))]


def _is_about(path: Path, what: Path) -> bool:
    """Whether ``path`` is ``what``, inside it, or inside what is written beside it on its way
    (``.what.….tmp``, ``what.partial/``)."""
    path, what = Path(os.path.abspath(path)), Path(os.path.abspath(what))
    try:
        first = path.relative_to(what.parent).parts[0]
    except (ValueError, IndexError):
        return False
    return first.startswith((what.name, "." + what.name))


def write_failure(error: BaseException, where: str | Path | None = None) -> WriteFailure | None:
    """Why writing ``where`` failed when ``error`` (or an error it was raised from) says the disk
    is full or the place is not writable, in any library's form; None for any other error.

    A not-writable error that names a file elsewhere (an input this user may not read) is not
    about ``where``: None. torch's full-disk RuntimeError, which carries no errno, counts when
    ``where``'s filesystem has almost no free space left.
    """
    for seen in _chain(error):
        codes = list(_codes(seen))
        full = next((code for code in codes if code in _FULL), None)
        if full is not None:
            return WriteFailure(full, full=True)
        refused = next((code for code in codes if code in _NOT_WRITABLE), None)
        if refused is not None:
            named = _paths(seen)
            if where is None or not named or any(_is_about(path, Path(where)) for path in named):
                return WriteFailure(refused, full=False)
            return None
        if isinstance(seen, RuntimeError) and any(text in str(seen) for text in _TORCH_WRITE_FAILURES):
            probe = Path(where) if where is not None else Path.cwd()
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            try:
                nearly_full = shutil.disk_usage(probe).free < _NEARLY_FULL_BYTES
            except OSError:
                return None
            return WriteFailure(errno.ENOSPC, full=True) if nearly_full else None
    return None


@contextmanager
def disk_full_is_reported(what: str | Path) -> Iterator[None]:
    """Turn a full disk, or a place that cannot be written (read-only, permission denied), inside
    the block into one ``MtaError`` naming what was being written.

    The writers in this module publish only complete files, so the message can promise that
    nothing finished before was lost.
    """
    try:
        yield
    except MtaError:
        raise
    except Exception as error:
        failure = write_failure(error, what)
        if failure is None:
            raise
        removed = " and the unfinished one was removed" if failure.full else ""
        raise MtaError(
            f"{failure.headline(what)}; nothing was lost (every finished file is intact{removed}); "
            f"{failure.fix} and re-run the same command"
        ) from error


def make_output_directory(path: Path, option: str = "-o") -> None:
    """``mkdir -p path`` for a stage's output, and a probe that a file can be created in it, before
    any work: a full disk, a read-only file system or a refused permission is one ``MtaError``
    naming ``option`` and the directory (the directories this call created are removed again)."""
    path = Path(path)
    missing = path
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    created = not path.exists()
    if path.exists() and not path.is_dir():
        raise MtaError(f"{option} {path} is a file, not a directory; give a directory to write into")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".mta-write-check-{secrets.token_hex(6)}.tmp"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(probe)
    except OSError as error:
        failure = write_failure(error)
        if failure is None:
            raise
        if created:  # back to what was there: nothing of this run is left behind
            for directory in (path, *path.parents):
                if directory.is_dir():  # mkdir may have stopped part of the way down
                    try:
                        directory.rmdir()
                    except OSError:
                        break
                if directory == missing:
                    break
        problem = "the disk is full" if failure.full else failure.reason
        raise MtaError(
            f"cannot write {option} {path}: {problem}; nothing was written; {failure.fix} and re-run the same command"
        ) from error


# --------------------------------------------------------------------------- exclusive locks

# flock on a filesystem that does not implement it (some NFS / Lustre mounts).
_LOCKS_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def running_command() -> str | None:
    """The mta command this process runs (``mta teacher``), from its arguments; None when it is
    not the ``mta`` console script (or ``python -m mta_cli.main``)."""
    argv = sys.argv
    if len(argv) < 2 or not argv[0]:
        return None
    program = Path(argv[0])
    if program.name == "mta" or (program.name == "main.py" and program.parent.name == "mta_cli"):
        return f"mta {argv[1]}" if argv[1].isidentifier() or "-" in argv[1] else None
    return None


def _lock_holder(handle: int) -> tuple[str, str | None]:
    """Who holds a lock, as its holder wrote it: ``pid N on HOST``, and the mta command it runs
    (None when it did not say)."""
    try:
        text = os.pread(handle, 200, 0).decode("utf-8", "replace").split()
    except OSError:
        text = []
    if len(text) < 2:
        return "a process that has not written its pid yet", None
    return f"pid {text[0]} on {text[1]}", " ".join(text[2:]) or None


@contextmanager
def exclusive_lock(path: Path, *, wait_s: float, inside: str | Path | None = None) -> Iterator[str | None]:
    """Hold ``fcntl.flock`` on ``path`` (created if needed, through :func:`open_inside`: no link
    followed out of ``inside``, default ``path``'s directory); yield None, or why locking is
    unsupported here. Raises ``LockHeld`` with the holder's description when another process holds
    it for longer than ``wait_s`` (0: do not wait). The holder writes its pid, host and, when it
    is an mta command, which one (:func:`running_command`), for a refused second writer to name."""
    deadline = time.monotonic() + wait_s
    unsupported = None
    while True:
        try:
            handle = open_inside(inside if inside is not None else path.parent, path, os.O_RDWR | os.O_CREAT)
        except PermissionError as error:
            raise MtaError(
                f"cannot create the lock file {path}: {error.strerror}; the output must be a "
                "directory this user can write"
            ) from error
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder, command = _lock_holder(handle)
            os.close(handle)
            if time.monotonic() >= deadline:
                raise LockHeld(holder, command) from None
            time.sleep(0.05)
            continue
        except OSError as error:
            os.close(handle)
            if error.errno not in _LOCKS_UNSUPPORTED:
                raise
            unsupported = f"{path.parent} does not support file locks ({error.strerror})"
        if unsupported is not None:
            break
        # The holder we waited for deletes the file on release: a lock on a deleted (or
        # re-created) file protects nothing, so lock the file that is there now.
        try:
            current = os.stat(path)
            mine = os.fstat(handle)
            if (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(handle)
    if unsupported is not None:
        path.unlink(missing_ok=True)
        yield unsupported
        return
    try:
        try:
            os.ftruncate(handle, 0)
            os.pwrite(
                handle, f"{os.getpid()} {socket.gethostname()} {running_command() or ''}".rstrip().encode() + b"\n", 0
            )
        except OSError:
            pass  # the pid is for messages only (a full disk may refuse even these bytes)
        yield None
    finally:
        try:
            path.unlink(missing_ok=True)  # still held: a waiter that got it sees the file gone
        finally:
            os.close(handle)


class LockHeld(Exception):
    """Another process holds the lock; ``holder`` says which (pid and host), ``command`` which mta
    command it runs (None: it did not say)."""

    def __init__(self, holder: str, command: str | None = None):
        super().__init__(holder)
        self.holder = holder
        self.command = command
