"""The version of jax-pallas-core: its one source of truth (pyproject.toml reads it)."""

__version__ = "0.1.0"
