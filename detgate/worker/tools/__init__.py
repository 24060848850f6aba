"""Checkpoint tooling behind the CLI: `detgate make-model` and the demo tokenizer's training;
and push_weights.py, which hands a trainer's tensors to running workers."""
