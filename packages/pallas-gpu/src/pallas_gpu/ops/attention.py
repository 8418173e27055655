"""Flash attention, forward and backward, as Pallas kernels for GPUs.

The API is that of JAX's Pallas GPU op ``attention``
(``mha``, ``mha_reference``, ``BlockSizes``, ``segment_mask``), so moving over
is an import change. Arrays are ``[batch, seq_len, num_heads, head_dim]``.

* Forward: one program per (batch, head, block of queries), heaviest causal
  blocks first. It walks the keys one block at a time keeping the running max
  and denominator of the softmax ("online softmax", in base 2); with
  ``causal=True`` only the blocks on the diagonal are masked, the blocks left
  of it run unmasked and the blocks right of it are skipped. It also writes
  the log-sum-exp of every row, the residual of the backward pass.
* On Hopper (sm_90) at the default arguments the forward is a hand-scheduled
  Gluon kernel instead (``_attention_sm90``: ping-ponging math warpgroups
  and a TMA producer warp) where it applies (``sm90_forward_applies``).
* Backward (``backward_pass_impl="triton"``): ``delta = sum(out * dout)`` per
  row (XLA), then one kernel per block of keys that loops over the queries
  (dk, dv) and one per block of queries that loops over the keys (dq), both
  recomputing the probabilities from the saved log-sum-exp.
  ``backward_pass_impl="xla"`` differentiates ``mha_reference`` instead.
  The dk/dv kernel runs with one pipeline stage whatever ``num_stages`` says,
  but at the default launches measured exact with more (``_DKV_PIPELINED``).

The kernel bodies live in ``_attention_kernels``; this module checks the
arguments, picks the launches and builds the calls.

Launches: with ``block_sizes``, ``num_warps`` and ``num_stages`` at None
(the defaults) each kernel takes its own from ``_MEASURED`` (per compute
capability and head_dim, timed on the H200) or ``_FALLBACK``
(``default_launches``).

``interpret`` takes ``True`` (pallas-core's interpreter) or
``pallas_gpu.InterpretParams()`` (the generated Triton kernel under Triton's
interpreter), so the kernels run on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import pallas as pl
from pallas_gpu.ops import _attention_sm90
from pallas_gpu.ops._attention_kernels import F32, dkv_kernel, dq_kernel, fwd_kernel
from pallas_gpu.ops._attention_kernels import LOG2E as LOG2E
from pallas_gpu.ops._common import call_params, interpreted
from pallas_gpu.ops._common import compute_capability as compute_capability


@dataclasses.dataclass(frozen=True, slots=True)
class BlockSizes:
    """Tile sizes of the kernels: queries and keys per block in the forward
    kernel (``block_q``, ``block_k``), in the dk/dv kernel (``block_q_dkv``,
    ``block_kv_dkv``) and in the dq kernel (``block_q_dq``, ``block_kv_dq``).
    They change speed, not results. A backward block left at None takes the
    forward one."""

    block_q: int
    block_k: int
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None

    @classmethod
    def get_default(cls) -> BlockSizes:
        return BlockSizes(
            block_q=128, block_k=128, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
        )

    @property
    def has_backward_blocks(self) -> bool:
        return None not in (self.block_q_dkv, self.block_kv_dkv, self.block_q_dq, self.block_kv_dq)


def segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array) -> jax.Array:
    """``[..., T, S]`` booleans: query t may attend to key s (same segment)."""
    q = jnp.expand_dims(q_segment_ids, axis=-1)
    kv = jnp.expand_dims(kv_segment_ids, axis=0 if kv_segment_ids.ndim == 1 else 1)
    return jnp.equal(q, kv)


@functools.partial(jax.jit, static_argnames=["sm_scale", "causal"])
def mha_reference(q, k, v, segment_ids, sm_scale=1.0, causal: bool = False):
    """Plain-JAX attention with the same arguments and layout as ``mha``."""
    logits = jnp.einsum("bqhc,bkhc->bhqk", q, k, preferred_element_type=F32)
    mask = None
    if segment_ids is not None:
        mask = jnp.broadcast_to(segment_mask(segment_ids, segment_ids)[:, None], logits.shape)
    if causal:
        tri = jnp.broadcast_to(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits.shape)
        mask = tri if mask is None else mask & tri
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits * sm_scale)
    return jnp.einsum("bhqk,bkhc->bqhc", weights, v, preferred_element_type=F32).astype(q.dtype)


# ---------------------------------------------------------------------------
# Checks and launch helpers


def _check(q, k, v, segment_ids, causal: bool, blocks: dict[str, tuple[int, int]]) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"mha: q, k and v must be [batch, seq_len, num_heads, head_dim]; got q{q.shape}, k{k.shape}, v{v.shape}"
        )
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(
            f"mha: q, k and v must have the same head_dim; got q{q.shape}, k{k.shape}, v{v.shape}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"mha: k and v must have the same shape, and the batch and head counts of q; "
            f"got q{q.shape}, k{k.shape}, v{v.shape}"
        )
    if (causal or segment_ids is not None) and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"mha: causal=True and segment_ids need q and k of the same seq_len; got {q.shape[1]} and {k.shape[1]}"
        )
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(
            f"mha: segment_ids must be [batch, seq_len] = {q.shape[:2]}; got {segment_ids.shape}"
        )
    for name, (block, seq) in blocks.items():
        if seq % block:
            raise ValueError(
                f"mha: seq_len {seq} is not a multiple of BlockSizes.{name}={block}; "
                f"pick a block size that divides it"
            )
        if block < 16:
            raise ValueError(
                f"mha: BlockSizes.{name}={block} is below 16, the smallest block Triton's dot takes"
            )


def _blocks(bs: BlockSizes, T: int, S: int) -> dict[str, int]:
    """Every block size of ``bs``, capped at its sequence length (``T``
    queries, ``S`` keys); a backward block left at None takes the forward one."""
    q, kv = (lambda b: min(b, T)), (lambda b: min(b, S))
    return {
        "block_q": q(bs.block_q),
        "block_k": kv(bs.block_k),
        "block_q_dkv": q(bs.block_q_dkv or bs.block_q),
        "block_kv_dkv": kv(bs.block_kv_dkv or bs.block_k),
        "block_q_dq": q(bs.block_q_dq or bs.block_q),
        "block_kv_dq": kv(bs.block_kv_dq or bs.block_k),
    }


# Default launches, {kernel: (block_q, block_k, num_warps, num_stages)}, per
# (compute capability, head_dim), measured on the H200 with jax 0.11.2 and
# Triton 3.6.0 (benchmarks/gpu_attention.py --tune: bf16, B4 H32 S4096 causal,
# each kernel timed alone over a grid of launches). Fastest there, in ms:
# fwd 1.301 (128x128, 8 warps, 3 stages; 1.554 at 2 stages; non-causal 2.389
# and 2.611; 64x64, 4 warps, 3 stages timed 1.226 and 2.345 alone but ran the
# non-causal default row at 447 TFLOP/s against 466 for 128x128), dk/dv 2.564
# (64x64, 4 warps, 1 stage; 4.592 at the 32x128, 8 warps of FlashAttention-2's
# shapes; see _DKV_PIPELINED for its stages), dq 1.663 (64x64, 4 warps, 2 stages; 1.665 at 128x32, 8 warps, 3).
# Keyed by (compute capability, head_dim); looked up with None for the capability without a GPU.
_MEASURED: dict[tuple[int | None, int], dict[str, tuple[int, int, int, int]]] = {
    (90, 128): {"fwd": (128, 128, 8, 3), "dkv": (64, 64, 4, 1), "dq": (64, 64, 4, 2)},
}
# Other GPUs and head dims (keyed by the largest head_dim each serves): the
# H200's tiles, which fit the 100-164 KiB of shared memory of sm_80/sm_86/sm_89
# (the 64x64 forward at 3 stages takes about 64 KiB at head_dim 128).
_FALLBACK: dict[int, dict[str, tuple[int, int, int, int]]] = {
    64: {"fwd": (128, 64, 4, 3), "dkv": (64, 64, 4, 1), "dq": (64, 64, 4, 2)},
    128: {"fwd": (64, 64, 4, 3), "dkv": (64, 64, 4, 1), "dq": (64, 64, 4, 2)},
    1 << 30: {"fwd": (64, 64, 8, 2), "dkv": (32, 64, 8, 1), "dq": (64, 32, 8, 2)},
}


def default_launches(head_dim: int, cc: int | None) -> dict[str, tuple[int, int, int, int]]:
    """``mha``'s launch of each kernel ("fwd", "dkv", "dq") at its default
    arguments: ``(block_q, block_k, num_warps, num_stages)`` measured on this
    compute capability and head_dim where the table has them, else sized to
    head_dim. Blocks are then capped at (and halved to divide) the sequence
    lengths."""
    if (cc, head_dim) in _MEASURED:
        return dict(_MEASURED[cc, head_dim])
    return dict(_FALLBACK[min(d for d in _FALLBACK if d >= head_dim)])


def fit_block(block: int, seq: int) -> int:
    """``block`` capped at ``seq`` and halved (down to 16) until it divides ``seq``."""
    block = min(block, seq)
    while block > 16 and seq % block:
        block //= 2
    return block


# ---------------------------------------------------------------------------
# Forward


def program_ids(n_blocks: int, heads: int, reverse: bool):
    """Maps the 1-D program id to (batch, head, block): the blocks of one head
    are adjacent (its K/V stay in L2); ``reverse`` runs the last block first
    (the heaviest one of causal attention)."""

    def b_of(p):
        return lax.div(lax.div(p, n_blocks), heads)

    def h_of(p):
        return lax.rem(lax.div(p, n_blocks), heads)

    def blk_of(p):
        r = lax.rem(p, n_blocks)
        return n_blocks - 1 - r if reverse else r

    return b_of, h_of, blk_of


def _specs_2d(b_of, h_of, blk_of, block, seq_dim_full, head_dim):
    """(BlockSpec of a block of rows, BlockSpec of all rows) of one (b, h)."""
    rows = pl.BlockSpec((None, block, None, head_dim), lambda p: (b_of(p), blk_of(p), h_of(p), 0))
    full = pl.BlockSpec((None, seq_dim_full, None, head_dim), lambda p: (b_of(p), 0, h_of(p), 0))
    return rows, full


def _segment_specs(b_of, blk_of, block, seq_len, kv_side: bool) -> list:
    """The BlockSpecs of the query and key segment ids (in that order) of a program that owns
    the ``blk_of`` block of ``block`` queries (``kv_side``: keys) and sweeps all ``seq_len`` of
    the other side."""
    own = pl.BlockSpec((None, block), lambda p: (b_of(p), blk_of(p)))
    full = pl.BlockSpec((None, seq_len), lambda p: (b_of(p), 0))
    return [full, own] if kv_side else [own, full]


def _launch(kernel, out_shape, programs, in_specs, out_specs, name, debug, interpret, num_warps, num_stages):
    """``pl.pallas_call`` of one of mha's kernels over a 1-D grid of ``programs``."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(programs,),
        in_specs=in_specs,
        out_specs=out_specs,
        name=name,
        debug=debug,
        **call_params(interpret, num_warps, num_stages),
    )


