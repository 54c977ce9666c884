"""The sentence-transformers directory format: every file of it mta reads or writes, here only.

Beside a Hugging Face encoder's files: ``modules.json`` (Transformer -> Pooling [-> Normalize]),
``sentence_bert_config.json`` (``max_seq_length``), ``1_Pooling/config.json`` (the mode) and, for
trained students, ``config_sentence_transformers.json``. Reading refuses a pipeline with other
modules or pooling modes (its vectors would not be the model's). ``cls_attention`` pooling, which
sentence-transformers lacks, is shipped as ``cls_attention_pooling.py``, written from
:func:`mta.embedding.pooling.cls_attention_pool`'s source (``trust_remote_code=True`` to load it
there; mta pools with its own function).
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

from mta.embedding.pooling import POOLINGS, PoolingConfig, cls_attention_pool
from mta.errors import MtaError
from mta.files import atomic_write_json, atomic_write_text
from mta.versions import package_versions

# TALAS students exported by mta: the CLS-query attention pooling, a code file in the model
# directory (SentenceTransformer(dir, trust_remote_code=True) loads it).
CLS_ATTENTION_MODULE = "cls_attention_pooling.CLSAttentionPooling"
CODE_FILE = CLS_ATTENTION_MODULE.split(".")[0] + ".py"
POOLING_DIR = "1_Pooling"
NORMALIZE_DIR = "2_Normalize"
STOCK_POOLINGS = ("mean", "cls")  # the stock poolings a trained student may be exported with

# sentence-transformers Pooling config keys -> mta's modes (the ones that give the same vector).
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"

# Files of a sentence-transformers directory that describe the pipeline, not the weights: a
# pruned copy keeps them (its pooling and normalisation are the source's).
PIPELINE_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    f"{POOLING_DIR}/config.json",
)

_MODULE_TEMPLATE = '''"""TALAS's CLS-query attention pooling as a sentence-transformers module (written by mta).

