"""Sentence embeddings: encoders and their pooling, and the teacher-embeddings stage (`mta embed`).

- :mod:`mta.embedding.pooling`: ``pool`` (mean / cls / max / last / cls_attention), ``PoolingConfig``;
- :mod:`mta.embedding.encoder`: ``load_encoder`` (``AutoModel`` + tokenizer + pooling, a
  sentence-transformers directory's own pipeline read);
- :mod:`mta.embedding.export`: the sentence-transformers directory format, read and written;
- :mod:`mta.embedding.embed`: ``build_teacher_embeddings`` (the stage: batched,
  resumable, sharded), ``read_teacher_embeddings`` -> ``TeacherEmbeddings`` (what distillation
  reads: ids, texts, ``[n, d]`` float32 embeddings, manifest).

Imported by training (TALAS reads the teacher's vectors) and evaluation (the proxy encodes
held-out texts); it imports neither.

The names below are imported on first use (PEP 562), so that reading an embedding recipe's schema
(``mta.embedding.recipe``: ``mta recipes keys``) imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mta.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from mta.embedding.embed import (
        TeacherEmbeddings,
        build_teacher_embeddings,
        embedding_text,
        holds_teacher_embeddings,
        read_teacher_embeddings,
    )
    from mta.embedding.encoder import EncoderPlan, SentenceEncoder, load_encoder, plan_encoder
    from mta.embedding.pooling import POOLINGS, PoolingConfig, pool

# Each public name and the module it lives in.
EXPORTS = {
    "EncoderPlan": "mta.embedding.encoder",
    "SentenceEncoder": "mta.embedding.encoder",
    "load_encoder": "mta.embedding.encoder",
    "plan_encoder": "mta.embedding.encoder",
    "POOLINGS": "mta.embedding.pooling",
    "PoolingConfig": "mta.embedding.pooling",
    "pool": "mta.embedding.pooling",
    "TeacherEmbeddings": "mta.embedding.embed",
    "build_teacher_embeddings": "mta.embedding.embed",
    "embedding_text": "mta.embedding.embed",
    "holds_teacher_embeddings": "mta.embedding.embed",
    "read_teacher_embeddings": "mta.embedding.embed",
}


__getattr__, __dir__ = lazy_exports(globals(), EXPORTS)


__all__ = [
    "POOLINGS",
    "EncoderPlan",
    "PoolingConfig",
    "SentenceEncoder",
    "plan_encoder",
    "TeacherEmbeddings",
    "build_teacher_embeddings",
    "embedding_text",
    "holds_teacher_embeddings",
    "load_encoder",
    "pool",
    "read_teacher_embeddings",
]
