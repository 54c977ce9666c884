"""mta: Multi-Granular Trajectory Alignment for LLM knowledge distillation.

The stages, their modules and artefacts: ARCHITECTURE.md. The stable Python API (docs/python-api.md)
is ``__all__``: those names live in ``mta.api`` and are imported on first use, so ``import mta``
loads neither torch nor transformers. Anything not in ``__all__`` may move between versions.
"""

# ruff: noqa: F405 (the names of __all__ are star-imported for type checkers only)

from __future__ import annotations

from typing import TYPE_CHECKING

from mta import tasks  # noqa: F401 (registers the training tasks with mta.task_registry, before any lookup)
from mta.deprecation import moved_modules
from mta.lazy_exports import lazy_exports
from mta.versions import MTA_VERSION as __version__  # noqa: F401 (re-exported; its one home is mta.versions)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ resolves them
    from mta.api import *  # noqa: F403

# The public Python API, listed once: each name lives in mta.api (imported on first use).
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
