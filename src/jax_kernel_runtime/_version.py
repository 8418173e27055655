"""The version of jax-kernel-runtime: its one source of truth (pyproject.toml reads it)."""

__version__ = "0.1.0"
