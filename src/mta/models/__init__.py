"""Model and tokenizer helpers shared by every stage."""
