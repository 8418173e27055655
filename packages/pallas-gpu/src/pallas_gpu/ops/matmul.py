"""Matrix multiplication ``a @ b`` as a Pallas kernel, configured per shape.

One program computes one ``(block_m, block_n)`` tile of the result: it walks
``k`` in steps of ``block_k`` (a ``fori_loop``, software-pipelined by Triton
over ``num_stages``), accumulating ``jnp.dot`` of the two panels in f32.
Programs are ordered in groups of ``group_m`` block rows ("swizzled"), so the
programs running at once share the panels of ``b`` they read in L2. With
``use_tma`` the panels and the result move through Hopper's TMA (see
``plgpu.CompilerParams``). Edge tiles of any ``m`` and ``n`` are masked; a
``k`` that ``block_k`` does not divide is zero-padded. ``persistent`` configs
launch one program per SM, each walking every ``P``-th tile in the same
grouped order (where the blocks divide ``m`` and ``n``); ``flatten`` makes
their tile loop and k loop one loop, so that Triton's software pipeline runs
on across tiles (the next tile's first panels load while this one's result is
stored), which counts most where k is short.

``matmul(a, b)`` takes its configuration from a table measured on the H200
(``_matmul_table``: the autotuner's pick at common shapes; the nearest row
for other shapes), so a first call costs compile time only; a pick that an
earlier tuning recorded (memory or pallas-gpu's disk cache) takes precedence.
``autotune=True`` times the candidates of ``configs_for`` at the first call
with given shapes and dtypes (``plgpu.autotune``), ``autotune="background"``
times them on a thread of their own and switches to the winner once known;
``config=MatmulConfig(...)`` chooses one. On Hopper (sm_90), 16-bit
products with a result of the same dtype also have the hand-scheduled Gluon
kernels of ``_matmul_sm90`` among the candidates (``Sm90Config``:
warp-specialized, a TMA producer warp, persistent; on the H200 one of them
was the fastest candidate at each bf16 row of ``benchmarks/gpu_matmul.py``). fp8 (``float8_e4m3fn``,
``float8_e5m2``) inputs accumulate in f32 as the others do; their ``b`` is
transposed by XLA to ``(n, k)`` first and the kernel reads ``(block_n,
block_k)`` tiles of it, because Hopper's fp8 tensor-core instructions
(``wgmma``) take both shared-memory tiles k-major (16-bit types may be either
way): an n-major fp8 tile has Triton transpose it in shared memory every k
step. cuBLASLt has the same rule (XLA transposes ``b`` for it too).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import cast

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
from pallas_gpu._src.compile.autotune import autotune
from pallas_gpu._src.language.core import CompilerParams
from pallas_gpu.ops import _matmul_sm90, _matmul_table
from pallas_gpu.ops._common import compute_capability, interpreted, next_power_of_2
from pallas_gpu.ops._matmul_sm90 import Sm90Config as Sm90Config

_FLOAT_INPUTS = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """One launch configuration of ``matmul``."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = True
    persistent: bool = False  # one program per SM, each walking its share of the tiles
    flatten: bool = False  # persistent programs: one loop over (tile, k step) pairs

    def __post_init__(self):
        where = "pallas_gpu.ops.MatmulConfig"
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1 or v & (v - 1):
                raise ValueError(f"{where}: {name} must be a positive power of two, got {v!r}")
        for name in ("group_m", "num_stages"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {v!r}")
        for name in ("use_tma", "persistent", "flatten"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"{where}: {name} must be True or False, got {v!r} ({type(v).__name__})")

    def label(self) -> str:
        kind = ("flat-persistent" if self.flatten else "persistent") if self.persistent else "grid"
        load = "tma" if self.use_tma else "ptr"
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k}/{self.num_warps}w/{self.num_stages}s/{load}/{kind}"
        )

    def fitted(self, m: int, n: int, k: int) -> MatmulConfig:
        """This config with blocks no larger than the (power-of-two padded) problem;
        persistent only where the blocks divide m and n (its tiles are pl.ds slices,
        which clamp at the edges instead of masking)."""

        def fit(b, d):
            return max(16, min(b, next_power_of_2(d)))

        c = dataclasses.replace(
            self, block_m=fit(self.block_m, m), block_n=fit(self.block_n, n), block_k=fit(self.block_k, k)
        )
        if c.persistent and (m % c.block_m or n % c.block_n):
            c = dataclasses.replace(c, persistent=False, flatten=False)
        return c


