"""The version of jax-triton-bridge: its one source of truth (pyproject.toml reads it)."""

__version__ = "0.5.0"
