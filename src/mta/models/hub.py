"""Models and tokenizers by Hugging Face Hub name: the one place a name meets the network.

With the Hub unreachable, huggingface_hub retries with back-off and transformers gives up after
about half a minute per file, so every loader goes through :func:`load_pretrained`, which decides
up front: a local directory loads as it is; ``HF_HUB_OFFLINE=1`` reads the cache only; otherwise
one short request per process to ``HF_ENDPOINT`` decides (reachable: a name the Hub does not know is
an ``MtaError``; unreachable: a cached name loads with a warning, any other is an ``MtaError``
within seconds naming the fix). Hub datasets follow the same rules (:func:`dataset_snapshot`:
the files at one commit in the Hugging Face cache; offline per ``HF_DATASETS_OFFLINE``).
"""

from __future__ import annotations

import functools
import json
import logging
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mta.errors import MtaError

log = logging.getLogger(__name__)

T = TypeVar("T")

REACH_TIMEOUT_S = 4.0  # connect + first byte of one HEAD request to the endpoint
MODEL_FILE = "config.json"
TOKENIZER_FILE = "tokenizer_config.json"


def is_local(name_or_path: str | Path) -> bool:
    """Whether ``name_or_path`` is something on this machine (``~`` expanded)."""
    return Path(name_or_path).expanduser().exists()


def endpoint() -> str:
    """The Hub the names resolve on (``HF_ENDPOINT``, read when huggingface_hub is imported)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline_mode() -> bool:
    """``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``): the cache only, no request."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@functools.cache
def unreachable_reason(url: str) -> str | None:
    """None when ``url`` answers (any HTTP status counts), else why not, in a few words.

    Made through huggingface_hub's own session, so its proxy and certificate settings apply; the
    answer is kept for the process (``unreachable_reason.cache_clear()`` forgets it).
    """
    from huggingface_hub.utils import get_session

    try:
        get_session().head(url, timeout=REACH_TIMEOUT_S)
    except Exception as error:  # DNS, refused, timeout, TLS, proxy: all mean "not reachable"
        detail = str(error).splitlines()[0] if str(error) else ""
        return f"{type(error).__name__}: {detail}" if detail else type(error).__name__
    return None


def _valid_name(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def is_hub_name(name_or_path: str | Path) -> bool:
    """A name the Hub could resolve: shaped like ``gpt2`` or ``org/model``, and nothing local."""
    return not is_local(name_or_path) and _valid_name(str(name_or_path))


def _in_cache(name: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, filename), str)
    except ValueError:  # not a valid repo id
        return False


@functools.cache
def _warn_cached(name: str, reason: str) -> None:
    """Once per name and process: it loads from the cache because the Hub cannot be reached."""
    log.warning(
        "the Hugging Face Hub (%s) cannot be reached (%s); '%s' loads from the local "
        "Hugging Face cache (HF_HUB_OFFLINE=1 skips the check)",
        endpoint(),
        reason,
        name,
    )