#: Candidates timed by the autotuner on the first call with a shape; the first is what a CPU
#: run uses. On the H200 at bf16 8192^3 (benchmarks/gpu_matmul.py, one run): persistent
#: 128x256 679 TFLOP/s, persistent 256x128 658, 128x256 with pointer loads 639, 128x128x64
#: 617, 128x128x128 583; the autotuned default 648 (cuBLAS via XLA 701).
CONFIGS = (
    MatmulConfig(128, 256, 64, 8, 8, 3, True, persistent=True),
    MatmulConfig(128, 256, 64, 8, 8, 3, True, persistent=True, flatten=True),
    MatmulConfig(256, 128, 64, 8, 8, 3, True, persistent=True),
    MatmulConfig(128, 256, 64, 8, 8, 3, True),
    MatmulConfig(128, 256, 64, 8, 8, 3, False),
    MatmulConfig(128, 128, 64, 8, 4, 4, True),
    MatmulConfig(128, 128, 128, 8, 8, 3, True),
    MatmulConfig(256, 128, 64, 8, 8, 3, True),
)
#: fp8 candidates: 128-byte rows of k per tile (block_k=128), as the 16-bit ones have with 64.
#: An f32 128x256 result tile passes through 128 KiB of shared memory (the TMA store's
#: staging, or the layout conversion of a pointer store): beside a 3-stage 128x256x128
#: pipeline that is more than sm_90 has, so the flattened candidates (whose pipeline
#: buffers stay live during the store) take 2 stages of 128 or 4 of 64 (224 KiB); the
#: autotuner drops a candidate that does not fit (the first, for an f32 result).
FP8_CONFIGS = (
    MatmulConfig(128, 256, 128, 8, 8, 3, True, persistent=True),
    MatmulConfig(128, 256, 128, 8, 8, 2, False, persistent=True, flatten=True),
    MatmulConfig(128, 256, 64, 8, 8, 4, False, persistent=True, flatten=True),
    MatmulConfig(128, 256, 128, 8, 8, 3, False),
    MatmulConfig(128, 128, 128, 8, 8, 4, True, persistent=True),
    MatmulConfig(128, 128, 128, 8, 8, 4, True),
    MatmulConfig(128, 256, 64, 8, 8, 4, False, persistent=True),
)


def _is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1


def configs_for(
    m: int, n: int, k: int, dtype=jnp.bfloat16, out_dtype=None, cc: int | None = None
) -> tuple[MatmulConfig | Sm90Config, ...]:
    """The distinct candidates for an ``(m, k) @ (k, n)`` problem with inputs of
    ``dtype`` and a result of ``out_dtype`` (default: ``dtype``), compiled for
    compute capability ``cc`` (None: no GPU, the Pallas kernels alone)."""
    pallas = tuple(dict.fromkeys(c.fitted(m, n, k) for c in (FP8_CONFIGS if _is_fp8(dtype) else CONFIGS)))
    if _matmul_sm90.unsupported(m, n, k, dtype, out_dtype or dtype, cc) is None:
        return _matmul_sm90.CONFIGS + pallas
    return pallas


def _table_class(dtype, out_dtype) -> str | None:
    """The ``_matmul_table`` rows that hold for these dtypes: measured with bf16 inputs
    and result ("16-bit", f16 too) and fp8 inputs with an f32 result ("fp8": a 16-bit
    result takes less shared memory). None for f32 inputs or a wider result than 16-bit
    inputs (their tiles take more shared memory: the table's picks may not fit)."""
    dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
    if _is_fp8(dtype):
        return "fp8"
    if dtype.itemsize == 2 and out_dtype.itemsize == 2:
        return "16-bit"
    return None


