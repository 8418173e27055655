"""Blocked matrix multiplication ``x @ y`` on the TensorCore, with the call
signature of JAX's ``ops.tpu.matmul``.

The grid is (row blocks, column blocks, k steps): one program owns a
``(bm, bn)`` tile of the result and walks ``k`` in steps of ``bk``, feeding the
two panels to the MXU in their own dtype (bf16 and int8 straight in, fp8 where
the chip's MXU takes it, else widened to bf16 in VMEM) and accumulating in 32
bits (f32, or int32 for integer inputs). The tile is written once, on the last
k step: a 32-bit result accumulates in the output block itself (it stays in
VMEM while k runs), a narrower one in an f32 VMEM scratch that is converted
on the way out; the first k step stores its product as it is (no zeroing pass),
and a single k step writes the result straight out. The k axis is ``"arbitrary"``, the other two ``"parallel"``
(split over the TensorCores of a megacore chip).

Blocks come from ``choose_blocks`` when not given: a table measured on the
TPU v5e, else a rule from the chip's facts (``pltpu.get_tpu_info()``): tiles
square enough that the MXU, not HBM, sets the pace, shrunk until the
double-buffered panels fit the VMEM budget. Given blocks are used as they are,
and must divide the operands. The VMEM limit is raised to what the blocks need.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas as pl
import pallas_tpu as pltpu

# (bm, bn, bk) per input itemsize on the TPU v5e. A (bm, bn) tile does bm*bn/(bm+bn)
# flops per loaded bf16 byte: 512 for 1024 x 1024 tiles, twice the chip's 240 (197
# TFLOP/s over 820 GB/s), so HBM stays ahead of the MXU; a k step of 1024 keeps the
# accumulator's VMEM round trip and the per-step cost small beside 2 GFLOP of work
# (libtpu's LLO for v5e: the fewest loads, stores and packs per MXU push of the
# candidates). The working set (double-buffered panels and output, f32 accumulator)
# is 16 MiB of the 128. benchmarks/tpu_ops_matmul.py --sweep times the alternatives.
V5E_BLOCKS: dict[int, tuple[int, int, int]] = {
    1: (1024, 1024, 1024),  # int8, fp8
    2: (1024, 1024, 1024),  # bf16
    4: (512, 1024, 512),  # f32 (the MXU's multi-pass f32 is compute bound sooner)
}
# Of the chip's VMEM, what the blocks may plan for: Mosaic needs the rest for
# its own temporaries (the dot's result before it is added, masks, relayouts).
VMEM_BUDGET_FRACTION = 0.6
_LANE = 128
_MIN_BLOCK = 256


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def accumulator_dtype(dtype) -> np.dtype:
    """The MXU's accumulator for operands of ``dtype``: int32 for integers, else f32."""
    return np.dtype(np.int32 if jnp.issubdtype(dtype, jnp.integer) else np.float32)


def vmem_bytes(bm, bn, bk, in_dtype, out_dtype, *, scratch: bool) -> int:
    """VMEM a ``(bm, bn, bk)`` program holds: both panels and the output block
    double-buffered, and the f32/int32 accumulator when it is a scratch."""
    panels = 2 * (bm * bk + bk * bn) * _itemsize(in_dtype)
    out = 2 * bm * bn * _itemsize(out_dtype)
    return panels + out + (bm * bn * 4 if scratch else 0)


def vmem_limit(needed: int, info) -> int:
    """The ``vmem_limit_bytes`` for a kernel whose blocks hold ``needed`` bytes:
    room for Mosaic's temporaries on top, never over the chip's VMEM."""
    return int(min(info.vmem_capacity_bytes * 0.9, max(32 << 20, 1.5 * needed + (4 << 20))))


def fit_block(dim: int, want: int, align: int = _LANE) -> int | None:
    """The block for an axis of ``dim`` elements: the whole axis when it is no
    longer than ``want``, else the largest multiple of ``align`` up to ``want``
    that divides ``dim`` (None: there is none, the axis must be padded)."""
    if dim <= want:
        return dim
    for b in range(want - want % align, 0, -align):
        if dim % b == 0:
            return b
    return None


