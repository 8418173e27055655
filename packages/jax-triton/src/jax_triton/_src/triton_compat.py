"""Every use of Triton (and of JAX internals) in jax_triton goes through here.

Triton is pinned exactly, so a Triton release breaks this one file, not the
package. Public Triton APIs are preferred. Triton's interpreter internals
(running a kernel on host memory without torch) are wrapped once for
jax-triton and pallas-gpu alike, in jax_kernel_runtime's shared Triton layer
(``jax_kernel_runtime.triton.interpret``).
"""

from __future__ import annotations

import warnings

import triton
import triton.language as tl
from jax._src import dispatch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner, Config, Heuristics
from triton.runtime.jit import JITFunction

# The Triton this release was validated against. The wheel identity is the
# sha256 of triton/_C/libtriton.so recorded in triton-3.6.0.dist-info/RECORD
# (PyPI manylinux_2_27/2_28 x86_64 wheel, cp312), i.e. the v3.6.0 release tag.
#: The Triton release this jax-triton-bridge release was validated against (its pin).
VALIDATED_TRITON_VERSION = "3.6.0"
#: The validated Triton build: its release tag and the sha256 of its ``libtriton.so``.
VALIDATED_TRITON_BUILD = (
    "v3.6.0 release wheel; libtriton.so sha256=KNqqcKkE5Pit11TlGFM-imm5SrixZDHOd9RfHyUoK4c"
)

__all__ = [
    "ASTSource",
    "Autotuner",
    "Config",
    "GPUTarget",
    "Heuristics",
    "JITFunction",
    "dispatch",
    "tl",
    "triton",
]  # fmt: skip

_warned = False


def check_triton_version() -> None:
    """Warns once per process when the installed Triton is not the pinned one."""
    global _warned
    if _warned or triton.__version__ == VALIDATED_TRITON_VERSION:
        return
    _warned = True
    warnings.warn(
        f"jax_triton was validated with triton=={VALIDATED_TRITON_VERSION} "
        f"({VALIDATED_TRITON_BUILD}) but triton {triton.__version__} is "
        f"installed; kernels may fail to compile or run. Install "
        f"'triton=={VALIDATED_TRITON_VERSION}'.",
        RuntimeWarning,
        stacklevel=3,
    )


def constexpr_tuple(values: tuple):
    """A tuple constexpr value as Triton's code generator can use it.

    Triton 3.6 wraps a constant in ``tl.constexpr``, and a Python tuple inside
    cannot be unpacked (``a, b = strides``: "cannot convert (1, 1) of type
    tuple to tensor"). A ``tl.tuple`` of constexprs can, and ``len``, indexing
    and ``==`` still work (tokamax's kernels take strides and batch shapes so).
    """
    t = tl.tuple([constexpr_tuple(v) if isinstance(v, tuple) else tl.constexpr(v) for v in values])
    # ASTSource.hash asks constants for `cache_key` with hasattr, and tl.tuple's
    # __getattr__ raises ValueError for it (a field lookup), not AttributeError.
    # An instance attribute, not a subclass: loops check that a carried value
    # keeps its class, and the tuples Triton derives from this one are tl.tuples.
    t.cache_key = repr(values)
    return t


def compile_option_names() -> frozenset[str]:
    """Names of the options Triton's CUDA backend takes (``CUDAOptions``)."""
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions

    return frozenset(f.name for f in dataclasses.fields(CUDAOptions))


def pointer_type(signature_type: str):
    """Triton type object for a signature string such as '*fp32'."""
    return tl.str_to_ty(signature_type, None)
