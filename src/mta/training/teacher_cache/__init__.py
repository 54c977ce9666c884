"""The teacher once: ``mta teacher`` stores what a recipe's losses read from the teacher, and
``mta distill`` with ``teacher_cache.dir`` trains from it (docs/teacher-cache.md).

- ``content``  what the cache holds for a recipe (layers, logits, k, storage), its manifest
  description and content key, and the size estimate the dry run prints
- ``build``    the stage: the recipe's teacher over the annotated rows of train and dev, journalled
  chunk by chunk, sharded (``--shard I/N``, ``torchrun``), into the store's layout
- ``read``     a finished cache checked against the recipe (refused naming the key that differs)
  and each gold micro batch's ``TeacherOutput`` rebuilt from it

Layout: ``DIR/train/`` and ``DIR/dev/``, each a store directory (:mod:`mta.store`: Parquet parts
listed with sha256 by ``.mta/manifest.json``, written last). One row per annotated row:

| column | type | content |
|---|---|---|
| ``id`` | int64 | the annotated row's id |
| ``tokens`` | int32 | its teacher tokens (the real ones; the batch's padding is not stored) |
| ``positions`` | list<int32> | the positions t whose next token t + 1 is a response token (logits only) |
| ``top_ids`` | list<int32> | per position, the teacher's k most probable next tokens at τ (``positions × k``) |
| ``top_log_probs`` | list<float16 or float32> | their log-probabilities at τ |
| ``tail`` | list<float32> | per position, the log of the mass outside the top k (:mod:`mta.losses.teacher_topk`) |
| ``hidden`` | list<float16 or float32> | the hidden states of the aligned layers, ``layers × tokens × d`` |

A part is written with one row per Parquet row group, so training reads a micro batch's rows by
row group without decoding the others.
"""
