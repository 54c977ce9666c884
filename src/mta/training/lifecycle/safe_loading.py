"""Reading DeepSpeed's training state without running code from the files.

DeepSpeed reads its ``deepspeed/state/*.pt`` pickles with ``torch.load(weights_only=False)``, so
a planted ``.pt`` file would run its code on ``--resume``. :func:`load_state_file` instead lists
the globals a pickle names, statically, refusing any outside :func:`allowed_globals`, then loads
it with ``weights_only=True`` and only those added; ``restricted_loading(engine)`` routes every
read of ``engine.load_checkpoint`` through it (tests/test_checkpoint_faults.py trips if a
DeepSpeed upgrade reads files another way). The allow-list is DeepSpeed's own bookkeeping, found
by saving real checkpoints (ZeRO 0: nothing; 1 and 2: ``ZeroStageEnum``, ``LossScaler``,
``fragment_address``; 3: the first two; fp16 adds ``DynamicLossScaler``). State mta adds is JSON
or Parquet, never pickled, never on the list.
"""

from __future__ import annotations

import pickle
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from mta.errors import MtaError


class CheckpointFileError(MtaError):
    """A state file that was not loaded: missing, unreadable, or needing a type mta refuses."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@lru_cache(maxsize=1)
def allowed_globals() -> tuple[type, ...]:
    """The classes (besides torch's weights-only defaults) DeepSpeed's state of an mta run needs."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address)


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _allowed_names() -> set[str]:
    return {_name(kind) for kind in allowed_globals()}


def _refused(path: Path, types: list[str]) -> CheckpointFileError:
    allowed = ", ".join(sorted(kind.__qualname__ for kind in allowed_globals()))
    return CheckpointFileError(
        path,
        (
            f"refused: unpickling it would call {', '.join(types)}, which DeepSpeed's state of an mta "
            f"run never holds (tensors, plain values and DeepSpeed's {allowed} only), so the file was "
            "replaced or written by other software; nothing in it ran"
        ),
    )


def refused_globals(path: str | Path) -> list[str] | None:
    """The globals ``path``'s pickle names that are not allowed (``[]``: none), read without
    unpickling anything; None when ``path`` is not a zip ``torch.save`` file (the old format
    DeepSpeed writes when told to: only the restricted unpickler checks those)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except ValueError:  # not a zip checkpoint
        return None
    except FileNotFoundError:
        raise CheckpointFileError(path, "missing") from None
    except (RuntimeError, OSError, KeyError) as error:
        raise _unreadable(path, error) from error
    return sorted(set(names) - _allowed_names())


def check_state_file(path: str | Path) -> None:
    """Raise :class:`CheckpointFileError` when ``path`` is missing, unreadable or names a type
    outside the allow-list, without unpickling it (what a resume checks before loading)."""
    refused = refused_globals(path)
    if refused:
        raise _refused(Path(path), refused)


def _unreadable(path: str | Path, error: BaseException) -> CheckpointFileError:
    text = str(error).strip()
    reason = text.splitlines()[0].split(". ")[0] if text else type(error).__name__
    return CheckpointFileError(path, f"unreadable (truncated or corrupt: {reason})")


def _weights_only_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's long weights-only message that says what was refused."""
    text = str(error)
    for pattern in (r"WeightsUnpickler error:\s*(\S[^\n]*)", r"(Trying to load unsupported GLOBAL [^\n]+)"):
        found = re.search(pattern, text)
        if found:  # the first sentence: torch's advice to allow-list the global is not ours
            return found.group(1).strip().split(". ")[0].rstrip(".")
    return text.splitlines()[0] if text else "refused by the weights-only unpickler"


def load_state_file(path: str | Path, map_location: Any = None) -> Any:
    """``torch.load`` of one DeepSpeed state file that runs no code from it (see the module doc).

    Raises :class:`CheckpointFileError` naming the file when it is missing, unreadable, or needs
    a type outside :func:`allowed_globals`; in each case nothing of it was loaded and no code
    from it ran.
    """
    path = Path(path)
    check_state_file(path)  # names every refused type at once; torch.load below enforces
    try:
        with torch.serialization.safe_globals(list(allowed_globals())):
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointFileError(path, "missing") from None
    except pickle.UnpicklingError as error:
        raise CheckpointFileError(
            path,
            (
                f"refused by torch's restricted (weights-only) unpickler: {_weights_only_reason(error)}; "
                "nothing in it ran"
            ),
        ) from error
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, struct.error) as error:
        # struct.error: a legacy (non-zip) file cut inside a length field
        raise _unreadable(path, error) from error


class _RestrictedCheckpointEngine:
    """DeepSpeed's checkpoint engine with its ``load`` replaced by :func:`load_state_file`."""

    def __init__(self, inner: Any):
        self._inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_state_file(path, map_location=map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def restricted_loading(engine: Any) -> Iterator[None]:
    """Inside the block, ``engine.load_checkpoint`` reads state files only via :func:`load_state_file`."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _RestrictedCheckpointEngine(inner)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner
