"""detgate: command line, embedded stack (`detgate up`) and the audit client."""

__version__ = "0.1.0"
