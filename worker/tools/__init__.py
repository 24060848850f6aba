"""Checkpoint tooling behind the CLI: `detgate make-model` and the demo tokenizer's training."""
