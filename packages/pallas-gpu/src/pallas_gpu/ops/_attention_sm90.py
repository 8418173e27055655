"""``mha``'s forward on Hopper (sm_90): when the hand-scheduled Gluon kernel
(``_attention_sm90_kernel``) applies, and its launch through the shared
Triton layer and ``jax_kernel_runtime.kernel_call``.

It applies at ``mha``'s default arguments (``block_sizes``, ``num_warps``
and ``num_stages`` None), compiled for a GPU of compute capability 9.0, with
no ``segment_ids``, bf16 or f16 inputs, head_dim 64 or 128, sequence lengths
that are multiples of 128, ``sm_scale > 0`` and a Triton release it was
validated on (``_common.GLUON_VALIDATED_TRITON``: Gluon's API still changes between
releases). Every other call runs the Pallas forward, as does any call with
``block_sizes`` given. The backward is the same either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernel_runtime as jkr
from pallas_gpu.ops._common import (
    GLUON_VALIDATED_TRITON,
    gluon_kernel_config,
    multiprocessor_count,
    triton_release,
)

BLOCK_Q = 128  # two math warpgroups of 64 rows
BLOCK_K = 128
NUM_BUFFERS = 3  # K/V ring slots: 0.947x cuDNN at 3 against 0.824x at 2 (H200, non-causal, first form)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
NAME = "mha_forward_sm90"


def unsupported(q, k, v, segment_ids, sm_scale: float, cc: int | None) -> str | None:
    """Why the sm_90 kernel does not run this forward (None: it does). The
    caller has already checked that the launch is ``mha``'s default."""
    T, D = q.shape[1], q.shape[-1]
    S = k.shape[1]
    if cc != 90:
        return f"compute capability {cc}, not 90"
    if segment_ids is not None:
        return "segment_ids"
    dtypes = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        return f"dtypes {', '.join(sorted(dtypes))}"
    if D not in HEAD_DIMS:
        return f"head_dim {D}"
    if T % BLOCK_Q or S % BLOCK_K:
        return f"sequence lengths {T}, {S} (needs multiples of {BLOCK_Q})"
    if not sm_scale > 0:
        return f"sm_scale {sm_scale}"
    if triton_release() not in GLUON_VALIDATED_TRITON:
        return f"Triton {triton_release()} (validated: {', '.join(GLUON_VALIDATED_TRITON)})"
    return None


def _constexprs(B: int, T: int, S: int, H: int, D: int, causal: bool, nbuf: int, fp8: bool) -> dict:
    """The kernel's constexprs for these sizes (``GH``: ``head_group``'s causal order)."""
    gh = head_group(B * H, T // BLOCK_Q, multiprocessor_count()) if causal else 0
    return {"B": B, "T": T, "S": S, "H": H, "D": D, "BN": BLOCK_K, "NBUF": nbuf, "CAUSAL": causal, "GH": gh,
            "FP8": fp8}  # fmt: skip


@functools.lru_cache(maxsize=64)
def kernel_config(dtype: str, B: int, T: int, S: int, H: int, D: int, causal: bool) -> jkr.KernelConfig:
    """The compiled kernel for these static sizes: from memory, the disk cache
    (pallas-gpu's, ``PALLAS_GPU_CACHE_DIR``), else ``triton.compile``."""
    constexprs = _constexprs(B, T, S, H, D, causal, NUM_BUFFERS, fp8=False)
    ptr = "*bf16" if dtype == "bfloat16" else "*fp16"
    signature = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "LSE": "*fp32", "sm_scale": "fp32"}
    return gluon_kernel_config("pallas_gpu.ops._attention_sm90_kernel", NAME, signature, constexprs)


