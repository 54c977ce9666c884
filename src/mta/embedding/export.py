"""A trained embedding student as a sentence-transformers model: the files beside its weights.

An exported directory (a checkpoint's or ``final/``) is a plain Hugging Face encoder
(``config.json``, ``model.safetensors``, tokenizer: ``AutoModel.from_pretrained`` loads it) and a
sentence-transformers model: ``modules.json`` (Transformer -> Pooling), ``sentence_bert_config.json``
(``max_seq_length``), ``config_sentence_transformers.json`` (cosine similarity) and
``1_Pooling/config.json``.

- ``mean`` / ``cls`` pooling is sentence-transformers' own Pooling module:
  ``SentenceTransformer(dir)`` loads it.
- ``cls_attention`` (TALAS's default) has no sentence-transformers module and no parameters (its
  only setting is the mode): the directory carries ``cls_attention_pooling.py``, a module written
  from :func:`mta.embedding.encoder.cls_attention_pool`'s own source (torch and
  sentence-transformers only, no mta), and ``modules.json`` names it
  (``mta.embedding.encoder.CLS_ATTENTION_MODULE``). sentence-transformers runs a model's own code
  only when asked: ``SentenceTransformer(dir, trust_remote_code=True)``. ``mta embed`` and
  ``mta evaluate`` read the mode from ``modules.json`` and pool with mta's function.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from mta.embedding.encoder import CLS_ATTENTION_MODULE, cls_attention_pool
from mta.errors import MtaError
from mta.files import atomic_write_json, atomic_write_text
from mta.versions import package_versions

CODE_FILE = CLS_ATTENTION_MODULE.split(".")[0] + ".py"
POOLING_DIR = "1_Pooling"
STOCK_POOLINGS = ("mean", "cls")

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


def pooling_module_source() -> str:
    """The text of ``cls_attention_pooling.py`` (mta's pooling function, verbatim)."""
    return _MODULE_TEMPLATE.format(function=inspect.getsource(cls_attention_pool),
                                   name=CLS_ATTENTION_MODULE.split(".")[1])


def write_sentence_transformers_files(directory: str | Path, *, pooling: str, hidden: int, max_seq_length: int) -> None:
    """Make the Hugging Face encoder saved in ``directory`` a sentence-transformers model pooling
    with ``pooling`` (``mean``, ``cls`` or ``cls_attention``) over ``hidden``-wide states."""
    directory = Path(directory)
    if pooling in STOCK_POOLINGS:
        from mta.embedding.tiny_encoders import write_sentence_transformers_modules

        write_sentence_transformers_modules(directory, hidden=hidden, pooling=pooling, normalize=False,
                                            max_seq_length=max_seq_length)
    elif pooling == "cls_attention":
        atomic_write_json(directory / "modules.json", [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": POOLING_DIR, "type": CLS_ATTENTION_MODULE},
        ])
        atomic_write_json(directory / "sentence_bert_config.json", {"max_seq_length": max_seq_length,
                                                                    "do_lower_case": False})
        atomic_write_json(directory / POOLING_DIR / "config.json",
                          {"embedding_dimension": hidden, "pooling_mode": "cls_attention"})
        atomic_write_text(directory / CODE_FILE, pooling_module_source())
    else:
        raise MtaError(f"pooling '{pooling}' cannot be exported: use one of {', '.join((*STOCK_POOLINGS, 'cls_attention'))}")
    versions = package_versions(("torch", "transformers", "sentence-transformers"))
    atomic_write_json(directory / "config_sentence_transformers.json", {
        "__version__": {"pytorch": versions.get("torch"), "transformers": versions.get("transformers"),
                        "sentence_transformers": versions.get("sentence-transformers")},
        "model_type": "SentenceTransformer",
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    })
