"""mta: Multi-Granular Trajectory Alignment for LLM knowledge distillation.

The library is organised by pipeline stage:

- ``mta.data``        annotate: rows -> spans -> token ranges -> Parquet artefact
- ``mta.losses``      token importance, span pooling, DSA, HRA and the base KD losses
- ``mta.training``    recipes, batching, the DeepSpeed training loop, checkpoints
- ``mta.evaluation``  generation and ROUGE-L under the MiniLLM protocol
- ``mta.models``      model and tokenizer helpers (conversion, pruned students, tiny models)

The command-line interface lives in the separate ``mta_cli`` package and only parses
arguments and reports; everything it does is callable from here.
"""

__version__ = "0.1.0"
