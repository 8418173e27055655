"""jax-triton: call ``@triton.jit`` kernels on JAX arrays, on GPUs and on CPUs.

A maintained replacement for the published jax-triton 0.4 API
(``triton_call``), launched through jax-kernel-runtime's XLA FFI target on
CUDA and through Triton's interpreter on CPU.
"""

from jax_triton._src.compile import TritonCompilationError as TritonCompilationError
from jax_triton._src.triton_call import triton_call as triton_call
from jax_triton._src.triton_compat import (
    VALIDATED_TRITON_BUILD as VALIDATED_TRITON_BUILD,
)
from jax_triton._src.triton_compat import (
    VALIDATED_TRITON_VERSION as VALIDATED_TRITON_VERSION,
)
from jax_triton._src.triton_pin import check_at_import as _check_version
from jax_triton._src.utils import cdiv as cdiv
from jax_triton._src.utils import next_power_of_2 as next_power_of_2
from jax_triton._src.utils import strides_from_shape as strides_from_shape
from jax_triton._version import __version__ as __version__
from jax_triton._version import __version_info__ as __version_info__

_check_version()

# Import Triton's code generator and memoize Triton's cache key in the
# background (see jax_kernel_runtime.prepare_triton): the first compile
# would otherwise pay for them.
import jax_kernel_runtime as _jkr  # noqa: E402

_jkr.prepare_triton(background=True)
