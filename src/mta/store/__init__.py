"""The store: a directory of sharded Parquet parts with checked manifests, written by
``mta annotate`` (:mod:`mta.data.annotate`: spans aligned to two tokenizers) and by ``mta embed``
(:mod:`mta.embedding.embed`: a teacher's sentence embeddings), each with its own
columns, into the same layout.

- ``layout``     names and paths: parts, shard manifests, ``.mta/``, staging, lock files
- ``locks``      the shard and merge locks (``fcntl.flock``, :func:`mta.files.exclusive_lock`)
- ``manifests``  ``manifest.json`` and the shard manifests, read and checked
- ``publish``    ``PartWriter``, ``commit_shard``, ``try_merge``, ``merge_shards``, ``finish_publishing``
- ``reuse``      whether a directory already holds a writer's output (``reusable_output``)
- ``read``       ``read_stage_manifest``, ``verified_parts``: a complete stage output, checked

Annotate's reader, ``mta.data.annotations.read_annotations``, reads the same layout and upgrades
older schema versions (the store knows no columns).

Layout of an output directory (layout version 2, :data:`mta.store.layout.LAYOUTS`)::

    part-00000-of-00002-<run>.parquet           the rows of shard 0 (ids 0, 2, 4, ...)
    part-00001-of-00002-<run>.parquet           ... exactly the parts manifest.json lists
    .mta/manifest.json                          written last: the directory is complete
    .mta/shard-00000-of-00002.json              one per shard: its counts and its part
    .mta/staging/part-00000-of-00002-<run>.parquet   a shard's part until its set is complete
    .mta/.lock-shard-00000-of-00002, .mta/.lock-merge   only while a writer runs (see "Locks")

The directory itself holds nothing but the published parts, so ``pandas.read_parquet(DIR)``,
``pyarrow.dataset.dataset(DIR)``, DuckDB's ``'DIR/*.parquet'`` and
``datasets.load_dataset("parquet", data_dir=DIR)`` read exactly the artefact's rows: all of them
skip ``.mta/`` (a name starting with a dot). A part is written into ``.mta/staging/`` and stays
there until every shard of its set is written; the merge that writes ``manifest.json`` then
deletes the parts it supersedes from the directory and renames the new ones into it. So a
shard set still being written, a superseded run's shards and the part of a run killed before its
shard manifest (an orphan) all stay in ``.mta/``, out of every reader's sight; the next writer of
that shard deletes the orphan. For the few milliseconds of a publish, a reader that takes no lock
can see the old parts, none, or some of the new ones, never old and new together;
:func:`~mta.data.annotations.read_annotations` reads a part from ``.mta/staging/`` when its publish
was cut short, and the next writer finishes that publish.

Directories of layout 1 (mta 0.1: ``manifest.json``, ``shard-*.json`` and the parts side by side)
still read. A writer adopts such a directory first (its manifest and shard manifests move into
``.mta/``, the parts of unfinished shard sets into staging), so a matching artefact is reused
and a new one replaces it as usual.

Every file is written atomically (``mta.files``: a hidden temporary name in the same directory,
fsync, rename), so a crash never leaves a half-written file under a real name. ``manifest.json``
lists the parts it describes by name, rows and sha256; a re-run writes parts under a new
``<run>`` name and deletes the old ones only after the new manifest is in place, so until then the
previous artefact stays whole. ``manifest.json`` appears only when every shard of a set (same run
key, same shard count) has written its shard manifest; readers refuse a directory without it. A
killed process may leave a hidden ``.*.tmp`` file behind in ``.mta/``: nothing reads it, and it is
not removed automatically because a concurrent shard could be writing it.

Trust: a manifest or shard file is data, not instructions. Every part it names must be a plain
part name (``part-IIIII-of-NNNNN-<run>.parquet``) resolving inside the directory (and inside
``.mta/staging/``), or the directory is refused before anything is read or deleted; a part whose
bytes do not match the recorded sha256 and row count, or that Parquet cannot read, is refused
naming the part.

Locks: a writer holds ``.mta/.lock-shard-IIIII-of-NNNNN`` (``fcntl.flock``, its pid and host
written in it) while it computes and publishes its shard, so a second writer of the same shard is
refused naming the holder; shards of one set still run side by side. Publishing a shard manifest,
writing ``manifest.json``, moving parts and deleting superseded ones happen under
``.mta/.lock-merge``, so two shards that finish together never race. The kernel drops a lock when
its holder dies (even by SIGKILL), so a stale lock file never blocks anyone; a lock file is
deleted by its holder on release. Readers take no lock.

The annotate artefact's columns, its schema and layout versions and the reading of older schema
versions live in :mod:`mta.data.artefact_schema`; this package writes the current version and
lays out the files.
"""