def table_config(
    m: int, n: int, k: int, dtype, out_dtype, configs: tuple[MatmulConfig | Sm90Config, ...]
) -> MatmulConfig | Sm90Config | None:
    """The configuration of ``_matmul_table`` for an ``(m, k) @ (k, n)`` product
    with inputs of ``dtype`` and a result of ``out_dtype``, among ``configs``
    (``configs_for``'s candidates): the pick of the nearest row of the same
    class (``_table_class``; distance summed over log2 of m, n and k) whose pick
    is a candidate here, fitted to this shape; the first candidate if none is;
    None where the table does not hold (f32 inputs, a 32-bit result of 16-bit ones)."""
    cls = _table_class(dtype, out_dtype)
    if cls is None:
        return None
    bases = _matmul_sm90.CONFIGS + (FP8_CONFIGS if cls == "fp8" else CONFIGS)

    def distance(row):
        return sum(abs(math.log2(a / b)) for a, b in zip(row[1:4], (m, n, k)))

    for _, tm, tn, tk, label, _ in sorted((r for r in _matmul_table.ROWS if r[0] == cls), key=distance):
        for base in bases:
            if isinstance(base, Sm90Config):
                if base.label() == label and base in configs:
                    return base
            elif base.fitted(tm, tn, tk).label() == label and base.fitted(m, n, k) in configs:
                return base.fitted(m, n, k)
    return configs[0]


def _tile(p, nm: int, nn: int, group_m: int):
    """Program ``p`` -> (block row, block col): ``group_m`` block rows at a time,
    column by column inside a group (the last group may have fewer rows)."""
    per_group = group_m * nn
    first = lax.div(p, per_group) * group_m
    rows = jnp.minimum(nm - first, group_m)
    r = lax.rem(p, per_group)
    return first + lax.rem(r, rows), lax.div(r, rows)


def _dot(a, b, b_k_major: bool):
    """f32 ``a @ b`` of an ``(bm, bk)`` tile and a ``(bk, bn)`` tile, or ``(bn, bk)`` if ``b_k_major``."""
    dims = (((1,), (1,)), ((), ())) if b_k_major else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _kernel(a_ref, b_ref, o_ref, *, block_k: int, steps: int, b_k_major: bool):
    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        a = a_ref[:, pl.ds(k0, block_k)]
        b = b_ref[:, pl.ds(k0, block_k)] if b_k_major else b_ref[pl.ds(k0, block_k), :]
        return acc + _dot(a, b, b_k_major)

    acc = lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile_dot(a_ref, b_ref, m0, n0, ki, block_m, block_n, block_k, b_k_major):
    """The f32 product of k step ``ki`` of the output tile at (``m0``, ``n0``) (whole-array Refs)."""
    k0 = pl.multiple_of(ki * block_k, block_k)
    a = a_ref[pl.ds(m0, block_m), pl.ds(k0, block_k)]
    if b_k_major:
        b = b_ref[pl.ds(n0, block_n), pl.ds(k0, block_k)]
    else:
        b = b_ref[pl.ds(k0, block_k), pl.ds(n0, block_n)]
    return _dot(a, b, b_k_major)


def _persistent_kernel(a_ref, b_ref, o_ref, *, block_k, steps, nm, nn, group_m, block_m, block_n, b_k_major):
    """Each program walks tiles ``pid, pid + P, ...`` (``P`` programs, one per SM)."""
    pid, programs = pl.program_id(0), pl.num_programs(0)
    tiles = nm * nn

    def k_step(i, acc, m0, n0):
        return acc + _tile_dot(a_ref, b_ref, m0, n0, i, block_m, block_n, block_k, b_k_major)

    def tile_step(t, carry):
        tile = pid + t * programs

        @pl.when(tile < tiles)
        def _():
            i, j = _tile(tile, nm, nn, group_m)
            m0, n0 = pl.multiple_of(i * block_m, block_m), pl.multiple_of(j * block_n, block_n)
            acc = lax.fori_loop(
                0, steps, functools.partial(k_step, m0=m0, n0=n0), jnp.zeros((block_m, block_n), jnp.float32)
            )
            o_ref[pl.ds(m0, block_m), pl.ds(n0, block_n)] = acc.astype(o_ref.dtype)

        return carry

    lax.fori_loop(0, lax.div(tiles - pid + programs - 1, programs), tile_step, 0)


