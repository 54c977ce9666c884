"""``task: llm`` (a recipe's default): distil a causal LM. ``plan`` resolves a recipe and its
models' configs into the run's plan (what ``mta distill --dry-run`` prints), ``build`` builds the
run from that plan, ``task`` registers both with the one training loop."""
