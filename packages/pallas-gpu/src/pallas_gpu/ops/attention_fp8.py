"""Flash attention forward on fp8 (``float8_e4m3fn``) queries, keys and values
with per-tensor scales, a 16-bit output: ``mha_fp8``.

The arrays are ``mha``'s (``[batch, seq_len, num_heads, head_dim]``); each of
q, k and v comes with the f32 scale it was quantized with (``quantize``:
``x ~= x8 * scale``). The kernel is ``mha``'s forward with both products on
fp8 tensor cores:

* ``S = Q8 K8^T`` accumulates in f32 and is scaled by ``sm_scale * q_scale *
  k_scale`` (one multiply folded into the base-2 softmax's FMA);
* the unnormalized probabilities ``P`` (in [0, 1]) are rounded to e4m3 for
  ``P V8``, and the row sums use the f32 ``P``, as FlashAttention-3's fp8
  forward does; the output is ``acc * v_scale / l``.

Hopper's fp8 tensor-core instructions read both operands k-major from shared
memory: for ``P V`` the k dimension is the keys, so ``v`` is transposed by
XLA to ``[batch, num_heads, head_dim, seq_len]`` first (as ``ops.matmul``
transposes an fp8 ``b``); a v already in that layout can be passed with
``v_transposed=True``.

Forward only: ``jax.grad`` through ``mha_fp8`` raises (train in 16-bit, serve
in fp8). Segment ids are not taken.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
from pallas_gpu.ops import _attention_sm90
from pallas_gpu.ops._attention_kernels import F32, LOG2E, kv_loop, mask_scores, online_softmax
from pallas_gpu.ops._common import call_params, compute_capability, interpreted
from pallas_gpu.ops.attention import fit_block, program_ids

#: The input type ``mha_fp8`` takes (e4m3: 4 exponent bits, 3 mantissa bits, largest value 448).
FP8 = jnp.float8_e4m3fn

# (block_q, block_k, num_warps, num_stages) per compute capability; others take
# the fallback. fp8 tiles are half the bytes of 16-bit ones.
_MEASURED: dict[int, tuple[int, int, int, int]] = {}
_FALLBACK = (128, 128, 8, 3)


def quantize(x: jax.Array, dtype=FP8) -> tuple[jax.Array, jax.Array]:
    """``(x8, scale)`` with ``x ~= x8.astype(f32) * scale``: per-tensor scaling
    of ``x`` so that its largest magnitude is ``dtype``'s largest finite value
    (``scale`` is a float32 scalar; 1 for an all-zero ``x``)."""
    amax = jnp.max(jnp.abs(x.astype(F32)))
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0).astype(F32)
    return (x.astype(F32) / scale).astype(dtype), scale


@functools.partial(jax.jit, static_argnames=["sm_scale", "causal", "out_dtype"])
def mha_fp8_reference(q, k, v, q_scale, k_scale, v_scale, sm_scale: float = 1.0, causal: bool = False,
                      out_dtype=jnp.bfloat16):  # fmt: skip
    """Plain-JAX attention of the dequantized q, k and v in float32, with
    ``mha_fp8``'s arguments (v in ``[batch, seq_len, num_heads, head_dim]``)."""
    qf, kf, vf = (x.astype(F32) * s for x, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
    logits = jnp.einsum("bqhc,bkhc->bhqk", qf, kf, precision=lax.Precision.HIGHEST) * sm_scale
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bkhc->bqhc", weights, vf, precision=lax.Precision.HIGHEST).astype(out_dtype)


def _fwd_fp8_kernel(scales_ref, q_ref, k_ref, vt_ref, o_ref, lse_ref, *, causal, block_k, nq):
    block_q = q_ref.shape[0]
    qi = nq - 1 - lax.rem(pl.program_id(0), nq)  # heaviest causal blocks first
    scale = scales_ref[0]  # sm_scale * q_scale * k_scale * log2(e)
    q = q_ref[...]

    def body(j, carry, masked):
        m, l, acc = carry
        k0 = pl.multiple_of(j * block_k, block_k)
        k, vt = k_ref[pl.ds(k0, block_k), :], vt_ref[:, pl.ds(k0, block_k)]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)

        def mask(x):
            return mask_scores(x, qi * block_q, k0, None, None, causal)

        m_new, p, alpha = online_softmax(s, m, scale, mask if masked else None)
        pv = lax.dot_general(p.astype(vt.dtype), vt, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    carry = (jnp.full((block_q,), -jnp.inf, F32), jnp.zeros((block_q,), F32), jnp.zeros(q_ref.shape, F32))
    n_k = k_ref.shape[0] // block_k
    lo = (qi * block_q) // block_k
    m, l, acc = kv_loop(body, carry, n_k, lo, pl.cdiv(block_q, block_k), causal, False)
    o_ref[...] = (acc * (scales_ref[1] / l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l)) / LOG2E


def _check(q, k, v, v_transposed, scales, out_dtype) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"mha_fp8: {name} must be rank 4; got {name}{x.shape}")
        if x.dtype != FP8:
            raise TypeError(
                f"mha_fp8: {name} must be float8_e4m3fn (quantize it with pallas_gpu.ops.attention_fp8.quantize); "
                f"got {x.dtype}"
            )
    v_bshd = (v.shape[0], v.shape[3], v.shape[1], v.shape[2]) if v_transposed else v.shape
    if (
        not (q.shape[-1] == k.shape[-1] == v_bshd[-1])
        or k.shape != v_bshd
        or q.shape[0] != k.shape[0]
        or (q.shape[2] != k.shape[2])
    ):
        layout = "[batch, num_heads, head_dim, seq_len] (v_transposed=True)" if v_transposed else "k's shape"
        raise ValueError(
            f"mha_fp8: q [batch, seq_len, num_heads, head_dim], k [batch, seq_len, num_heads, head_dim] and v in "
            f"{layout} must agree in batch, heads and head_dim; got q{q.shape}, k{k.shape}, v{v.shape}"
        )
    for name, s in scales.items():
        if jnp.ndim(s) != 0:
            raise ValueError(
                f"mha_fp8: {name} must be a scalar (a per-tensor scale); got shape {jnp.shape(s)}"
            )
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(F32)):
        raise TypeError(f"mha_fp8: out_dtype must be bfloat16, float16 or float32; got {out_dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17))
def _mha_fp8(q, k, v, q_scale, k_scale, v_scale, sm_scale, causal, out_dtype, v_transposed, block_q, block_k,
             num_warps, num_stages, interpret, debug, return_residuals, implementation):  # fmt: skip
    B, T, H, D = q.shape
    S = k.shape[1]
    vt = v if v_transposed else jnp.transpose(v, (0, 2, 3, 1))  # [B, H, D, S]
    if implementation == "gluon":
        if debug:
            print(f"mha_fp8: the sm_90 Gluon kernel {_attention_sm90.FP8_NAME} (FP8=True), causal={causal}")
        scales = jnp.stack([jnp.asarray(sm_scale, F32) * q_scale * k_scale, jnp.asarray(v_scale, F32)])
        out, lse = _attention_sm90.forward_fp8(q, k, vt, scales, causal, out_dtype)
        return (out, lse) if return_residuals else out
    bq, bk, warps, stages = _MEASURED.get(compute_capability(), _FALLBACK)
    bq = fit_block(bq, T) if block_q is None else block_q  # a block asked for is taken as it is
    bk = fit_block(bk, S) if block_k is None else block_k
    for name, (blk, seq) in {"block_q": (bq, T), "block_k": (bk, S)}.items():
        if seq % blk or blk < 16:
            raise ValueError(f"mha_fp8: {name}={blk} must divide seq_len {seq} and be at least 16")
    if causal and T != S:
        raise ValueError(f"mha_fp8: causal=True needs q and k of the same seq_len; got {T} and {S}")
    nq = T // bq
    b_of, h_of, qi_of = program_ids(nq, H, reverse=True)
    scales = jnp.stack([jnp.asarray(sm_scale * LOG2E, F32) * q_scale * k_scale, jnp.asarray(v_scale, F32)])
    kernel = functools.partial(_fwd_fp8_kernel, causal=causal, block_k=bk, nq=nq)
    out, lse = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct((B, H, T), F32)],
        grid=(B * H * nq,),
        in_specs=[
            pl.BlockSpec((2,), lambda p: (0,)),
            pl.BlockSpec((None, bq, None, D), lambda p: (b_of(p), qi_of(p), h_of(p), 0)),
            pl.BlockSpec((None, S, None, D), lambda p: (b_of(p), 0, h_of(p), 0)),
            pl.BlockSpec((None, None, D, S), lambda p: (b_of(p), h_of(p), 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, D), lambda p: (b_of(p), qi_of(p), h_of(p), 0)),
            pl.BlockSpec((None, None, bq), lambda p: (b_of(p), h_of(p), qi_of(p))),
        ],
        name="mha_fp8_forward",
        debug=debug,
        **call_params(interpret, num_warps or warps, num_stages if num_stages is not None else stages),
    )(scales, q, k, vt)
    return (out, lse) if return_residuals else out


