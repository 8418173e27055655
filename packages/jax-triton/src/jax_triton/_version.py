"""The version of jax-triton-bridge: its one source of truth (pyproject.toml reads it)."""

__version__ = "0.5.0"

#: ``__version__`` as a tuple of ints, as the published jax-triton has it (code
#: checks ``jax_triton.__version_info__ >= (0, 4, 1)``).
__version_info__ = tuple(int(p) for p in __version__.split("."))
