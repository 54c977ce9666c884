"""Other libraries' output nobody asked for, hidden unless ``--verbose``: the one place for it.

Each long command calls ``quiet_third_party`` first, before torch, transformers or DeepSpeed is
imported, so that switches read at import (``TORCH_CPP_LOG_LEVEL``, ``TQDM_DISABLE``) still take
effect. It hides transformers' and the Hub's bars (the Hub's when stderr is not a terminal) and
logs below errors, DeepSpeed's log (a filter: DeepSpeed resets its level on import), torch's C++
warnings and Python warnings raised outside mta. mta's own loggers, warnings and errors always
show; ``--verbose`` keeps the libraries' defaults (and undoes an earlier call in the process).
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