def _flat_persistent_kernel(
    a_ref, b_ref, o_ref, *, block_k, steps, nm, nn, group_m, block_m, block_n, b_k_major
):
    """``_persistent_kernel`` with one loop over (tile, k step): iteration ``it`` is k step
    ``it % steps`` of the program's tile ``it // steps``; the last k step stores the tile
    and starts the next accumulator from zero."""
    pid, programs = pl.program_id(0), pl.num_programs(0)
    tiles = nm * nn

    def step(it, acc):
        t, ki = lax.div(it, steps), lax.rem(it, steps)
        i, j = _tile(pid + t * programs, nm, nn, group_m)
        m0, n0 = pl.multiple_of(i * block_m, block_m), pl.multiple_of(j * block_n, block_n)
        acc = acc + _tile_dot(a_ref, b_ref, m0, n0, ki, block_m, block_n, block_k, b_k_major)

        def store(acc):
            o_ref[pl.ds(m0, block_m), pl.ds(n0, block_n)] = acc.astype(o_ref.dtype)
            return jnp.zeros_like(acc)

        return lax.cond(ki == steps - 1, store, lambda acc: acc, acc)

    my_tiles = lax.div(tiles - pid + programs - 1, programs)
    lax.fori_loop(0, my_tiles * steps, step, jnp.zeros((block_m, block_n), jnp.float32))


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 where it does not say: an H100/H200)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except RuntimeError:
        return 132


def _check(a, b, preferred_element_type):
    for name, x in (("a", a), ("b", b)):
        if getattr(x, "ndim", None) != 2:
            raise ValueError(f"pallas_gpu.ops.matmul: {name} must be a 2-d array, got shape {jnp.shape(x)}")
        if jnp.dtype(x.dtype).name not in _FLOAT_INPUTS:
            raise TypeError(
                f"pallas_gpu.ops.matmul: {name} has dtype {jnp.dtype(x.dtype).name}; expected one of "
                f"{', '.join(_FLOAT_INPUTS)}"
            )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"pallas_gpu.ops.matmul: a {a.shape} @ b {b.shape}: the inner dimensions differ "
            f"({a.shape[1]} != {b.shape[0]})"
        )
    if a.dtype != b.dtype:
        raise TypeError(
            f"pallas_gpu.ops.matmul: a is {jnp.dtype(a.dtype).name} but b is {jnp.dtype(b.dtype).name}; "
            "cast one so both have the same dtype"
        )
    out = jnp.dtype(preferred_element_type or a.dtype)
    if out.name not in ("float32", "bfloat16", "float16"):
        raise TypeError(
            f"pallas_gpu.ops.matmul: preferred_element_type {out.name} is not supported; use float32, "
            "bfloat16 or float16 (fp8 inputs accumulate in float32)"
        )
    return out


