"""`detgate audit`: measure the determinism of any OpenAI-compatible endpoint."""
