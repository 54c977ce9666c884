"""mta: Multi-Granular Trajectory Alignment for LLM knowledge distillation.

The library is organised by pipeline stage:

- ``mta.data``        annotate: rows -> spans -> token ranges -> Parquet artefact
- ``mta.losses``      token importance, span pooling, DSA, HRA and the base KD losses
- ``mta.training``    recipes, batching, the DeepSpeed training loop, checkpoints
- ``mta.evaluation``  ROUGE-L and perplexity under the MiniLLM protocol
- ``mta.generation``  the one generation engine (keyed per-row sampling) training and evaluation share
- ``mta.models``      model and tokenizer helpers (conversion, pruned students, tiny models)
- ``mta.demo``        the embedded default: every stage on SmolLM2-135M on a CPU

Shared mechanisms have one home each: ``mta.files`` (atomic writes, journals), ``mta.hashing``,
``mta.distributed``, ``mta.dtypes``, ``mta.versions``, ``mta.tables``, ``mta.reporting``,
``mta.scoring``.

The command-line interface lives in the separate ``mta_cli`` package and only parses
arguments and reports; everything it does is callable from here.

The stable Python API (docs/python-api.md) is importable from here: ``mta.Annotator``,
``mta.Collator``, ``mta.MTALoss``, ``mta.KDLoss``, ``mta.layer_map``, ``mta.SpanParser``, ...
(``__all__``). They live in ``mta.api`` and are resolved on first use, so ``import mta`` loads
neither torch nor transformers. Anything not in ``__all__`` may still move between versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mta import tasks  # noqa: F401 (registers the training tasks with mta.task_registry, before any lookup)
from mta.deprecation import moved_modules
from mta.lazy_exports import lazy_exports
from mta.versions import MTA_VERSION as __version__  # noqa: F401 (re-exported; its one home is mta.versions)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ resolves them
    from mta.api import (
        AnnotateSettings,
        Annotator,
        Collator,
        GeneratedRow,
        HubDataset,
        KDLoss,
        LayerPair,
        LinearCKA,
        MtaError,
        MTALoss,
        SpanBatch,
        SpanParser,
        TokenBatch,
        TrainBatch,
        annotate,
        inspect,
        layer_map,
    )

# The names of mta.api.__all__ (tests/test_python_api.py keeps the two lists equal).
__all__ = [
    "AnnotateSettings",
    "Annotator",
    "Collator",
    "GeneratedRow",
    "HubDataset",
    "KDLoss",
    "LayerPair",
    "LinearCKA",
    "MTALoss",
    "MtaError",
    "SpanBatch",
    "SpanParser",
    "TokenBatch",
    "TrainBatch",
    "annotate",
    "inspect",
    "layer_map",
]


# Each name of __all__ lives in mta.api (imported on first use: mta.lazy_exports).
__getattr__, __dir__ = lazy_exports(globals(), dict.fromkeys(__all__, "mta.api"))

# Modules moved in 0.3.0, still imported by their old paths (with a warning) until
# mta.deprecation.REMOVED_IN; CHANGELOG's rename table lists them.
moved_modules(
    {
        "mta.training.sampling": "mta.training.off_policy",
        "mta.embedding.teacher_embeddings": "mta.embedding.embed",
        "mta.training.teacher_cache.build": "mta.training.teacher_cache.teacher",
        "mta.inspection.run": "mta.inspection.inspect",
        "mta.training.teacher_cache.encoding": "mta.training.teacher_cache.compact",
        "mta.losses.cross_vocabulary": "mta.losses.cross_tokenizer",
    }
)
