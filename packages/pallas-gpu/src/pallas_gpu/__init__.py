"""pallas_gpu: the Triton backend of Pallas (``import pallas_gpu as plgpu``).

Installing this package makes ``pallas.pallas_call`` compile kernels for
NVIDIA GPUs: the kernel jaxpr is lowered to Triton source, compiled by
``triton.compile`` and launched by ``jax_kernel_runtime``. Pass
``interpret=plgpu.InterpretParams()`` to run the same generated Triton code on
the CPU through Triton's interpreter. Ready-made kernels (flash attention,
layer and RMS norm, softmax) are in ``pallas_gpu.ops``.
"""

from pallas_gpu._src.compile.autotune import Autotuned as Autotuned
from pallas_gpu._src.compile.autotune import autotune as autotune
from pallas_gpu._src.language.core import CompilerParams as CompilerParams
from pallas_gpu._src.language.core import InterpretParams as InterpretParams
from pallas_gpu._src.language.gpu_info import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL_TARGET_NAME
from pallas_gpu._src.language.gpu_info import GpuInfo as GpuInfo
from pallas_gpu._src.language.gpu_info import GpuVersion as GpuVersion
from pallas_gpu._src.language.gpu_info import get_gpu_info as get_gpu_info
from pallas_gpu._src.language.gpu_info import get_gpu_info_from_version as get_gpu_info_from_version
from pallas_gpu._src.language.gpu_info import is_gpu_device as is_gpu_device
from pallas_gpu._src.language.primitives import approx_tanh as approx_tanh
from pallas_gpu._src.language.primitives import atomic_add as atomic_add
from pallas_gpu._src.language.primitives import atomic_and as atomic_and
from pallas_gpu._src.language.primitives import atomic_cas as atomic_cas
from pallas_gpu._src.language.primitives import atomic_max as atomic_max
from pallas_gpu._src.language.primitives import atomic_min as atomic_min
from pallas_gpu._src.language.primitives import atomic_or as atomic_or
from pallas_gpu._src.language.primitives import atomic_xchg as atomic_xchg
from pallas_gpu._src.language.primitives import atomic_xor as atomic_xor
from pallas_gpu._src.language.primitives import debug_barrier as debug_barrier
from pallas_gpu._src.language.primitives import dot as dot
from pallas_gpu._src.language.primitives import elementwise_inline_asm as elementwise_inline_asm
from pallas_gpu._src.language.primitives import load as load
from pallas_gpu._src.language.primitives import max_contiguous as max_contiguous
from pallas_gpu._src.language.primitives import store as store
from pallas_gpu._src.language.primitives import swap as swap
from pallas_gpu._version import __version__ as __version__

# isort: split

# Register with pallas-core now, so the first pallas_call neither scans the
# installed entry points nor imports the lowering (the entry point remains for
# processes that never import pallas_gpu).
from pallas import backend as _pallas_backend  # noqa: E402
from pallas_gpu._src import pallas_call_registration as _registration  # noqa: E402

_pallas_backend.register_backend("gpu", _registration)

# Import Triton and memoize its cache key in the background, so that the
# first compile does not pay for them (see jax_kernel_runtime.prepare_triton).
import jax_kernel_runtime as _jkr  # noqa: E402

_jkr.prepare_triton(background=True)
