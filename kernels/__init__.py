"""Batch-invariant kernels: one reduction order per output element, whatever the batch."""