def matmul_with_config(a, b, config: MatmulConfig | Sm90Config, *, out_dtype, interpret=False, debug=False):
    """``a @ b`` with one launch configuration (no tuning)."""
    (m, k), n = a.shape, b.shape[1]
    if isinstance(config, Sm90Config):
        why: str | None
        if interpreted(interpret):
            why = "interpret mode (Triton's interpreter does not run Gluon kernels)"
        else:
            why = _matmul_sm90.unsupported(m, n, k, a.dtype, out_dtype, compute_capability())
        if why is not None:
            raise ValueError(
                f"pallas_gpu.ops.matmul: config={config.label()} is a Hopper Gluon kernel, which cannot "
                f"compute ({m}, {k}) @ ({k}, {n}) here: {why}; pass a MatmulConfig (or config=None)"
            )
        return _matmul_sm90.matmul(a, b, config, debug=debug)
    c = config.fitted(m, n, k)
    if k % c.block_k:  # zero-pad k to whole blocks (zeros add nothing to the dot)
        pad = c.block_k - k % c.block_k
        a, b = jnp.pad(a, ((0, 0), (0, pad))), jnp.pad(b, ((0, pad), (0, 0)))
        k += pad
    nm, nn = pl.cdiv(m, c.block_m), pl.cdiv(n, c.block_n)
    group_m = max(1, min(c.group_m, nm))
    b_k_major = _is_fp8(b.dtype)
    if b_k_major:
        b = b.T  # (n, k): see the module docstring

    def rows(p):
        return _tile(p, nm, nn, group_m)[0], 0

    def cols(p):
        j = _tile(p, nm, nn, group_m)[1]
        return (j, 0) if b_k_major else (0, j)

    kw = {}
    if interpreted(interpret):
        kw["interpret"] = interpret
    params = CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages, use_tma=c.use_tma)
    if c.persistent:
        kernel = functools.partial(
            _flat_persistent_kernel if c.flatten else _persistent_kernel, block_k=c.block_k, steps=k // c.block_k, nm=nm, nn=nn, group_m=group_m,
            block_m=c.block_m, block_n=c.block_n, b_k_major=b_k_major,
        )  # fmt: skip
        whole = [pl.BlockSpec(x.shape, lambda p: (0, 0)) for x in (a, b)]
        return pl.pallas_call(
            kernel,
            jax.ShapeDtypeStruct((m, n), out_dtype),
            grid=(min(nm * nn, num_sms()),),
            in_specs=whole,
            out_specs=pl.BlockSpec((m, n), lambda p: (0, 0)),
            compiler_params=params,
            name="matmul_persistent",
            debug=debug,
            **kw,
        )(a, b)
    return pl.pallas_call(
        functools.partial(_kernel, block_k=c.block_k, steps=k // c.block_k, b_k_major=b_k_major),
        jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(nm * nn,),
        in_specs=[
            pl.BlockSpec((c.block_m, k), rows),
            pl.BlockSpec((c.block_n, k) if b_k_major else (k, c.block_n), cols),
        ],
        out_specs=pl.BlockSpec((c.block_m, c.block_n), lambda p: _tile(p, nm, nn, group_m)),
        compiler_params=params,
        name="matmul",
        debug=debug,
        **kw,
    )(a, b)


def _by_config(a, b, *, config, out_dtype, interpret, debug):
    return matmul_with_config(a, b, config, out_dtype=out_dtype, interpret=interpret, debug=debug)


def _close_to_dot(out, a, b, **_) -> bool:
    """Whether ``out`` is ``a @ b`` to within 2 % of the largest entry (bf16
    rounding of the result is 0.4 %; a miscompiled kernel is off by far more, or NaN)."""
    ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    err = jnp.max(jnp.abs(out.astype(jnp.float32) - ref))
    return bool(err <= 2e-2 * jnp.max(jnp.abs(ref)))  # False for NaN


@functools.cache
def _tuned(configs: tuple[MatmulConfig | Sm90Config, ...]):
    # Batches of 25 ms, not autotune's 2 ms: a big matmul draws the H200 to its power limit
    # (690 W) within milliseconds and its clock falls from 1980 MHz to 1425-1575 MHz under a
    # sustained load, which ranks the candidates differently than short bursts at full clock
    # (benchmarks/matmul_tuning.py, 2026-12-02: at 4096^3 the 2 ms ranking put a candidate
    # first in one pass and last of the four fastest in the next; 25 ms batches and 0.1 s rounds
    # agreed on the leader at 4096^3 and k = 1024).
    return autotune(
        _by_config,
        configs=[dict(config=c) for c in configs],
        name="pallas_gpu.ops.matmul",
        warmup=3,
        repeats=12,
        min_batch_s=0.025,
        check=_close_to_dot,
    )


def _check_config(config, autotune) -> None:
    """``matmul``'s ``config=``: one configuration, which leaves nothing to tune."""
    if isinstance(config, dict):
        raise TypeError(
            f"pallas_gpu.ops.matmul: config must be a MatmulConfig (or an Sm90Config), got a dict {config!r:.80}: "
            "write config=MatmulConfig(**{...})"
        )
    if not isinstance(config, (MatmulConfig, Sm90Config)):
        raise TypeError(
            "pallas_gpu.ops.matmul: config must be a MatmulConfig (or an Sm90Config) or None, got "
            f"{type(config).__name__} {config!r:.80}"
        )
    if autotune is not False:
        raise ValueError(
            f"pallas_gpu.ops.matmul: config={config.label()} chooses one configuration, so there is "
            f"nothing to tune; autotune={autotune!r} needs config=None"
        )


def matmul(
    a,
    b,
    *,
    preferred_element_type=None,
    config: MatmulConfig | Sm90Config | None = None,
    autotune: bool | str = False,
    interpret=False,
    debug=False,
):
    """``a @ b`` for 2-d ``a`` (m, k) and ``b`` (k, n) of one float dtype.

    Args:
      a, b: the operands (float32, bfloat16, float16 or fp8).
      preferred_element_type: the result's dtype (default: the inputs'; fp8
        inputs need float32, bfloat16 or float16). Accumulation is f32.
      config: a ``MatmulConfig`` (or, on an sm_90 GPU, an ``Sm90Config``);
        None: on a GPU, the winner of an earlier tuning at these shapes if one
        is recorded, else ``table_config`` (the H200 table's pick for the
        nearest shape; f32 inputs and 16-bit inputs with an f32 result are
        not in the table and are tuned as with ``autotune=True``); the first
        candidate on a CPU.
      autotune: with ``config=None`` on a GPU, ``False`` (the default): as
        above, no timing; ``True``: time every candidate of ``configs_for(m,
        n, k, ...)`` now, on the first call with these shapes (seconds),
        leaving out one whose output is not close to an f32 XLA dot; the pick
        is kept in memory and on disk; ``"background"``: the table's pick now,
        while the same tuning runs on a thread of its own; calls (and traces)
        after it ends use its winner.
      interpret: ``True`` (pallas-core's interpreter) or
        ``plgpu.InterpretParams()`` (the generated Triton code on the CPU).
    """
    out_dtype = _check(a, b, preferred_element_type)
    if not (
        autotune is True or autotune is False or (isinstance(autotune, str) and autotune == "background")
    ):
        raise ValueError(
            "pallas_gpu.ops.matmul: autotune must be False (the table's configuration, no timing), True "
            f"(time the candidates now) or 'background'; got {autotune!r}"
        )
    if config is not None:
        _check_config(config, autotune)
        return matmul_with_config(a, b, config, out_dtype=out_dtype, interpret=interpret, debug=debug)
    (m, k), n = a.shape, b.shape[1]
    cc = None if interpreted(interpret) else compute_capability()
    configs = configs_for(m, n, k, a.dtype, out_dtype, cc)
    tuned = _tuned(configs)
    kw = dict(out_dtype=out_dtype, interpret=interpret, debug=debug)
    if cc is None or autotune is True or _table_class(a.dtype, out_dtype) is None:
        return tuned(a, b, **kw)  # no GPU, asked to tune, or dtypes the table does not cover: tune now
    known = tuned.recorded_index(a, b, **kw)
    if known is not None:
        return matmul_with_config(a, b, configs[known], **kw)
    if autotune == "background":
        tuned.tune_in_background(a, b, **kw)
    # The table holds for these dtypes (checked above), so it names a config.
    picked = cast("MatmulConfig | Sm90Config", table_config(m, n, k, a.dtype, out_dtype, configs))
    return matmul_with_config(a, b, picked, **kw)
