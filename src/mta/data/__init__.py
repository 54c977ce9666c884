"""The annotate stage: JSONL rows -> phrase and word spans -> token ranges -> Parquet artefact.

- ``rows``        stream a JSONL file, detect the row format, build prompt and response
- ``truncation``  length limits applied to the text, for both tokenizers at once
- ``encoding``    a tokenizer's ids and character offsets (Rust backend, picklable)
- ``spans``       spaCy noun chunks and verb phrases, the nesting rule, word spans
- ``alignment``   character spans -> half-open token ranges (docs/method.md §1)
- ``annotator``   one chunk of examples -> one Arrow record batch
- ``artefact``    Parquet schema, manifests, atomic writes, shards, ``read_annotations``
- ``annotate``    the pipeline: ``AnnotateSettings``, ``annotate_file``, worker processes
- ``prompts``     the Alpaca prompt template
"""
