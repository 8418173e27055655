"""``ops.matmul`` on Hopper (sm_90): the Gluon kernels of
``_matmul_sm90_kernel`` as candidates of ``matmul``'s autotuner, when they
apply, and their launch through the shared Triton layer and
``jax_kernel_runtime.kernel_call``.

They apply to bf16 or f16 inputs with a result of the same dtype, rows of
16-byte multiples (k and n multiples of 8: TMA's rule), compiled for a GPU
of compute capability 9.0, with a Triton release they were run on
(``GLUON_VALIDATED_TRITON``). Elsewhere ``matmul`` tunes over its Pallas
kernels alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import jax_kernel_runtime as jkr
from jax_kernel_runtime import triton as jkr_triton
from pallas_gpu.ops._common import (
    GLUON_VALIDATED_TRITON,
    gluon_kernel_config,
    multiprocessor_count,
    triton_release,
)

DTYPES = ("bfloat16", "float16")
KINDS = ("coop", "pingpong")


@dataclasses.dataclass(frozen=True)
class Sm90Config:
    """One launch of the sm_90 Gluon matmul: ``kind`` "coop" (both math
    warpgroups on each ``block_m x block_n`` tile) or "pingpong" (each on
    whole tiles, taking turns), ``num_buffers`` ring slots of A and B blocks,
    tiles in groups of ``group_m`` block rows. One program per multiprocessor."""

    kind: str = "coop"
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_buffers: int = 3
    group_m: int = 8

    def label(self) -> str:
        return f"sm90-{self.kind}/{self.block_m}x{self.block_n}x{self.block_k}/{self.num_buffers}buf"


# Candidates (the first is what a lowering without a GPU takes). H200, bf16, at 8192^3 / 4096^3 /
# 8192x8192x1024: launched from torch (benchmarks/gluon_matmul.py) coop 128x256x64/3 716.5 / 726.4 /
# 691.3 TFLOP/s (0.957x / 0.990x / 1.043x torch's cuBLAS), pingpong 128x128x64/5 676.9 / 692.4 /
# 677.4, pingpong 64x256 and coop 128x128 slower at each; through jax.jit (gpu_matmul.py, two runs)
# coop 703.3 / 648 / 618 and 687.8 / 637.5 / 608.1, pingpong 682.3 / 670.7 / 649.7 and 674.7 /
# 644.4 / 654.7: each leads somewhere, so the tuner keeps both.
CONFIGS = (Sm90Config("coop", 128, 256, 64, 3), Sm90Config("pingpong", 128, 128, 64, 5))


def check_config(config: Sm90Config) -> None:
    """Raises ValueError, naming the config, unless the kernels can be built
    with it: the tile shapes their layouts take (128-byte rows of A and B
    tiles for the TMA swizzle, wgmma's n <= 256, an f32 accumulator of at
    most 128 registers per thread of a math warpgroup), two or more ring
    slots. Shared memory is checked once compiled (``kernel_config``)."""
    c = config
    rows = {"coop": (128,), "pingpong": (64, 128)}.get(c.kind)
    problems = []
    if rows is None:
        problems.append(f"kind {c.kind!r}: expected one of {KINDS}")
    elif c.block_m not in rows:
        problems.append(f"block_m {c.block_m}: {c.kind} takes {' or '.join(map(str, rows))}")
    if c.block_n not in (64, 128, 256):
        problems.append(f"block_n {c.block_n}: expected 64, 128 or 256")
    if c.block_k not in (64, 128):
        problems.append(f"block_k {c.block_k}: expected 64 or 128")
    acc_rows = c.block_m // 2 if c.kind == "coop" else c.block_m
    if rows is not None and acc_rows * c.block_n > 128 * 128:
        problems.append(
            f"a {acc_rows}x{c.block_n} f32 accumulator per math warpgroup is more than 128 registers per thread"
        )
    if c.num_buffers < 2 or c.group_m < 1:
        problems.append(f"num_buffers {c.num_buffers} and group_m {c.group_m}: expected >= 2 and >= 1")
    if problems:
        raise ValueError(f"pallas_gpu.ops.matmul: config={c}: {'; '.join(problems)}")


def unsupported(m: int, n: int, k: int, dtype, out_dtype, cc: int | None) -> str | None:
    """Why the sm_90 kernels cannot compute this product (None: they can)."""
    if cc != 90:
        return f"compute capability {cc}, not 90"
    names = {jnp.dtype(dtype).name, jnp.dtype(out_dtype).name}
    if len(names) != 1 or not names <= set(DTYPES):
        return (
            f"inputs {jnp.dtype(dtype).name} with result {jnp.dtype(out_dtype).name} (needs bf16 or f16 both)"
        )
    if k % 8 or n % 8:
        return f"k {k} and n {n} must be multiples of 8 (16-byte rows for TMA)"
    if min(m, n, k) < 1:
        return f"empty product ({m}, {k}) @ ({k}, {n})"
    if triton_release() not in GLUON_VALIDATED_TRITON:
        return f"Triton {triton_release()} (validated: {', '.join(GLUON_VALIDATED_TRITON)})"
    return None


@functools.lru_cache(maxsize=64)
def kernel_config(dtype: str, m: int, n: int, k: int, config: Sm90Config) -> jkr.KernelConfig:
    """The compiled kernel for these sizes: from memory, the disk cache
    (pallas-gpu's, ``PALLAS_GPU_CACHE_DIR``), else ``triton.compile``."""
    c = config
    constexprs = dict(
        M=m, N=n, K=k, BM=c.block_m, BN=c.block_n, BK=c.block_k, NBUF=c.num_buffers, GROUP=c.group_m
    )
    check_config(config)
    ptr = "*bf16" if dtype == "bfloat16" else "*fp16"
    signature = {"A": ptr, "B": ptr, "C": ptr}
    cfg = gluon_kernel_config("pallas_gpu.ops._matmul_sm90_kernel", f"matmul_{c.kind}", signature, constexprs)
    limit = jkr_triton.SHARED_MEMORY_LIMITS[90]
    if cfg.shared_memory_bytes > limit:
        raise ValueError(
            f"pallas_gpu.ops.matmul: config={config} needs {cfg.shared_memory_bytes} bytes of shared "
            f"memory, more than sm_90 allows ({limit}): use fewer num_buffers or smaller blocks"
        )
    return cfg


def grid_size(m: int, n: int, config: Sm90Config) -> int:
    """One program per multiprocessor (fewer when there are fewer tiles)."""
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    return min(tiles, multiprocessor_count())


def matmul(a, b, config: Sm90Config, debug: bool = False):
    """``a @ b`` (2-d, one 16-bit dtype, a result of that dtype) by the sm_90
    kernel ``config`` names; batched (``vmap``) calls run as 2-d products."""
    check_config(config)
    if debug:
        print(
            f"matmul: the sm_90 Gluon kernel matmul_{config.kind} (pallas_gpu/ops/_matmul_sm90_kernel.py), {config}"
        )
    return _batched(config)(a, b)


def _launch(a, b, config: Sm90Config):
    (m, k), n = a.shape, b.shape[1]
    cfg = kernel_config(jnp.dtype(a.dtype).name, m, n, k, config)
    (out,) = jkr.kernel_call(
        a,
        b,
        configs=[cfg],
        grid=(grid_size(m, n, config),),
        out_shapes=[jax.ShapeDtypeStruct((m, n), a.dtype)],
        name=f"matmul_{config.kind}",
    )
    return out


@functools.cache
def _batched(config: Sm90Config):
    """``_launch`` with a ``vmap`` rule (kernel launches have none): a batched
    ``a`` over an unbatched ``b`` is one product of stacked rows; a batched
    ``b`` runs one product per batch element (``lax.map``)."""

    @jax.custom_batching.custom_vmap
    def call(a, b):
        return _launch(a, b, config)

    @call.def_vmap
    def _rule(axis_size, in_batched, a, b):
        a_batched, b_batched = in_batched
        if not b_batched:
            rows = call(a.reshape(axis_size * a.shape[1], a.shape[2]), b)
            return rows.reshape(axis_size, a.shape[1], b.shape[1]), True
        if not a_batched:
            a = jnp.broadcast_to(a, (axis_size, *a.shape))
        return jax.lax.map(lambda ab: call(*ab), (a, b)), True

    return call
