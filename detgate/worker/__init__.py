"""The built-in worker: a batch-invariant inference engine behind an OpenAI-style server."""