def _rule_blocks(info, in_dtype, out_dtype) -> tuple[int, int, int]:
    """Square tiles big enough that each loaded byte feeds the MXU for longer
    than HBM takes to bring the next one (1.5x the chip's flops per byte), in
    multiples of the MXU's width, shrunk (k first) to fit the VMEM budget."""
    isz = _itemsize(in_dtype)
    ops = info.int8_ops_per_second if isz == 1 and info.int8_ops_per_second else info.bf16_ops_per_second
    flops_per_byte = ops / max(info.mem_bw_bytes_per_second, 1)
    # A (b, b, bk) step does 2*b*b*bk flops on 2*b*bk*isz bytes: b / isz flops per byte.
    b = 2 ** math.ceil(math.log2(max(1.5 * flops_per_byte * isz, _MIN_BLOCK)))
    b = max(min(b, 2048), info.mxu_column_size)
    bk = 512
    budget = VMEM_BUDGET_FRACTION * info.vmem_capacity_bytes
    scratch = _itemsize(out_dtype) < 4
    while vmem_bytes(b, b, bk, in_dtype, out_dtype, scratch=scratch) > budget and b > _MIN_BLOCK:
        if bk > _MIN_BLOCK:
            bk //= 2
        else:
            b //= 2
    return b, b, bk


