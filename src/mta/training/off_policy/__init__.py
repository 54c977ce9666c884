"""Sampling during training: DistiLLM's adaptive off-policy sampling (the recipe's ``off_policy:``).

Three modules, one job each:

- ``policy``: the pure adaptive policy. Which source a micro batch trains on (``decide``: gold,
  generated or buffer), the threshold update after a dev evaluation (``update_threshold``), the
  schedules, the keyed draws and seeds, the sampling parameters, and the ``OffPolicyState`` saved
  as JSON with each checkpoint. No tensors, no I/O but the state file.
- ``replay_buffer``: a rank's FIFO ``ReplayBuffer`` of generated rows (annotate columns), its
  Parquet file in a checkpoint, and the generated-rows files (``write_generated_rows`` /
  ``read_generated_rows``, also ``OUT/generated/``).
- ``micro_batches``: the source of micro batches, ``OffPolicyBatches``: the gold micro batch,
  the student's own samples of its prompts (spans parsed in worker processes while the teacher
  forward runs; ``with_spans`` waits for them) or rows drawn from the buffer.

The package imports none of them: import the module you need.
"""
