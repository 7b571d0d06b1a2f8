"""A router for LLM inference fleets, on trio."""

__version__ = "0.1.0"