def _forward(
    q, k, v, segment_ids, sm_scale, causal, block_q, block_k, num_warps, num_stages, interpret, debug
):
    B, T, H, D = q.shape
    S = k.shape[1]
    nq = T // block_q
    b_of, h_of, qi_of = program_ids(nq, H, reverse=True)
    q_spec, kv_spec = _specs_2d(b_of, h_of, qi_of, block_q, S, D)
    in_specs, args = [q_spec, kv_spec, kv_spec], [q, k, v]
    if segment_ids is not None:
        in_specs += _segment_specs(b_of, qi_of, block_q, S, kv_side=False)
        args += [segment_ids, segment_ids]
    lse_spec = pl.BlockSpec((None, None, block_q), lambda p: (b_of(p), h_of(p), qi_of(p)))
    kernel = functools.partial(
        fwd_kernel if segment_ids is not None else _no_segments(fwd_kernel, 3),
        scale=sm_scale * LOG2E,
        causal=causal,
        block_k=block_k,
        nq=nq,
    )
    out_shape = [q, jax.ShapeDtypeStruct((B, H, T), F32)]
    out, lse = _launch(kernel, out_shape, B * H * nq, in_specs, [q_spec, lse_spec], "mha_forward",
                       debug, interpret, num_warps, num_stages)(*args)  # fmt: skip
    return out, lse