def _mha_fp8_fwd(q, k, v, q_scale, k_scale, v_scale, *static):
    return _mha_fp8(q, k, v, q_scale, k_scale, v_scale, *static), None


def _mha_fp8_bwd(*args):
    raise NotImplementedError(
        "mha_fp8 is a forward (inference) kernel and has no backward pass: differentiate "
        "pallas_gpu.ops.attention.mha on 16-bit inputs instead"
    )


_mha_fp8.defvjp(_mha_fp8_fwd, _mha_fp8_bwd)


def mha_fp8(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_scale: jax.Array | float,
    k_scale: jax.Array | float,
    v_scale: jax.Array | float,
    *,
    sm_scale: float = 1.0,
    causal: bool = False,
    out_dtype: Any = jnp.bfloat16,
    v_transposed: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: Any = False,
    debug: bool = False,
    return_residuals: bool = False,
    implementation: str | None = None,
):
    """Attention ``softmax(q k^T * sm_scale) v`` of fp8 e4m3 ``q``, ``k``, ``v``
    (``[batch, seq_len, num_heads, head_dim]``; v ``[batch, num_heads,
    head_dim, seq_len]`` with ``v_transposed``) whose real values are ``x8 *
    x_scale`` (``quantize``), in ``out_dtype`` (bf16 by default). With
    ``return_residuals`` it also returns the natural log-sum-exp of each row,
    ``[batch, num_heads, seq_len]`` f32. ``block_q``, ``block_k``,
    ``num_warps`` and ``num_stages`` left at None take the launch measured on
    this GPU. ``interpret``: as ``mha``'s.

    ``implementation``: ``"pallas"`` (the Pallas forward), ``"gluon"`` (the
    Hopper Gluon kernel of ``mha``'s forward in its fp8 form: sm_90, head_dim
    128, sequence lengths multiples of 128, ``sm_scale > 0``, the default
    launch), or None: the Gluon kernel where it applies and has been validated
    on the H200 (``_attention_sm90.FP8_VALIDATED``), else the Pallas one."""
    scales = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
    _check(q, k, v, v_transposed, scales, out_dtype)
    implementation = _implementation(implementation, q, k, sm_scale, block_q, block_k, num_warps, num_stages,
                                     interpret)  # fmt: skip
    if interpreted(interpret) and num_stages is None:
        num_stages = 1
    q_scale, k_scale, v_scale = (jnp.asarray(s, F32) for s in scales.values())
    return _mha_fp8(q, k, v, q_scale, k_scale, v_scale, float(sm_scale), bool(causal), jnp.dtype(out_dtype),
                    bool(v_transposed), block_q, block_k, num_warps, num_stages, interpret, debug,
                    bool(return_residuals), implementation)  # fmt: skip


def _implementation(asked, q, k, sm_scale, block_q, block_k, num_warps, num_stages, interpret) -> str:
    """ "gluon" or "pallas" for ``mha_fp8``'s ``implementation`` argument."""
    if asked not in (None, "pallas", "gluon"):
        raise ValueError(f"mha_fp8: implementation must be None, 'pallas' or 'gluon'; got {asked!r}")
    if asked == "pallas":
        return "pallas"
    default = block_q is None and block_k is None and num_warps is None and num_stages is None
    why = None
    if interpreted(interpret):
        why = "interpret mode (Triton's interpreter does not run Gluon)"
    elif not default:
        why = "a launch was given (block_q, block_k, num_warps or num_stages)"
    elif not sm_scale > 0:
        why = f"sm_scale {sm_scale}"
    else:
        why = _attention_sm90.fp8_unsupported(q, k, compute_capability())
    if asked == "gluon":
        if why is not None:
            raise ValueError(f"mha_fp8: implementation='gluon' does not apply here: {why}")
        return "gluon"
    return "gluon" if why is None and _attention_sm90.FP8_VALIDATED else "pallas"
