"""A run's life on disk: the output directory it claims (``run_directory``), its checkpoints and
exports (``checkpointing``, read back through ``safe_loading``), ``best/`` (``selection``), the
model card of every export (``model_card``), and what it logs per step (``metrics``, with the
FLOPs and MFU of ``utilisation``).
"""