def _no_segments(kernel, at: int):
    """``kernel`` with None for its two segment-id refs, which start at
    position ``at`` of its Ref arguments."""

    def wrapped(*refs, **kw):
        return kernel(*refs[:at], None, None, *refs[at:], **kw)

    return wrapped


# ---------------------------------------------------------------------------
# Backward


def _backward_part(kv_side: bool, q, k, v, segment_ids, do, lse2, delta, sm_scale, causal, block_q, block_k,
                   num_warps, num_stages, interpret, debug):  # fmt: skip
    """dk, dv (``kv_side``): one program per (b, h, key block), looping over the query blocks
    that see it; or dq: one program per (b, h, query block), looping over the key blocks it
    sees. ``lse2`` is the log-sum-exp in base 2, ``delta`` is ``sum(out * do)`` per row, both
    ``[batch, heads, seq]`` f32."""
    B, T, H, D = q.shape
    S = k.shape[1]
    block, own_len, other_len = (block_k, S, T) if kv_side else (block_q, T, S)
    n = own_len // block
    b_of, h_of, blk_of = program_ids(n, H, reverse=not kv_side)
    own_rows, other_full = _specs_2d(b_of, h_of, blk_of, block, other_len, D)
    if kv_side:  # every query row's statistics
        stats = pl.BlockSpec((None, None, T), lambda p: (b_of(p), h_of(p), 0))
        q_spec, kv_spec = other_full, own_rows
    else:  # the block's rows' statistics
        stats = pl.BlockSpec((None, None, block_q), lambda p: (b_of(p), h_of(p), blk_of(p)))
        q_spec, kv_spec = own_rows, other_full
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, stats, stats]
    args = [q, k, v, do, lse2, delta]
    if segment_ids is not None:
        in_specs += _segment_specs(b_of, blk_of, block, other_len, kv_side)
        args += [segment_ids, segment_ids]
    body = dkv_kernel if kv_side else dq_kernel
    sizes = dict(block_q=block_q, nk=n) if kv_side else dict(block_k=block_k, nq=n)
    kernel = functools.partial(body if segment_ids is not None else _no_segments(body, 6), scale=sm_scale * LOG2E,
                               sm_scale=sm_scale, causal=causal, **sizes)  # fmt: skip
    if kv_side:
        # num_stages is 1 but for launches measured exact with more (_dkv_stages).
        return _launch(kernel, [k, v], B * H * n, in_specs, [kv_spec, kv_spec], "mha_backward_dkv", debug,
                       interpret, num_warps, num_stages)(*args)  # fmt: skip
    return _launch(kernel, q, B * H * n, in_specs, q_spec, "mha_backward_dq", debug, interpret, num_warps,
                   num_stages)(*args)  # fmt: skip