# The fp8 form of the kernel (``FP8=True``: e4m3 Q, K and V transposed, a 16-bit O), taken by
# ``attention_fp8.mha_fp8`` at its default launch: False until it has run on the H200 (mha_fp8
# then runs the Pallas forward unless asked for this one with ``implementation="gluon"``).
FP8_VALIDATED = False
FP8_NAME = "mha_fp8_forward_sm90"
# K/V ring slots of the fp8 form: its slots are half the bytes of the 16-bit ones (32 KiB of K and
# V at head_dim 128), so more fit (5 take 176 KiB with Q); read when a call is traced.
FP8_NUM_BUFFERS = 4


def fp8_unsupported(q, k, cc: int | None) -> str | None:
    """Why the fp8 form of the sm_90 kernel does not run this ``mha_fp8``
    forward (None: it does)."""
    T, D, S = q.shape[1], q.shape[-1], k.shape[1]
    if cc != 90:
        return f"compute capability {cc}, not 90"
    if D != 128:
        return f"head_dim {D} (the fp8 form takes 128)"
    if T % BLOCK_Q or S % BLOCK_K:
        return f"sequence lengths {T}, {S} (needs multiples of {BLOCK_Q})"
    if triton_release() not in GLUON_VALIDATED_TRITON:
        return f"Triton {triton_release()} (validated: {', '.join(GLUON_VALIDATED_TRITON)})"
    return None