def load_options(name_or_path: str | Path, *, what: str = "model", filename: str = MODEL_FILE) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments for ``name_or_path`` (``{}`` or, with the Hub
    unreachable and the name cached, ``local_files_only``), or an ``MtaError`` saying why it
    cannot load: not a directory and not a name, or the Hub unreachable and the name not cached.
    ``filename`` is the file whose presence in the cache counts as "cached"."""
    name = str(name_or_path)
    if is_local(name):
        return {}
    if not _valid_name(name):
        raise MtaError(
            f"{what} '{name}': no such file or directory, and not a Hugging Face Hub name "
            "(those look like 'gpt2' or 'org/model'); check the path"
        )
    if offline_mode():
        return {}  # transformers reads the cache only; a miss is explained by load_pretrained
    reason = unreachable_reason(endpoint())
    if reason is None:
        return {}
    if _in_cache(name, filename):
        _warn_cached(name, reason)
        return {"local_files_only": True}
    raise MtaError(
        f"{what} '{name}' is not a local directory, and the Hugging Face Hub at {endpoint()} cannot "
        f"be reached ({reason}). Give a local model directory (one that save_pretrained wrote), or "
        "download the model where the Hub is reachable and set HF_HUB_OFFLINE=1 to load it from the "
        "Hugging Face cache without asking the Hub."
    )


def datasets_offline() -> bool:
    """Whether ``datasets`` would stay offline: ``HF_DATASETS_OFFLINE`` when it is set, else
    ``HF_HUB_OFFLINE`` (read now, so a test or a caller may set it after import)."""
    import os

    from huggingface_hub import constants

    value = os.environ.get("HF_DATASETS_OFFLINE")
    if value is None:
        return offline_mode()
    return value.upper() in constants.ENV_VARS_TRUE_VALUES


def is_dataset_id(name: str | Path) -> bool:
    """Shaped like a Hub dataset id, ``owner/name``, and nothing on this machine of that name.

    One slash exactly, a valid repo id, and no data-file suffix (``data/train.jsonl`` is a
    missing file, not an id)."""
    text = str(name)
    return (
        text.count("/") == 1
        and not is_local(text)
        and not text.startswith((".", "~"))
        and Path(text).suffix.lower() not in {".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow"}
        and _valid_name(text)
    )


def dataset_snapshot(repo_id: str, revision: str | None = None) -> tuple[Path, str]:
    """The local directory of Hub dataset ``repo_id`` at ``revision`` (a branch, tag or commit;
    None: the default branch) and the commit it is, downloading what the cache lacks.

    Offline (:func:`datasets_offline`), or with the Hub unreachable and the revision cached, the
    cache alone answers; anything else the Hub cannot give is an ``MtaError`` within seconds
    saying why and what to do (the offline hint, the spelling, a login)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"dataset '{repo_id}'" + (f" at revision '{revision}'" if revision else "")
    local_only = datasets_offline()
    reason = None if local_only else unreachable_reason(endpoint())
    if reason is not None:
        local_only = True
    try:
        directory = snapshot_download(repo_id, repo_type="dataset", revision=revision, local_files_only=local_only)
    except GatedRepoError as error:
        raise MtaError(
            f"{where} is gated on the Hugging Face Hub: accept its terms on its page and log in "
            "(`hf auth login`, or set HF_TOKEN)"
        ) from error
    except RepositoryNotFoundError as error:
        raise MtaError(
            f"{where}: no such file or directory here, and no such dataset on the Hugging Face Hub "
            f"({endpoint()}); check the spelling (a private dataset needs `hf auth login`)"
        ) from error
    except RevisionNotFoundError as error:
        raise MtaError(f"{where}: the dataset has no such branch, tag or commit") from error
    except LocalEntryNotFoundError as error:
        if reason is not None:
            why = f"the Hugging Face Hub at {endpoint()} cannot be reached ({reason})"
        else:
            why = "HF_DATASETS_OFFLINE=1 (or HF_HUB_OFFLINE=1) is set"
        raise MtaError(
            f"{where} is not a local path and not in the Hugging Face cache ({_hub_cache()}), and {why}. "
            f"Download it where the Hub is reachable (`hf download --repo-type dataset {repo_id}`; then "
            "HF_DATASETS_OFFLINE=1 reads it from the cache), or give a local file"
        ) from error
    if reason is not None:
        _warn_cached(repo_id, reason)
    directory = Path(directory)
    return directory, directory.name  # snapshots/<commit>: the name is the commit


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def hub_problem(name_or_path: str | Path, error: BaseException, *, what: str = "model") -> str | None:
    """The message for a load that failed because of the Hub (unknown or gated name, not in the
    cache while offline), or None when ``error`` is about something else."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    name = str(name_or_path)
    if is_local(name):
        return None
    chain = list(_chain(error))
    if any(isinstance(e, GatedRepoError) for e in chain):
        return (
            f"{what} '{name}' is a gated model on the Hugging Face Hub: accept its terms on its page "
            "and log in (`hf auth login`, or set HF_TOKEN), or give a local directory"
        )
    if any(isinstance(e, RepositoryNotFoundError) for e in chain):
        return (
            f"{what} '{name}' is neither a local directory nor a model on the Hugging Face Hub "
            f"({endpoint()}): check the spelling of the name or the path (a private model needs "
            "`hf auth login`)"
        )
    if any(isinstance(e, LocalEntryNotFoundError) for e in chain):
        why = "HF_HUB_OFFLINE=1 is set" if offline_mode() else "the Hub cannot be reached"
        return (
            f"{what} '{name}' is not a local directory and its files are not (all) in the Hugging Face "
            f"cache, and {why}. Download it where the Hub is reachable (then HF_HUB_OFFLINE=1 loads it "
            "from the cache), or give a local directory (one that save_pretrained wrote); check the "
            "spelling of the name"
        )
    return None


def _declared_model_type(name_or_path: str | Path) -> str | None:
    """The ``model_type`` a local directory's config.json declares (None when it cannot tell)."""
    try:
        config = json.loads((Path(name_or_path).expanduser() / MODEL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def loading_problem(name_or_path: str | Path, error: BaseException, *, what: str = "model") -> str | None:
    """The message for a load transformers or torch refused for a reason of mta's own rules, or
    None: custom code (``auto_map``) that mta never runs (transformers' own message would tell the
    user to pass ``trust_remote_code=True``, which mta does not set), or a pickle torch's
    weights-only loader refuses."""
    import transformers

    name = str(name_or_path)
    chain = list(_chain(error))
    if any("trust_remote_code" in str(e) for e in chain):
        model_type = _declared_model_type(name_or_path) if is_local(name_or_path) else None
        kind = f"the model type '{model_type}'" if model_type else "its architecture"
        return (
            f"{what} '{name}' needs the custom code its files name (auto_map) for {kind}, which "
            f"transformers {transformers.__version__} does not ship; mta runs no code that comes with a "
            "model. Give a model of an architecture transformers ships (config.json's model_type, e.g. "
            "llama, qwen2, gpt2), or use a transformers version that ships this one"
        )
    if any(isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e) for e in chain):
        refused = sorted(set(re.findall(r"GLOBAL ([\w.]+)", " ".join(str(e) for e in chain))))
        holding = f" (it pickles {', '.join(refused)})" if refused else ""
        return (
            f"{what} '{name}': its PyTorch weights (pytorch_model*.bin) are a pickle that torch's "
            f"weights-only loader refuses{holding}; mta unpickles nothing but tensors and plain values. "
            "Where the file is trusted, convert it to safetensors (torch.load(..., weights_only=False), then "
            "safetensors.torch.save_file into model.safetensors), or give a checkpoint saved as safetensors"
        )
    return None


def _is_auto_class(loader: Callable[..., Any]) -> bool:
    """Whether ``loader`` is the ``from_pretrained`` of one of transformers' Auto classes
    (``AutoConfig``, ``AutoTokenizer``, ``AutoModel*``): those take ``trust_remote_code``."""
    owner = getattr(loader, "__self__", None)
    return isinstance(owner, type) and owner.__module__.startswith("transformers.models.auto.")


def _looks_for_adapters(loader: Callable[..., Any]) -> bool:
    """Whether ``loader`` is an ``AutoModel*.from_pretrained`` (those look for a peft adapter)."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    owner = getattr(loader, "__self__", None)
    return isinstance(owner, type) and issubclass(owner, _BaseAutoModelClass)


def load_pretrained(
    loader: Callable[..., T],
    name_or_path: str | Path,
    *,
    what: str = "model",
    filename: str = MODEL_FILE,
    otherwise: str | None = None,
    **kwargs: Any,
) -> T:
    """``loader(name_or_path, **kwargs)`` (a ``from_pretrained``) after :func:`load_options`;
    a failure the Hub explains becomes an ``MtaError`` naming the name; any other propagates, or
    with ``otherwise`` (what could not be done and the fix) becomes ``MtaError("{otherwise}: {error}")``."""
    options = load_options(name_or_path, what=what, filename=filename)
    if options.get("local_files_only") and _looks_for_adapters(loader):
        # With peft installed, an Auto* model's from_pretrained first looks for an
        # adapter_config.json and does not pass local_files_only on to that look-up (transformers
        # 5.x): it would ask the unreachable Hub. The adapter, like the model, comes from the cache.
        options["adapter_kwargs"] = {"local_files_only": True}
    target = str(Path(name_or_path).expanduser()) if is_local(name_or_path) else str(name_or_path)
    if _is_auto_class(loader):
        # Explicitly: left unset, transformers asks on a terminal whether to run a model's code.
        kwargs.setdefault("trust_remote_code", False)
    if _looks_for_adapters(loader) and Path(target).is_dir():
        from mta.models.weights import adapter_files

        adapter_files(target)  # an adapter_config.json without weights: refused before the load
    try:
        return loader(target, **options, **kwargs)
    except Exception as error:
        if isinstance(error, MtaError):
            raise
        problem = loading_problem(name_or_path, error, what=what) or hub_problem(name_or_path, error, what=what)
        if problem is not None:
            raise MtaError(problem) from error
        if otherwise is not None:  # OSError, ValueError, a file transformers cannot read...
            raise MtaError(f"{otherwise}: {error}") from error
        raise