_backward_dkv = functools.partial(_backward_part, True)
_backward_dq = functools.partial(_backward_part, False)


def _backward(q, k, v, segment_ids, out, lse, do, sm_scale, causal, launches, interpret, debug):
    delta = jnp.einsum("bthd,bthd->bht", out.astype(F32), do.astype(F32))
    lse2 = lse * LOG2E
    bq, bk, warps, stages = launches["dkv"]
    dk, dv = _backward_dkv(q, k, v, segment_ids, do, lse2, delta, sm_scale, causal, bq, bk, warps, stages,
                           interpret, debug)  # fmt: skip
    bq, bk, warps, stages = launches["dq"]
    dq = _backward_dq(q, k, v, segment_ids, do, lse2, delta, sm_scale, causal, bq, bk, warps, stages, interpret,
                      debug)  # fmt: skip
    return dq, dk, dv


# ---------------------------------------------------------------------------
# The public function


_STATIC = ["sm_scale", "causal", "block_sizes", "backward_pass_impl", "num_warps", "num_stages", "grid",
           "interpret", "debug", "return_residuals"]  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=list(range(4, 14)))
@functools.partial(jax.jit, static_argnames=_STATIC)
def mha(
    q,
    k,
    v,
    segment_ids: jax.Array | None,
    sm_scale: float = 1.0,
    causal: bool = False,
    block_sizes: BlockSizes | None = None,
    backward_pass_impl: str = "triton",
    num_warps: int | None = None,
    num_stages: int | None = None,
    grid: tuple[int, ...] | None = None,
    interpret: Any = False,
    debug: bool = False,
    return_residuals: bool = False,
):
    """Multi-head attention ``softmax(q k^T * sm_scale) v`` on
    ``[batch, seq_len, num_heads, head_dim]`` arrays, differentiable in q, k
    and v. ``segment_ids`` (``[batch, seq_len]`` ints, or None) lets a query
    attend only to keys of its own segment. With ``return_residuals`` it also
    returns the log-sum-exp of each row, ``[batch, num_heads, seq_len]`` f32.

    ``block_sizes``, ``num_warps`` and ``num_stages`` left at None take, for
    each kernel (forward, dk/dv, dq), the launch measured fastest on this GPU
    (``default_launches``); given, they apply as in JAX's ``mha`` (one
    ``num_warps`` and ``num_stages`` for every kernel, ``num_stages`` 2 when
    only ``block_sizes`` is given). The dk/dv kernel runs one stage but at the
    default launches measured exact with more (``_DKV_PIPELINED``).
    """
    out, lse = _mha_fwd_impl(q, k, v, segment_ids, sm_scale, causal, block_sizes, backward_pass_impl,
                             num_warps, num_stages, grid, interpret, debug)  # fmt: skip
    return (out, lse) if return_residuals else out


