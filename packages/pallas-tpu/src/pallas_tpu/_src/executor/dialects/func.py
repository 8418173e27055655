"""``run_mosaic``'s rules for the ``func`` dialect (``func.return`` is a
terminator: see ``framework.TERMINATORS``)."""

from __future__ import annotations

from pallas_tpu._src.executor.attrs import symbol_attr
from pallas_tpu._src.executor.framework import rule


@rule("func.call")
def _call(ex, op, vals, env):
    return ex.call(symbol_attr(op, "callee"), vals)
