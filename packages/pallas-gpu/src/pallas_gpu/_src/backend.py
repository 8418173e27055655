"""The object pallas-core loads from the ``pallas.backends`` entry point."""

from __future__ import annotations

# The kernel frame imports the rule modules, which fill the lowering table.
from pallas_gpu._src import lowering_kernel  # noqa: F401
from pallas_gpu._src.core import CompilerParams, InterpretParams
from pallas_gpu._src.pallas_call_registration import lower as lower

PLATFORMS = ("cuda",)
COMPILER_PARAMS = CompilerParams
INTERPRET_PARAMS = InterpretParams