def _launches(q, k, block_sizes, num_warps, num_stages, interpret, causal, segment_ids):
    """{kernel: (block_q, block_k, num_warps, num_stages)} for "fwd", "dkv", "dq", checked."""
    T, S, D = q.shape[1], k.shape[1], q.shape[-1]
    if block_sizes is None:
        table = default_launches(D, None if interpreted(interpret) else compute_capability())
        launches = {
            kern: (
                fit_block(bq, T),
                fit_block(bk, S),
                num_warps or w,
                st if num_stages is None else num_stages,
            )
            for kern, (bq, bk, w, st) in table.items()
        }
    else:
        b = _blocks(block_sizes, T, S)
        w = num_warps if num_warps is not None else (4 if D <= 64 else 8)
        st = 2 if num_stages is None else num_stages
        launches = {
            "fwd": (b["block_q"], b["block_k"], w, st),
            "dkv": (b["block_q_dkv"], b["block_kv_dkv"], w, st),
            "dq": (b["block_q_dq"], b["block_kv_dq"], w, st),
        }
    launches["dkv"] = (*launches["dkv"][:3], _dkv_stages(launches["dkv"], D, interpret, block_sizes, num_warps,
                                                         num_stages))  # fmt: skip
    names = {"fwd": ("block_q", "block_k"), "dkv": ("block_q_dkv", "block_kv_dkv"),
             "dq": ("block_q_dq", "block_kv_dq")}  # fmt: skip
    blocks = {}
    for kern, (nq, nk) in names.items():
        blocks[nq], blocks[nk] = (launches[kern][0], T), (launches[kern][1], S)
    _check(q, k, k, segment_ids, causal, blocks)
    return launches


