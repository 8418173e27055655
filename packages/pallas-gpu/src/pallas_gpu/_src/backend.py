"""The object pallas-core loads from the ``pallas.backends`` entry point: this
module implements pallas-core's ``Backend`` protocol (``pallas.backend.Backend``)."""

from __future__ import annotations

# The kernel frame imports the rule modules, which fill the lowering table.
from pallas_gpu._src import lowering_kernel  # noqa: F401
from pallas_gpu._src.core import CompilerParams, InterpretParams
from pallas_gpu._src.pallas_call_registration import check_compiler_params as check_compiler_params
from pallas_gpu._src.pallas_call_registration import claims_interpret as claims_interpret
from pallas_gpu._src.pallas_call_registration import describe as describe
from pallas_gpu._src.pallas_call_registration import interpret as interpret
from pallas_gpu._src.pallas_call_registration import lower as lower

PLATFORMS = ("cuda",)
COMPILER_PARAMS = CompilerParams
INTERPRET_PARAMS = InterpretParams
# The launch grid and the generated kernel need static sizes.
DYNAMIC_GRID = False
