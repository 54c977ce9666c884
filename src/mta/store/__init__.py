"""The store: a directory of sharded Parquet parts with checked manifests, the one layout
``mta annotate``, ``mta embed`` and ``mta teacher`` write (each with its own columns). Its files,
publishing, locks and trust rules: ARCHITECTURE.md, "1. annotate".
"""
