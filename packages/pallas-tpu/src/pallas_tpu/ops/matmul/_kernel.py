"""matmul's kernel bodies and their ``pallas_call`` (the package's docstring says how they work)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops.matmul._blocks import vmem_bytes

# How the first k step starts the accumulator: "select" stores its product as it is (the
# accumulator's old value dropped by a select fused into the add: no extra pass, one copy of
# the product's code); "zero" zeroes the tile first and then adds (a whole-tile pass of
# stores: 1030 bundles of a 1024 x 1024 f32 tile on the v5e, 1.6% of a (1024, 1024, 1024)
# step at k / bk = 4, by libtpu's schedule; benchmarks/tpu_gmm_schedule.py).
FIRST_STEP = "select"


def accumulator_dtype(dtype) -> np.dtype:
    """The MXU's accumulator for operands of ``dtype``: int32 for integers, else f32."""
    return np.dtype(np.int32 if jnp.issubdtype(dtype, jnp.integer) else np.float32)


def mxu_operand_dtype(x_dtype, y_dtype, info) -> np.dtype | None:
    """The dtype both panels are widened to in VMEM, or None when the MXU takes them
    as they are. Integers the MXU does not take (a TPU v4's int8) go in as bf16,
    which holds them exactly; each k step's f32 sums stay exact up to 2**24."""
    if x_dtype == y_dtype and info.is_matmul_supported(x_dtype, y_dtype):
        return None
    if max(np.dtype(x_dtype).itemsize, np.dtype(y_dtype).itemsize) <= 2 and info.is_matmul_supported(
        jnp.bfloat16, jnp.bfloat16
    ):
        return np.dtype(jnp.bfloat16)
    return np.dtype(np.float32)


def _panel_product(x_ref, y_ref, acc_dtype, widen):
    x, y = x_ref[...], y_ref[...]
    if widen is None:
        return jnp.dot(x, y, preferred_element_type=acc_dtype)
    x, y = x.astype(widen), y.astype(widen)
    if jnp.issubdtype(acc_dtype, jnp.integer):  # integers through float panels: exact sums, rounded back
        return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(acc_dtype)
    return jnp.dot(x, y, preferred_element_type=acc_dtype)


def accumulate(acc_ref, product, first):
    """``acc_ref = product()`` where ``first`` (a traced bool), else ``acc_ref += product()``."""
    if FIRST_STEP == "zero":

        @pl.when(first)
        def _zero():  # before the product, as the earlier kernel had it
            acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

        acc_ref[...] += product()
        return
    value = product()
    acc_ref[...] = jnp.where(first, value, acc_ref[...] + value)


def _kernel_in_place(x_ref, y_ref, o_ref, *, widen, steps_k):
    """A 32-bit result: the output block is the accumulator (it stays in VMEM while k runs)."""

    def product():
        return _panel_product(x_ref, y_ref, o_ref.dtype, widen)

    if steps_k == 1:
        o_ref[...] = product()
        return
    accumulate(o_ref, product, pl.program_id(2) == 0)


def _kernel_scratch(x_ref, y_ref, o_ref, acc_ref, *, widen, steps_k=None):
    """A narrower result: accumulate in ``acc_ref``, convert on the last k step only."""

    def product():
        return _panel_product(x_ref, y_ref, acc_ref.dtype, widen)

    if steps_k == 1:  # the whole of k in one step: no accumulator round trip
        o_ref[...] = product().astype(o_ref.dtype)
        return
    accumulate(acc_ref, product, pl.program_id(2) == 0)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def matmul_kernel(x_tile_ref, y_tile_ref, o_tile_ref, acc_ref):
    """The kernel of JAX's module, for callers that build their own
    ``pallas_call`` with it: grid ``(i, j, k)`` with k last, ``acc_ref`` a VMEM
    scratch of the tile's shape in the accumulator dtype; the output tile is
    written on the last k step only."""
    _kernel_scratch(x_tile_ref, y_tile_ref, o_tile_ref, acc_ref, widen=None)


def call(x, y, blocks, in_dtype, acc_dtype, out_dtype, info, *, debug, interpret):
    """``x @ y`` by the kernel over ``blocks`` ``(bm, bn, bk)``: operands padded with zeros to
    whole blocks (a dimension no chosen block divides), the result cut back."""
    (m, k), n = x.shape, y.shape[1]
    bm, bn, bk = blocks
    pm, pk, pn = (-(-d // b) * b for d, b in ((m, bm), (k, bk), (n, bn)))
    if (pm, pk) != (m, k):
        x = jnp.pad(x, ((0, pm - m), (0, pk - k)))
    if (pk, pn) != (k, n):
        y = jnp.pad(y, ((0, pk - k), (0, pn - n)))
    in_place = out_dtype == acc_dtype
    widen = mxu_operand_dtype(x.dtype, y.dtype, info)
    body = _kernel_in_place if in_place else _kernel_scratch
    kernel = functools.partial(body, widen=widen, steps_k=pk // bk)
    scratch = [] if in_place else [pltpu.VMEM((bm, bn), acc_dtype)]
    needed = vmem_bytes(bm, bn, bk, in_dtype, out_dtype, scratch=not in_place)
    grid = (pm // bm, pn // bn, pk // bk)
    moved = (m * k * grid[1] + k * n * grid[0]) * np.dtype(in_dtype).itemsize + m * n * out_dtype.itemsize
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((pm, pn), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=[
                pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
            scratch_shapes=scratch,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=_policy.vmem_limit("matmul", needed, info),
        ),
        cost_estimate=pl.CostEstimate(flops=2 * m * n * k, transcendentals=0, bytes_accessed=moved),
        debug=debug,
        interpret=interpret,
        name="matmul",
    )(x, y)
    return out[:m, :n] if (pm, pn) != (m, n) else out