# dk/dv launches (block_q, block_k, num_warps, num_stages) that may pipeline: with Triton
# 3.6 on the H200 the dk/dv kernel's dk came out wrong at num_stages 2 and 3 with 32x128
# blocks and 8 warps (relative error 0.26 and 0.38; dq, dv exact; test_mha_backward_large_on_gpu
# keeps that launch), while the default 64x64, 4-warp launch was exact at 1, 2 and 3 stages
# (relative error of dk 0.0053 causal, 0.0046 not, at B2 S2048 H4 D128, the same at every
# count: test_mha_default_launches_on_gpu's size) and forward + backward causal at B4
# S4096 H32 D128 ran 336.2 / 366.2 / 332.5 TFLOP/s at 1 / 2 / 3 stages
# (benchmarks/attention_dkv_stages.py). Every other launch, and any launch a user
# configures, runs one stage.
_DKV_PIPELINED: dict[tuple[int | None, int], tuple[int, int, int, int]] = {(90, 128): (64, 64, 4, 2)}


def _dkv_stages(launch, head_dim, interpret, block_sizes, num_warps, num_stages) -> int:
    if block_sizes is not None or num_warps is not None or num_stages is not None or interpreted(interpret):
        return 1
    measured = _DKV_PIPELINED.get((compute_capability(), head_dim))
    return measured[3] if measured is not None and tuple(launch[:3]) == measured[:3] else 1


def sm90_forward_applies(
    q, k, v, segment_ids, sm_scale, block_sizes, num_warps, num_stages, interpret
) -> bool:
    """Whether ``mha``'s forward runs the Hopper Gluon kernel
    (``_attention_sm90``) rather than the Pallas one: default arguments on an
    sm_90 GPU, and shapes, dtypes and a Triton release it supports."""
    if block_sizes is not None or num_warps is not None or num_stages is not None or interpreted(interpret):
        return False
    return _attention_sm90.unsupported(q, k, v, segment_ids, sm_scale, compute_capability()) is None


def _mha_fwd_impl(q, k, v, segment_ids, sm_scale, causal, block_sizes, backward_pass_impl, num_warps,
                  num_stages, grid, interpret, debug):  # fmt: skip
    if grid is not None:
        raise NotImplementedError("mha: grid= is chosen by pallas_gpu's kernels; pass grid=None")
    if backward_pass_impl not in ("triton", "xla"):
        raise ValueError(f"mha: backward_pass_impl must be 'triton' or 'xla', got {backward_pass_impl!r}")
    _check(q, k, v, segment_ids, causal, {})
    if sm90_forward_applies(q, k, v, segment_ids, sm_scale, block_sizes, num_warps, num_stages, interpret):
        return _attention_sm90.forward(q, k, v, sm_scale, causal, debug)
    bq, bk, warps, stages = _launches(q, k, block_sizes, num_warps, num_stages, interpret, causal,
                                      segment_ids)["fwd"]  # fmt: skip
    return _forward(q, k, v, segment_ids, sm_scale, causal, bq, bk, warps, stages, interpret, debug)


def _mha_fwd(q, k, v, segment_ids, sm_scale, causal, block_sizes, backward_pass_impl, num_warps, num_stages,
             grid, interpret, debug, return_residuals):  # fmt: skip
    out, lse = _mha_fwd_impl(q, k, v, segment_ids, sm_scale, causal, block_sizes, backward_pass_impl,
                             num_warps, num_stages, grid, interpret, debug)  # fmt: skip
    return ((out, lse) if return_residuals else out), (q, k, v, segment_ids, out, lse)


def _mha_bwd(sm_scale, causal, block_sizes, backward_pass_impl, num_warps, num_stages, grid, interpret, debug,
             return_residuals, res, g):  # fmt: skip
    q, k, v, segment_ids, out, lse = res
    do = g[0] if return_residuals else g  # the cotangent of the log-sum-exp is not propagated
    if backward_pass_impl == "xla":
        _, vjp = jax.vjp(
            functools.partial(mha_reference, sm_scale=sm_scale, causal=causal), q, k, v, segment_ids
        )
        dq, dk, dv, _ = vjp(do)
        return dq, dk, dv, None
    launches = _launches(q, k, block_sizes, num_warps, num_stages, interpret, causal, segment_ids)
    dq, dk, dv = _backward(q, k, v, segment_ids, out, lse, do, sm_scale, causal, launches, interpret, debug)
    return dq, dk, dv, None


mha.defvjp(_mha_fwd, _mha_bwd)