Load the model with ``SentenceTransformer(directory, trust_remote_code=True)``. The pooling has
no parameters: 1_Pooling/config.json holds its width and mode.
"""

import json
import os

import torch


{function}

class {name}(torch.nn.Module):
    """token_embeddings [B, T, D], attention_mask [B, T] -> sentence_embedding [B, D]."""

    def __init__(self, embedding_dimension: int, pooling_mode: str = "cls_attention"):
        super().__init__()
        self.embedding_dimension = embedding_dimension
        self.pooling_mode = pooling_mode

    def forward(self, features, **kwargs):
        features["sentence_embedding"] = cls_attention_pool(features["token_embeddings"], features["attention_mask"])
        return features

    def get_sentence_embedding_dimension(self) -> int:
        return self.embedding_dimension

    def get_config_dict(self):
        return {{"embedding_dimension": self.embedding_dimension, "pooling_mode": self.pooling_mode}}

    def save(self, output_path, *args, **kwargs):
        with open(os.path.join(output_path, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(self.get_config_dict(), handle, indent=2)

    @staticmethod
    def load(input_path):
        with open(os.path.join(input_path, "config.json"), encoding="utf-8") as handle:
            return {name}(**json.load(handle))
'''


# --------------------------------------------------------------------------- read


def read_sentence_transformers_config(directory: str | Path) -> PoolingConfig | None:
    """The pooling of a sentence-transformers directory (``modules.json``), None for a plain
    Hugging Face directory or a hub name; ``MtaError`` naming the module it cannot reproduce."""
    directory = Path(directory)
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise MtaError(
            f"{modules_path}: expected a list of module objects; the directory is not a sentence-transformers model"
        )
    kinds = [str(m.get("type", "")) for m in modules]
    normalize = False
    mode = None
    for module, kind in zip(modules, kinds, strict=True):
        if kind == _ST_TRANSFORMER:
            if module.get("path", "") not in ("", "."):
                raise MtaError(
                    f"{modules_path}: the Transformer module lives in '{module.get('path')}'; mta loads the "
                    "encoder from the directory itself. Give that subdirectory, or re-save the model"
                )
        elif kind == _ST_POOLING:
            config_path = directory / str(module.get("path", POOLING_DIR)) / "config.json"
            config = _json(config_path) if config_path.is_file() else {}
            for key in _ST_UNSUPPORTED:
                if config.get(key):
                    raise MtaError(f"{config_path}: {key} is not supported; choose --pooling {'/'.join(POOLINGS)}")
            modes = [name for key, name in _ST_MODES.items() if config.get(key)]
            if len(modes) != 1:
                raise MtaError(
                    f"{config_path}: expected exactly one pooling mode of {', '.join(_ST_MODES)}, found "
                    f"{modes or 'none'}; pass --pooling {'/'.join(POOLINGS)} explicitly"
                )
            mode = modes[0]
        elif kind == CLS_ATTENTION_MODULE:
            mode = "cls_attention"
        elif kind == _ST_NORMALIZE:
            normalize = True
        else:
            raise MtaError(
                f"{modules_path}: module {kind or module!r} is not supported (mta reproduces Transformer -> "
                "Pooling -> Normalize); its vectors would differ from the model's own"
            )
    if mode is None:
        raise MtaError(f"{modules_path}: the pipeline has no Pooling module; pass --pooling {'/'.join(POOLINGS)}")
    limit = None
    bert_config = directory / "sentence_bert_config.json"
    if bert_config.is_file():
        value = _json(bert_config).get("max_seq_length")
        limit = value if type(value) is int and value > 0 else None
    return PoolingConfig(mode=mode, normalize=normalize, source="sentence-transformers", max_seq_length=limit)


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise MtaError(f"cannot read {path}: {error}") from error


# --------------------------------------------------------------------------- write


def pooling_module_source() -> str:
    """The text of ``cls_attention_pooling.py`` (mta's pooling function, verbatim)."""
    return _MODULE_TEMPLATE.format(
        function=inspect.getsource(cls_attention_pool), name=CLS_ATTENTION_MODULE.split(".")[1]
    )


def write_sentence_transformers_modules(
    directory: str | Path, *, hidden: int, pooling: str, normalize: bool, max_seq_length: int
) -> None:
    """The files that make a Hugging Face encoder directory a sentence-transformers model:
    Transformer (the directory itself) -> Pooling (``pooling``: ``mean``, ``cls``, ``max`` or
    ``cls_attention``) [-> Normalize], over ``hidden``-wide states."""
    directory = Path(directory)
    pooling_module = CLS_ATTENTION_MODULE if pooling == "cls_attention" else _ST_POOLING
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _ST_TRANSFORMER},
        {"idx": 1, "name": "1", "path": POOLING_DIR, "type": pooling_module},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": _ST_NORMALIZE})
        (directory / NORMALIZE_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_json(directory / "modules.json", modules)
    atomic_write_json(
        directory / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False}
    )
    if pooling == "cls_attention":
        atomic_write_json(
            directory / POOLING_DIR / "config.json", {"embedding_dimension": hidden, "pooling_mode": "cls_attention"}
        )
        atomic_write_text(directory / CODE_FILE, pooling_module_source())
        return
    atomic_write_json(
        directory / POOLING_DIR / "config.json",
        {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": pooling == "max",
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": False,
            "include_prompt": True,
        },
    )


def write_sentence_transformers_files(directory: str | Path, *, pooling: str, hidden: int, max_seq_length: int) -> None:
    """Make the Hugging Face encoder saved in ``directory`` a sentence-transformers model pooling
    with ``pooling`` (``mean``, ``cls`` or ``cls_attention``) over ``hidden``-wide states."""
    directory = Path(directory)
    if pooling not in (*STOCK_POOLINGS, "cls_attention"):
        raise MtaError(
            f"pooling '{pooling}' cannot be exported: use one of {', '.join((*STOCK_POOLINGS, 'cls_attention'))}"
        )
    write_sentence_transformers_modules(
        directory, hidden=hidden, pooling=pooling, normalize=False, max_seq_length=max_seq_length
    )
    versions = package_versions(("torch", "transformers", "sentence-transformers"))
    atomic_write_json(
        directory / "config_sentence_transformers.json",
        {
            "__version__": {
                "pytorch": versions.get("torch"),
                "transformers": versions.get("transformers"),
                "sentence_transformers": versions.get("sentence-transformers"),
            },
            "model_type": "SentenceTransformer",
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    )


def copy_sentence_transformers_files(source: str | Path, target: str | Path) -> None:
    """The pipeline files of ``source`` (:data:`PIPELINE_FILES`, those it has) into ``target``."""
    source, target = Path(source), Path(target)
    for name in PIPELINE_FILES:
        if (source / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, target / name)
