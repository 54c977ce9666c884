"""The annotate stage: JSONL rows -> phrase and word spans -> token ranges -> Parquet artefact.

- ``rows``, ``sources``  stream the input (JSONL, Parquet, CSV, save_to_disk), detect the format
- ``prompts``            the prompt template (Alpaca, chat template, the row's own)
- ``truncation``         length limits applied to the text, for both tokenizers at once
- ``encoding``           a tokenizer's ids and character offsets (Rust backend, picklable)
- ``span_extraction``    spaCy noun chunks and verb phrases, the nesting rule, word spans
- ``token_ranges``       character spans -> half-open token ranges (docs/method.md §1)
- ``example_annotator``  one chunk of examples -> one Arrow record batch (and the worker entry points)
- ``artefact_schema``    the artefact's schema versions and their upgrades
- ``annotations``        ``read_annotations``: a complete artefact, upgraded to today's schema
- ``annotate``           the stage: ``AnnotateSettings``, ``annotate_file``, worker processes
- ``online_spans``       spans of text generated during training, annotate's code in a worker pool

The files it writes are a store directory (``mta.store``).
"""