def choose_blocks(m: int, k: int, n: int, in_dtype, out_dtype, info=None) -> tuple[int, int, int]:
    """``(bm, bk, bn)`` for ``x (m, k) @ y (k, n)`` on the chip ``info``
    (default ``pltpu.get_tpu_info()``): ``V5E_BLOCKS`` on a TPU v5e, the
    chip-facts rule elsewhere, fitted to the problem. A dimension no block
    divides gets a block of 128 multiples (``matmul`` pads it)."""
    info = info or pltpu.get_tpu_info()
    if str(info.chip_version) == "v5e" and _itemsize(in_dtype) in V5E_BLOCKS:
        bm, bn, bk = V5E_BLOCKS[_itemsize(in_dtype)]
    else:
        bm, bn, bk = _rule_blocks(info, in_dtype, out_dtype)
    if info.num_cores > 1 and m <= bm and n > _LANE:
        # Give a megacore chip's second TensorCore a share of the parallel axes.
        bn = max(_LANE, min(bn, (n // 2) // _LANE * _LANE))

    def fitted(dim, want):
        return fit_block(dim, want) or fit_block(-(-dim // _LANE) * _LANE, want)

    bm, bn = fitted(m, bm), fitted(n, bn)
    # Small output tiles (a short m or n) leave VMEM unused: longer k steps
    # then cut the number of grid steps.
    scratch = _itemsize(out_dtype) < 4
    budget = VMEM_BUDGET_FRACTION * info.vmem_capacity_bytes
    if bm * bn < 1024 * 1024:
        while (
            bk < min(k, 2048) and vmem_bytes(bm, bn, 2 * bk, in_dtype, out_dtype, scratch=scratch) <= budget
        ):
            bk *= 2
    return bm, fitted(k, bk), bn


def _check_block(name: str, block: int, dim: int, what: str, align: int) -> None:
    if not isinstance(block, (int, np.integer)) or block <= 0:
        raise ValueError(f"matmul: {name} must be a positive int, got {block!r}")
    if dim % block:
        raise ValueError(
            f"matmul: {name}={block} does not divide {what}={dim}; pick a block that divides it "
            f"(or leave the blocks out: matmul chooses and pads)"
        )
    if block != dim and block % align:
        raise ValueError(
            f"matmul: {name}={block} must be a multiple of {align} (the TPU's tile) or all of {what}={dim}"
        )


def _mxu_operand_dtype(x_dtype, y_dtype, info) -> np.dtype | None:
    """The dtype both panels are widened to in VMEM, or None when the MXU takes them
    as they are. Integers the MXU does not take (a TPU v4's int8) go in as bf16,
    which holds them exactly; each k step's f32 sums stay exact up to 2**24."""
    if x_dtype == y_dtype and info.is_matmul_supported(x_dtype, y_dtype):
        return None
    if max(_itemsize(x_dtype), _itemsize(y_dtype)) <= 2 and info.is_matmul_supported(
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


# How the first k step starts the accumulator: "select" stores its product as it is (the
# accumulator's old value dropped by a select fused into the add: no extra pass, one copy of
# the product's code); "zero" zeroes the tile first and then adds (a whole-tile pass of
# stores: 1030 bundles of a 1024 x 1024 f32 tile on the v5e, 1.6% of a (1024, 1024, 1024)
# step at k / bk = 4, by libtpu's schedule; benchmarks/tpu_gmm_schedule.py).
FIRST_STEP = "select"


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


@functools.partial(jax.jit, static_argnames=["block_shape", "block_k", "out_dtype", "debug", "interpret"])
def matmul(
    x: jax.Array,
    y: jax.Array,
    *,
    block_shape: tuple[int, int] | None = None,
    block_k: int | None = None,
    out_dtype: jax.typing.DTypeLike | None = None,
    debug: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """``x @ y`` as a blocked Pallas TPU kernel.

    Args:
      x: ``(m, k)``: float32, bfloat16, int8 (int32 accumulation) or an fp8 type.
      y: ``(k, n)``, the same dtype as ``x`` unless ``out_dtype`` is given.
      block_shape: ``(bm, bn)``, the output tile; None (JAX's op requires it): chosen
        (``choose_blocks``).
      block_k: the k step; None (JAX's op defaults to 256): chosen with the tile
        (``choose_blocks``; on a TPU v5e 1024 for 16-bit inputs).
      out_dtype: the result's dtype; default ``x``'s dtype (as JAX's op).
      debug: print the kernel's jaxpr and grid mapping.
      interpret: run the kernel in Pallas' interpret mode (any machine).

    Returns:
      ``(m, n)`` in ``out_dtype``; zeros when ``k`` is 0 (an empty sum), an empty array
      when ``m`` or ``n`` is 0 (no kernel runs).

    Raises:
      ValueError: ``x``/``y`` are not matrices with matching k, or a given
        block does not divide its dimension.
      TypeError: the dtypes differ and ``out_dtype`` is None.
    """
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"matmul: x and y must be 2-d, got x{list(x.shape)} and y{list(y.shape)}")
    (m, k), (k2, n) = x.shape, y.shape
    if k != k2:
        raise ValueError(f"matmul: x{list(x.shape)} @ y{list(y.shape)}: x.shape[1]={k} != y.shape[0]={k2}")
    if out_dtype is None:
        if x.dtype != y.dtype:
            raise TypeError(
                f"matmul: cannot deduce the output dtype of {x.dtype} @ {y.dtype}: pass out_dtype"
            )
        out_dtype = x.dtype
    out_dtype = np.dtype(out_dtype)
    for name, dtype in (("x", x.dtype), ("y", y.dtype)):
        if jnp.issubdtype(dtype, jnp.unsignedinteger) or not jnp.issubdtype(dtype, jnp.number):
            raise ValueError(f"matmul: {name} is {dtype}; take float32, bfloat16, fp8 or signed integers")
    info = pltpu.get_tpu_info()
    in_dtype = x.dtype if _itemsize(x.dtype) >= _itemsize(y.dtype) else y.dtype
    acc_dtype = accumulator_dtype(in_dtype)
    if jnp.issubdtype(x.dtype, jnp.integer) != jnp.issubdtype(y.dtype, jnp.integer):
        acc_dtype = np.dtype(np.float32)

    if block_shape is not None:
        if len(block_shape) != 2:
            raise ValueError(f"matmul: block_shape must be (bm, bn), got {block_shape!r}")
        _check_block("block_shape[0]", block_shape[0], m, "x.shape[0]", 8)
        _check_block("block_shape[1]", block_shape[1], n, "y.shape[1]", _LANE)
    if block_k is not None:
        _check_block("block_k", block_k, k, "x.shape[1]", _LANE)
    if 0 in (m, k, n):  # an empty sum is 0: no kernel to run
        return jnp.zeros((m, n), out_dtype)

    chosen_m, chosen_k, chosen_n = choose_blocks(m, k, n, in_dtype, out_dtype, info)
    bm, bn = block_shape if block_shape is not None else (chosen_m, chosen_n)
    if block_k is not None:
        bk = block_k
    else:
        bk = chosen_k if block_shape is None else (fit_block(k, chosen_k) or chosen_k)

    # Chosen blocks that do not divide (a dimension that is not a multiple of
    # 128 and longer than a block) are met by zero padding, cut off afterwards.
    pm, pk, pn = (-(-d // b) * b for d, b in ((m, bm), (k, bk), (n, bn)))
    if (pm, pk) != (m, k):
        x = jnp.pad(x, ((0, pm - m), (0, pk - k)))
    if (pk, pn) != (k, n):
        y = jnp.pad(y, ((0, pk - k), (0, pn - n)))

    in_place = out_dtype == acc_dtype
    widen = _mxu_operand_dtype(x.dtype, y.dtype, info)
    steps_k = pk // bk
    if in_place:
        kernel = functools.partial(_kernel_in_place, widen=widen, steps_k=steps_k)
        scratch = []
    else:
        kernel = functools.partial(_kernel_scratch, widen=widen, steps_k=steps_k)
        scratch = [pltpu.VMEM((bm, bn), acc_dtype)]
    needed = vmem_bytes(bm, bn, bk, in_dtype, out_dtype, scratch=not in_place)
    grid = (pm // bm, pn // bn, pk // bk)
    cost = pl.CostEstimate(
        flops=2 * m * n * k,
        transcendentals=0,
        bytes_accessed=(m * k * grid[1] + k * n * grid[0]) * _itemsize(in_dtype) + m * n * out_dtype.itemsize,
    )
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
            vmem_limit_bytes=vmem_limit(needed, info),
        ),
        cost_estimate=cost,
        debug=debug,
        interpret=interpret,
        name="matmul",
    )(x, y)
    if (pm, pn) != (m, n):
        out = out[:m, :n]
    return out
