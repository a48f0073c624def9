"""hicached: a standalone HiCache tiering daemon for LLM inference."""

__version__ = "0.1.0"
