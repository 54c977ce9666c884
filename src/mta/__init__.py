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
"""

__version__ = "0.2.0"