@functools.lru_cache(maxsize=64)
def fp8_kernel_config(
    out_dtype: str, B: int, T: int, S: int, H: int, D: int, causal: bool, nbuf: int = 4
) -> jkr.KernelConfig:
    """``kernel_config`` of the fp8 form (``FP8=True``) with ``nbuf`` K/V slots."""
    constexprs = _constexprs(B, T, S, H, D, causal, nbuf, fp8=True)
    fp8, out = "*fp8e4nv", {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[out_dtype]
    signature = {"Q": fp8, "K": fp8, "V": fp8, "O": out, "LSE": "*fp32", "sm_scale": "*fp32"}
    return gluon_kernel_config("pallas_gpu.ops._attention_sm90_kernel", NAME, signature, constexprs)


def forward_fp8(q8, k8, vt8, scales, causal: bool, out_dtype):
    """(out, log-sum-exp) of e4m3 ``q8``, ``k8`` ``[B, T|S, H, D]`` and ``vt8``
    ``[B, H, D, S]``; ``scales`` f32 (logits' scale, output's scale).
    Batched (``vmap``) calls with unbatched scales fold the batch axes into B."""
    # FP8_NUM_BUFFERS is read here, at every call: the custom_vmap below caches its trace per
    # function object and shapes, so a value read inside it would stay the first one seen.
    return _batched_fp8(bool(causal), jnp.dtype(out_dtype), FP8_NUM_BUFFERS)(q8, k8, vt8, scales)


@functools.cache
def _batched_fp8(causal: bool, out_dtype, nbuf: int):
    @jax.custom_batching.custom_vmap
    def call(q8, k8, vt8, scales):
        return _launch_fp8(q8, k8, vt8, scales, causal, out_dtype, nbuf)

    @call.def_vmap
    def _rule(axis_size, in_batched, q8, k8, vt8, scales):
        if in_batched[3]:
            raise NotImplementedError(
                "mha_fp8 (the sm_90 Gluon kernel) under jax.vmap with scales that differ per batch "
                "element: use implementation='pallas', or one scale per tensor"
            )
        xs = [
            x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip((q8, k8, vt8), in_batched)
        ]
        out, lse = call(*[x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in xs], scales)
        return (out.reshape(axis_size, -1, *out.shape[1:]), lse.reshape(axis_size, -1, *lse.shape[1:])), (
            True,
            True,
        )

    return call


def _launch_fp8(q8, k8, vt8, scales, causal: bool, out_dtype, nbuf: int):
    B, T, H, D = q8.shape
    S = k8.shape[1]
    cfg = fp8_kernel_config(jnp.dtype(out_dtype).name, B, T, S, H, D, bool(causal), nbuf)
    out, lse = jkr.kernel_call(
        q8,
        k8,
        vt8,
        scales,
        configs=[cfg],
        grid=(grid_size(B * H * (T // BLOCK_Q), causal),),
        out_shapes=[jax.ShapeDtypeStruct(q8.shape, out_dtype), jax.ShapeDtypeStruct((B, H, T), np.float32)],
        params=[jkr.Buffer(0), jkr.Buffer(1), jkr.Buffer(2), jkr.Buffer(4), jkr.Buffer(5), jkr.Buffer(3)],
        name=FP8_NAME,
    )
    return out, lse


def forward(q, k, v, sm_scale: float, causal: bool, debug: bool = False):
    """(out, log-sum-exp): ``[B, T, H, D]`` like q and ``[B, H, T]`` f32.
    Batched (``vmap``) calls fold the batch axes into B."""
    if debug:
        print(
            f"mha forward: the sm_90 Gluon kernel {NAME} (pallas_gpu/ops/_attention_sm90_kernel.py), "
            f"block_q {BLOCK_Q}, block_k {BLOCK_K}, {NUM_BUFFERS} K/V buffers, causal={causal}"
        )
    return _batched(float(sm_scale), bool(causal))(q, k, v)


def _launch(q, k, v, sm_scale: float, causal: bool):
    B, T, H, D = q.shape
    S = k.shape[1]
    cfg = kernel_config(jnp.dtype(q.dtype).name, B, T, S, H, D, causal)
    out, lse = jkr.kernel_call(
        q,
        k,
        v,
        configs=[cfg],
        grid=(grid_size(B * H * (T // BLOCK_Q), causal),),
        out_shapes=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), np.float32)],
        params=[jkr.Buffer(i) for i in range(5)] + [jkr.Scalar("fp32", sm_scale)],
        name=NAME,
    )
    return out, lse


def grid_size(tiles: int, causal: bool) -> int:
    """Programs to launch for ``tiles`` tiles of 128 query rows: one
    persistent program per multiprocessor, each taking every grid-th tile, so
    a program's next Q and K/V load while it finishes a tile. Causal tiles
    are unequal work (1 to T / 128 blocks): ``head_group`` orders them so that
    the programs' sums come out even. H200, B4 H32 S4096 D128 causal, torch's
    cuDNN in the same process: 530.4 TFLOP/s (0.998x cuDNN) persistent in
    that order, 499.5 (0.940x) with a program per tile, 509.3 (0.959x)
    persistent in head order; at S1024 (B16) 0.852x, 0.673x and 0.737x."""
    del causal  # both persistent; the causal order is the kernel's GH
    return min(tiles, multiprocessor_count())


def head_group(heads: int, q_tiles: int, programs: int) -> int:
    """The kernel's ``GH`` for a causal launch: tiles are taken heaviest first
    within groups of GH (batch, head) pairs, dealt to the programs in snake
    order. GH is the largest divisor of ``heads`` whose group holds about one
    wave of tiles (``GH * q_tiles <= programs``), so each round of programs
    gets tiles of nearly equal weight."""
    want = max(1, programs // q_tiles)
    return max(g for g in range(1, heads + 1) if heads % g == 0 and g <= want)


@functools.cache
def _batched(sm_scale: float, causal: bool):
    """``_launch`` with a ``vmap`` rule (kernel launches have none): the
    batched axes are moved in front and merged with the batch axis."""

    @jax.custom_batching.custom_vmap
    def call(q, k, v):
        return _launch(q, k, v, sm_scale, causal)

    @call.def_vmap
    def _rule(axis_size, in_batched, q, k, v):
        xs = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip((q, k, v), in_batched)]
        merged = [x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in xs]
        out, lse = call(*merged)
        return (out.reshape(axis_size, -1, *out.shape[1:]), lse.reshape(axis_size, -1, *lse.shape[1:])), (
            True,
            True,
        )

    return call
