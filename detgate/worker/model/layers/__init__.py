"""The decoder's building blocks, one nn.Module per file; each takes its numeric ops explicitly."""
