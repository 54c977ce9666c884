"""Other libraries' output nobody asked for, hidden unless ``--verbose``: the one place for it.

Each long command (annotate, distill, evaluate, generate, demo) calls ``quiet_third_party``
first, before torch, transformers or DeepSpeed is imported. Without ``--verbose`` it hides:

- transformers' tqdm bars ("Loading weights", "Writing model shards") and its log below errors
  (``disable_progress_bar``, ``set_verbosity_error``); Hugging Face Hub's download bars too
  when stderr is not a terminal (their carriage returns make a log unreadable);
- DeepSpeed's log below errors, e.g. "Setting accelerator to CPU ..." that ``import deepspeed``
  logs on a machine without a GPU. DeepSpeed sets its logger's level (``DeepSpeed``) when it is
  imported, so a level set before would be overwritten: a filter on the logger stays;
- torch's C++ warnings (c10d's "[W socket.cpp] ... IPv6 ..." when a process group starts), by
  ``TORCH_CPP_LOG_LEVEL=ERROR``: read once, when torch is imported, so only while it is not yet
  and the variable is not set by the user;
- plain tqdm bars that transformers' switch does not reach (its GGUF conversion's "Converting
  and de-quantizing GGUF tensors", under ``mta models smollm2``) when stderr is not a terminal, by
  ``TQDM_DISABLE=1``: tqdm reads it when it is imported, so only while it is not yet and the
  variable is not set by the user (mta's own bars are rich's, not tqdm's);
- Python warnings raised outside mta (``FutureWarning``s from torch.distributed under torchrun,
  ``UserWarning``s of transformers, spaCy, ...).

What mta itself says stays: its ``mta.*`` loggers and warnings, every error, every exception.
``--verbose`` leaves the libraries as they are by default (and undoes an earlier call in the
same process, as tests running several commands in one interpreter need).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

VERBOSE_HELP = (
    "Also show other libraries' progress bars, infos and warnings (transformers, DeepSpeed, torch); "
    "mta's own warnings always show."
)
DEEPSPEED_LOGGER = "DeepSpeed"
TORCH_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
TQDM_DISABLE = "TQDM_DISABLE"
# Warnings whose module (the frame `warnings.warn` points at) is not mta's are ignored.
_NOT_MTA = r"(?!mta(_cli)?(\.|$))"


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_ERRORS_ONLY = _ErrorsOnly()
_changed: dict[str, Any] = {}  # what an earlier quiet call changed, so --verbose can undo it


def quiet_third_party(verbose: bool = False) -> None:
    """Hide the other libraries' progress bars, infos and warnings (module docstring), or with
    ``verbose`` leave (and put back) their defaults."""
    if verbose:
        _restore()
        return
    logging.getLogger(DEEPSPEED_LOGGER).addFilter(_ERRORS_ONLY)  # a no-op when already there
    warnings.filterwarnings("ignore", module=_NOT_MTA)
    _changed["warnings"] = True
    if "torch" not in sys.modules and TORCH_CPP_LOG_LEVEL not in os.environ:
        os.environ[TORCH_CPP_LOG_LEVEL] = "ERROR"
        _changed[TORCH_CPP_LOG_LEVEL] = True
    if "tqdm" not in sys.modules and TQDM_DISABLE not in os.environ and not sys.stderr.isatty():
        os.environ[TQDM_DISABLE] = "1"
        _changed[TQDM_DISABLE] = True
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # annotate-only installs
        return
    if "transformers" not in _changed:
        _changed["transformers"] = (
            transformers_logging.get_verbosity(),
            transformers_logging.is_progress_bar_enabled(),
        )
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    if not sys.stderr.isatty():
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

        _changed.setdefault("hub", are_progress_bars_disabled())
        disable_progress_bars()


def _restore() -> None:
    logging.getLogger(DEEPSPEED_LOGGER).removeFilter(_ERRORS_ONLY)
    if _changed.pop("warnings", False):
        warnings.filters[:] = [
            entry
            for entry in warnings.filters
            if not (entry[0] == "ignore" and entry[3] is not None and entry[3].pattern == _NOT_MTA)
        ]
        getattr(warnings, "_filters_mutated", lambda: None)()  # drop the cached decisions
    if _changed.pop(TORCH_CPP_LOG_LEVEL, False):
        os.environ.pop(TORCH_CPP_LOG_LEVEL, None)
    if _changed.pop(TQDM_DISABLE, False):
        os.environ.pop(TQDM_DISABLE, None)
    if "transformers" in _changed:
        from transformers.utils import logging as transformers_logging

        verbosity, bars = _changed.pop("transformers")
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()
    if "hub" in _changed and not _changed.pop("hub"):
        from huggingface_hub.utils import enable_progress_bars

        enable_progress_bars()
