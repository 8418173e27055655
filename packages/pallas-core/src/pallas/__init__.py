"""pallas: write JAX kernels over Refs (a drop-in for JAX's experimental Pallas).

``import pallas as pl`` gives the same API as
``from jax.experimental import pallas as pl``. Kernels run in interpret mode
on any machine; install ``jax-pallas-gpu`` (``import pallas_gpu``: Triton, for
NVIDIA GPUs) or ``jax-pallas-tpu`` (``import pallas_tpu``: Mosaic, for TPUs) to
compile them for accelerators.
"""

from pallas._src import removed as _removed  # noqa: E402
from pallas._src.compat import Slice as Slice
from pallas._src.compat import broadcast_to as broadcast_to
from pallas._src.compat import run_state as run_state
from pallas._src.core import ANY as ANY
from pallas._src.core import HOST as HOST
from pallas._src.core import BlockDim as BlockDim
from pallas._src.core import Blocked as Blocked
from pallas._src.core import BlockSpec as BlockSpec
from pallas._src.core import BoundedSlice as BoundedSlice
from pallas._src.core import Buffered as Buffered
from pallas._src.core import CompilerParams as CompilerParams
from pallas._src.core import CostEstimate as CostEstimate
from pallas._src.core import Element as Element
from pallas._src.core import GridSpec as GridSpec
from pallas._src.core import Indirect as Indirect
from pallas._src.core import MemoryRef as MemoryRef
from pallas._src.core import MemorySpace as MemorySpace
from pallas._src.core import Mesh as Mesh
from pallas._src.core import RevisitMode as RevisitMode
from pallas._src.core import Squeezed as Squeezed
from pallas._src.core import no_block_spec as no_block_spec
from pallas._src.core import semaphore as semaphore
from pallas._src.core import squeezed as squeezed
from pallas._src.core_map import core_map as core_map
from pallas._src.cost_estimate import estimate_cost as estimate_cost
from pallas._src.global_refs import get_global as get_global
from pallas._src.helpers import align_to as align_to
from pallas._src.helpers import empty_ref_like as empty_ref_like
from pallas._src.helpers import lower_as_mlir as lower_as_mlir
from pallas._src.helpers import select_ref as select_ref
from pallas._src.helpers import strides_from_shape as strides_from_shape
from pallas._src.helpers import with_scoped as with_scoped
from pallas._src.interpret import InterpretParams as InterpretParams
from pallas._src.kernel import kernel as kernel
from pallas._src.pallas_call import pallas_call as pallas_call
from pallas._src.pallas_call_rules import pallas_call_p as pallas_call_p
from pallas._src.poison import enable_poison_buffers as enable_poison_buffers
from pallas._src.primitives import cdiv as cdiv
from pallas._src.primitives import debug_print as debug_print
from pallas._src.primitives import ds as ds
from pallas._src.primitives import dslice as dslice
from pallas._src.primitives import empty as empty
from pallas._src.primitives import empty_like as empty_like
from pallas._src.primitives import loop as loop
from pallas._src.primitives import multiple_of as multiple_of
from pallas._src.primitives import next_power_of_2 as next_power_of_2
from pallas._src.primitives import num_programs as num_programs
from pallas._src.primitives import program_id as program_id
from pallas._src.primitives import run_scoped as run_scoped
from pallas._src.primitives import when as when
from pallas._src.ref_padding import pad_ref as pad_ref
from pallas._src.semaphores import DeviceIdType as DeviceIdType
from pallas._src.semaphores import debug_check as debug_check
from pallas._src.semaphores import delay as delay
from pallas._src.semaphores import enable_debug_checks as enable_debug_checks
from pallas._src.semaphores import semaphore_read as semaphore_read
from pallas._src.semaphores import semaphore_signal as semaphore_signal
from pallas._src.semaphores import semaphore_wait as semaphore_wait
from pallas._version import __version__ as __version__

# Names JAX's Pallas removed or moved (pl.dot, ...): JAX's words and where they went.
__getattr__ = _removed.module_getattr(__name__, _removed.PALLAS)
