"""Turning a ``triton.compile`` result into a ``KernelConfig``.

Kept in its own module so that importing jax_kernel_runtime never imports
Triton: only callers that compile Triton kernels pay for it.
"""

from __future__ import annotations

from typing import Any

from jax_kernel_runtime._config import KernelConfig


def config_from_triton(compiled: Any) -> KernelConfig:
    """Describes a ``triton.compile(...)`` result (a ``CompiledKernel``).

    Reads only the compiled artifacts and their metadata (the cubin, the
    function name, warps, CTAs per cluster, shared memory and Triton's scratch
    sizes), so it works on machines with no GPU.
    """
    md = compiled.metadata
    asm = compiled.asm
    if "cubin" not in asm:
        raise ValueError(
            f"Triton kernel {md.name!r} was compiled for {md.target!r}; "
            "jax-kernel-runtime launches CUDA cubins only"
        )
    warp_size = getattr(md, "warp_size", 32)
    num_ctas = int(getattr(md, "num_ctas", 1))
    return KernelConfig(
        image=bytes(asm["cubin"]),
        function=md.name,
        block_dims=(int(md.num_warps) * int(warp_size), 1, 1),
        shared_memory_bytes=int(md.shared),
        cluster_dims=(num_ctas, 1, 1),
        global_scratch_bytes=int(getattr(md, "global_scratch_size", 0) or 0),
        profile_scratch_bytes=int(getattr(md, "profile_scratch_size", 0) or 0),
        # Triton >= 3.3 always appends the two scratch pointers to the kernel.
        triton_scratch_params=True,
        cooperative=bool(getattr(md, "launch_cooperative_grid", False)),
        pdl=bool(getattr(md, "launch_pdl", False)),
    )
