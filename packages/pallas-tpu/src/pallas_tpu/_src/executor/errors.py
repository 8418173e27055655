"""``run_mosaic``'s error, and how an error names the op it is about."""

from __future__ import annotations


class MosaicError(RuntimeError):
    """A Mosaic module did something a TPU cannot (out-of-bounds access, a
    semaphore wait that never returns), or something ``run_mosaic`` lacks."""


def where(op) -> str:
    """``'vector.load' at loc(...)``: the op and its location in the module
    (for modules with debug locations: the kernel's source line)."""
    loc = str(op.location)
    return f"'{op.operation.name}' at {loc}"
