"""Splash (sparse flash) attention: ``make_splash_mha`` / ``make_splash_mqa`` build a kernel
object for a static mask, called as ``kernel(q, k, v, segment_ids=None, sinks=None)`` on one
sequence (``q [heads, q_len, head_dim]``; ``vmap`` it over a batch), with the names and call
signatures of JAX's ``ops.tpu`` splash attention.

The mask is turned into schedules of its non-empty blocks when the kernel is made
(``splash_attention_mask_info``); the forward kernel (``_forward``) and the backward kernels
(``_backward``: ``dq`` query-major, ``dk``/``dv`` key-major) visit only those blocks. The
kernel object is a pytree whose leaves are the schedules, so it passes through ``jit`` and,
with ``manual_sharding_spec``, through ``shard_map`` over heads and query shards.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union, cast

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tpu as pltpu
from pallas_tpu.ops import _policy
from pallas_tpu.ops.splash_attention import _backward, _common, _forward
from pallas_tpu.ops.splash_attention import splash_attention_mask as mask_lib
from pallas_tpu.ops.splash_attention import splash_attention_mask_info as mask_info_lib
from pallas_tpu.ops.splash_attention._blocks import BlockSizes as BlockSizes
from pallas_tpu.ops.splash_attention._blocks import QKVLayout as QKVLayout
from pallas_tpu.ops.splash_attention._blocks import (
    _check_blocks,
    _complete,
    _itemsize,
    _shrink,
    default_blocks,
    fit_block,
)
from pallas_tpu.ops.splash_attention._blocks import from_head_minor as from_head_minor
from pallas_tpu.ops.splash_attention._reference import (
    attention_reference as attention_reference,
)
from pallas_tpu.ops.splash_attention._reference import (
    attention_reference_custom as attention_reference_custom,
)
from pallas_tpu.ops.splash_attention._reference import (
    make_attention_reference as make_attention_reference,
)

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)
NUM_LANES = 128
NUM_SUBLANES = 8
NN_DIM_NUMBERS = (((1,), (0,)), ((), ()))  # a @ b
NT_DIM_NUMBERS = (((1,), (1,)), ((), ()))  # a @ b.T
_OP = "splash attention"

make_masked_mha_reference = functools.partial(make_attention_reference, is_mqa=False)
make_masked_mqa_reference = functools.partial(make_attention_reference, is_mqa=True)


class SegmentIds(NamedTuple):
    """Segment ids of the query and key sequences: a query attends only to keys of its own
    segment (and-ed with the mask). A query row that nothing is left visible to has no softmax:
    its output is zeros and it passes no gradient (JAX's kernels give the mean of ``v`` there
    when the mask hides the row within a block it computes).

    Attributes:
      q: ``[q_seq_len]`` segment ids of the queries: integers (floats are compared as given,
        in float32).
      kv: ``[kv_seq_len]`` segment ids of the keys and values, likewise.
    """

    q: jax.Array
    kv: jax.Array


# ---------------------------------------------------------------------------------------------
# The kernel object.


# JAX's type names of the kernel's pieces.
MaskFunctionType = Callable[..., jax.Array]
# What the custom-vjp attention returns: the output, or with residuals (output, (logsumexp,)).
SplashCustomReturnType = Union[jax.Array, tuple[jax.Array, tuple[jax.Array]]]  # noqa: UP007
# The residuals of JAX's splash forward: q, k, v, segment ids, sinks, out, logsumexp, and the
# dq and dkv mask infos (JAX's MaskInfo).
SplashResidualsType = tuple[
    jax.Array,
    jax.Array,
    jax.Array,
    Optional[SegmentIds],  # noqa: UP045
    Optional[jax.Array],  # noqa: UP045
    jax.Array,
    jax.Array,
    Optional[mask_info_lib.MaskInfo],  # noqa: UP045
    Optional[mask_info_lib.MaskInfo],  # noqa: UP045
]


def get_kernel_name(is_mqa: bool, save_residuals: bool, is_segmented: bool, phase: str) -> str:
    """The name of a splash kernel variant, as JAX names it:
    ``splash_{mha|mqa}_{fwd|dq|dkv}[_segmented]{_residuals|_no_residuals}``. Residuals are
    kept by the forward only; other phases or residuals outside ``fwd`` raise ValueError
    (JAX's asserts)."""
    if phase not in ("fwd", "dq", "dkv"):
        raise ValueError(f"{_OP}: phase must be 'fwd', 'dq' or 'dkv', got {phase!r}")
    if save_residuals and phase != "fwd":
        raise ValueError(f"{_OP}: only the 'fwd' phase saves residuals, got phase {phase!r}")
    kind = "mqa" if is_mqa else "mha"
    return f"splash_{kind}_{phase}{'_segmented' if is_segmented else ''}{'_residuals' if save_residuals else '_no_residuals'}"


def flash_attention_kernel(
    data_next_ref,
    block_mask_ref,
    mask_next_ref,
    q_ref,
    k_ref,
    v_ref,
    q_segment_ids_ref,
    kv_segment_ids_ref,
    sinks_ref,
    mask_ref,
    q_sequence_ref,
    m_scratch_ref,
    l_scratch_ref,
    o_scratch_ref,
    o_ref,
    logsumexp_ref=None,
    *,
    mask_value: float,
    grid_width: int,
    bq: int,
    bkv: int,
    bkv_compute: int,
    head_dim_v: int,
    q_layout: QKVLayout,
    k_layout: QKVLayout,
    v_layout: QKVLayout,
    attn_logits_soft_cap: float | None,
    mask_function: MaskFunctionType | None,
):
    """NOT PROVIDED: always raises NotImplementedError.

    JAX's forward kernel body, with JAX's signature, is named here so that imports resolve,
    but it is not implemented. JAX's body runs on a ``(heads, q blocks, kv grid width)`` grid
    whose every cell reads JAX's ``MaskInfo`` (``data_next``, ``block_mask``, ``mask_next``)
    from scalar memory, and on JAX's scratch layout. The kernels here run on a different
    schedule (``ScheduleInfo``: one packed step per visible block, no grid cell for a hidden
    one, one specialized body per block pattern) with different scratch buffers, so no body of
    theirs takes JAX's refs. Use ``make_splash_mha``/``make_splash_mqa`` (or
    ``SplashAttentionKernel``) for the kernel, ``attention_reference`` for a plain-``jnp``
    formula.
    """
    raise NotImplementedError(
        f"{_OP}: flash_attention_kernel (JAX's kernel body over JAX's MaskInfo refs) is not "
        "provided: the kernels here walk a packed schedule of visible blocks (ScheduleInfo) with "
        "their own refs, so no body takes JAX's ref layout. Build the kernel with "
        "make_splash_mha / make_splash_mqa (SplashAttentionKernel), or use attention_reference."
    )


@jax.tree_util.register_pytree_node_class
class SplashAttentionKernel:
    """A splash attention kernel for one mask: ``kernel(q, k, v, segment_ids=None, sinks=None)``.

    ``q``: ``[heads, q_seq_len, head_dim]`` floating point; ``k``: ``[kv_heads, kv_seq_len,
    head_dim]`` (``kv_heads`` dividing ``heads``: grouped queries) or, made by
    ``make_splash_mqa``, ``[kv_seq_len, head_dim]``; ``v`` as ``k`` but for its head dimension
    ``head_dim_v``; ``sinks``: optional ``[heads]`` logits of an attention sink. Returns the
    attention ``[heads, q_seq_len, head_dim_v]`` in ``q``'s dtype (and, made with
    ``save_residuals``, also ``(logsumexp [heads, q_seq_len],)``, +inf on a row that sees no
    key). Differentiable in ``q``, ``k``, ``v`` and ``sinks``.

    A mask whose heads are all one mask serves any number of heads (as JAX's); a mask with
    distinct head masks serves exactly as many heads as it has (per head shard inside
    ``shard_map``), and other counts are refused.
    """

    def __init__(self, fwd_mask_info, dq_mask_info, dkv_mask_info, **kwargs):
        self.kwargs = kwargs
        self.fwd_mask_info = fwd_mask_info
        self.dq_mask_info = dq_mask_info
        self.dkv_mask_info = dkv_mask_info

    def __call__(self, *args, **kwargs):
        q = args[0] if args else kwargs.get("q")
        kernel = self._for(q)
        params = {n: v for n, v in kernel.kwargs.items() if n != "rechoose"}
        return _splash_attention(
            kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info, *args, **kwargs, **params
        )

    def _for(self, q) -> SplashAttentionKernel:
        """This kernel, or, made without blocks and called with a head dimension or dtype that
        its rule gives other blocks for, the same kernel made with those (once per choice)."""
        rechoose = self.kwargs.get("rechoose")
        if rechoose is None or getattr(q, "ndim", 0) != 3:
            return self
        if getattr(self.fwd_mask_info.steps, "shape", None) != rechoose.steps_shape:
            return self  # a shard of the schedule (inside shard_map): kept
        return rechoose.kernel(self, q.shape[-1], q.dtype)

    def manual_sharding_spec(self, sharding: jax.sharding.NamedSharding):
        """The ``shard_map`` partition spec of this kernel for q sharded as ``sharding`` (its
        spec names the head axis and the q sequence axis): the schedules split by head shard
        and q shard, the partial mask blocks replicated."""
        spec = sharding.spec
        if len(spec) != 2:
            raise ValueError(
                f"{_OP}: manual_sharding_spec takes a sharding of (heads, q_seq_len), got spec {spec}"
            )
        steps_shape = self.fwd_mask_info.steps.shape
        try:
            sharding.shard_shape(steps_shape[:2])
        except ValueError as exc:
            raise ValueError(
                f"{_OP}: the sharding {spec} does not divide the kernel's schedule of "
                f"{steps_shape[0]} head rows and {steps_shape[1]} q shards evenly: make the kernel with "
                f"head_shards and q_seq_shards equal to the mesh's"
            ) from exc
        p = jax.sharding.PartitionSpec
        shard = p(spec[0], spec[1])

        def specs(info):
            if info is None:
                return None
            return mask_info_lib.ScheduleInfo(
                steps=shard,
                partial_mask_ids=None if info.partial_mask_ids is None else shard,
                partial_mask_blocks=None if info.partial_mask_blocks is None else p(),
                q_block_base=p(spec[1]),
            )

        return SplashAttentionKernel(
            specs(self.fwd_mask_info), specs(self.dq_mask_info), specs(self.dkv_mask_info), **self.kwargs
        )

    def tree_flatten(self):
        return (self.fwd_mask_info, self.dq_mask_info, self.dkv_mask_info), self.kwargs

    @classmethod
    def tree_unflatten(cls, kwargs, values):
        infos = [None if v is None else mask_info_lib.ScheduleInfo(*v) for v in values]
        return cls(*infos, **kwargs)


def _make_splash_attention(
    mask,
    *,
    block_sizes: BlockSizes | None = None,
    is_mqa: bool,
    save_residuals: bool = False,
    mask_value: float = DEFAULT_MASK_VALUE,
    attn_logits_soft_cap: float | None = None,
    downcast_smem_data: bool = True,
    head_shards: int,
    q_seq_shards: int,
    residual_checkpoint_name: str | None = None,
    interpret: bool = False,
):
    settings = dict(locals())  # every argument, as given
    return _make_kernel(settings.pop("mask"), leaves=jnp.asarray, **settings)


def _make_kernel(
    mask,
    *,
    leaves: Callable[[Any], Any],  # how the mask info's arrays are held
    block_sizes: BlockSizes | None,
    **settings: Any,  # make_splash_mha's other arguments
):
    _check_mask(mask, settings["attn_logits_soft_cap"])
    head_shards, q_seq_shards = settings["head_shards"], settings["q_seq_shards"]
    mask_heads, q_len, kv_len = mask.shape
    if min(mask_heads, q_len, kv_len) < 1:
        raise ValueError(
            f"{_OP}: the mask must have at least one head, query and key, got shape {mask.shape}"
        )
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"{_OP}: block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    rechoose = None
    if block_sizes is None or block_sizes == BlockSizes.get_default():
        # the defaults asked for without lengths: those of these lengths
        block_sizes, rechoose = _default_blocks_of(mask, settings)
    fused_bwd = bool(block_sizes.use_fused_bwd_kernel)
    block_sizes = _shrink(_complete(block_sizes), q_len // max(q_seq_shards, 1), kv_len)
    _check_blocks(block_sizes, q_len // max(q_seq_shards, 1), kv_len)

    b = block_sizes  # complete: every block set (_complete, BlockSizes.__post_init__)
    fwd_info, mask_function, fwd_patterns, dq_info, dq_patterns, dkv_info, dkv_patterns = _schedules(
        mask, b, leaves, settings["downcast_smem_data"], head_shards, q_seq_shards
    )
    kernel = SplashAttentionKernel(
        fwd_info,
        dq_info,
        dkv_info,
        block_sizes=block_sizes,
        mask_function=mask_function,
        mask_shape=(q_len, kv_len),
        **{k: v for k, v in settings.items() if k not in ("downcast_smem_data", "head_shards")},
        mask_heads=mask_heads,
        schedule_rows=int(fwd_info.steps.shape[0]),
        patterns=(fwd_patterns, dq_patterns, dkv_patterns),
        rechoose=rechoose,
        fused_bwd=fused_bwd,
    )
    if rechoose is not None:
        rechoose.steps_shape = tuple(fwd_info.steps.shape)
    return kernel


def _check_mask(mask, attn_logits_soft_cap) -> None:
    if isinstance(mask, jax.Array):
        raise NotImplementedError(
            f"{_OP}: a mask given as a jax.Array (JAX's dynamic masks) is not supported; pass a NumPy "
            f"array or a MultiHeadMask"
        )
    if not isinstance(mask, (np.ndarray, mask_lib.MultiHeadMask)):
        raise TypeError(
            f"{_OP}: mask must be a MultiHeadMask or a boolean NumPy array [heads, q_seq_len, "
            f"kv_seq_len], got {type(mask).__name__}"
        )
    if len(mask.shape) != 3:
        raise ValueError(
            f"{_OP}: the mask must be 3-d [heads, q_seq_len, kv_seq_len], got shape {mask.shape}"
        )
    if isinstance(mask, np.ndarray) and mask.dtype != np.bool_:
        raise ValueError(f"{_OP}: a NumPy mask must be boolean, got {mask.dtype}")
    if attn_logits_soft_cap is not None and not attn_logits_soft_cap > 0:
        raise ValueError(f"{_OP}: attn_logits_soft_cap must be positive, got {attn_logits_soft_cap}")


def _default_blocks_of(mask, settings: dict) -> tuple[BlockSizes, _Rechoose | None]:
    """The default blocks of ``mask``'s lengths (per q shard), and (unsharded) how the kernel
    remakes itself for a call whose head dimension or dtype gets other blocks."""
    _, q_len, kv_len = mask.shape
    head_shards, q_seq_shards = settings["head_shards"], settings["q_seq_shards"]
    has_partial = _has_partial(mask, q_len, kv_len)
    blocks = BlockSizes.get_default(q_len // max(q_seq_shards, 1), kv_len, has_partial=has_partial)
    if head_shards != 1 or q_seq_shards != 1:  # a sharded kernel's schedule is split: kept
        return blocks, None
    # Made at the first call, maybe inside a trace (even under an abstract mesh, where no
    # jax.Array can be made): host arrays, constants of any trace.
    remake = functools.partial(_make_kernel, mask, leaves=np.asarray, **settings)
    facts = _policy.facts()  # the chip's facts as of the kernel's making, as its first blocks
    return blocks, _Rechoose(
        functools.partial(default_blocks, q_len, kv_len, has_partial, info=facts), remake
    )


def _schedules(mask, b: BlockSizes, leaves, downcast_smem_data: bool, head_shards: int, q_seq_shards: int):
    """The forward's, ``dq``'s and ``dk``/``dv``'s schedules of ``mask`` at the blocks ``b``:
    ``(fwd_info, mask_function, fwd_patterns, dq_info, dq_patterns, dkv_info, dkv_patterns)``."""

    def process(fn, bq, bkv, chunk, **kw):
        info, function, patterns = fn(
            mask,
            (bq, bkv),
            downcast_smem_data=downcast_smem_data,
            head_shards=head_shards,
            q_seq_shards=q_seq_shards,
            block_kv_compute=chunk,
            **kw,
        )
        return jax.tree.map(leaves, info), function, patterns

    fwd_info, mask_function, fwd_patterns = process(
        mask_info_lib.process_schedule,
        b.block_q,
        b.block_kv,
        b.block_kv_compute,
        q_band=_forward.band_of(b.block_q, cast(int, b.block_kv_compute)),
    )
    dq_info, _, dq_patterns = process(
        mask_info_lib.process_schedule,
        b.block_q_dq,
        b.block_kv_dq,
        _backward.cell_of(cast(int, b.block_kv_dq)),
        q_band=_backward.cell_of(cast(int, b.block_q_dq)),
    )
    dkv_info, _, dkv_patterns = process(
        mask_info_lib.process_schedule_dkv,
        b.block_q_dkv,
        b.block_kv_dkv,
        b.block_kv_dkv_compute,
        q_band=_backward.cell_of(cast(int, b.block_q_dkv)),
    )
    return fwd_info, mask_function, fwd_patterns, dq_info, dq_patterns, dkv_info, dkv_patterns


class _Rechoose:
    """How a kernel made without blocks remakes itself for a call whose head dimension or
    dtype the default rule gives other blocks for (the mask's schedules depend on the
    blocks, and make_splash_mha does not see q). Compares by identity (it rides in the
    kernel's static pytree data)."""

    def __init__(self, blocks_for: Callable[..., BlockSizes], remake: Callable[..., Any]):
        self._blocks_for, self._remake = blocks_for, remake
        self._made: dict[BlockSizes, SplashAttentionKernel] = {}
        self.steps_shape: tuple | None = None  # of the schedule made with the first blocks

    def kernel(self, kernel: SplashAttentionKernel, head_dim: int, dtype) -> SplashAttentionKernel:
        blocks = self._blocks_for(head_dim=int(head_dim), itemsize=_itemsize(dtype))
        if _complete(blocks) == kernel.kwargs["block_sizes"]:  # (the rule's fit the lengths)
            return kernel
        if blocks not in self._made:
            made = self._remake(block_sizes=blocks)
            made.kwargs["rechoose"] = None
            self._made[blocks] = made
        return self._made[blocks]


def _has_partial(mask, q_len: int, kv_len: int) -> bool:
    """Whether the mask has partial blocks at the default forward blocks' granularity."""
    bq, bkv = fit_block(q_len, 1024), fit_block(kv_len, 1024)
    if q_len % bq or kv_len % bkv:
        return True
    heads = mask.masks if isinstance(mask, mask_lib.MultiHeadMask) else [mask_lib.NumpyMask(m) for m in mask]
    distinct = {id(m): m for m in heads}.values()
    return any((m.block_kinds(bq, bkv) == mask_lib.PARTIAL).any() for m in distinct)


make_splash_mha = functools.partial(_make_splash_attention, is_mqa=False)
make_splash_mqa = functools.partial(_make_splash_attention, is_mqa=True)
make_splash_mha_single_device = functools.partial(make_splash_mha, head_shards=1, q_seq_shards=1)
make_splash_mqa_single_device = functools.partial(make_splash_mqa, head_shards=1, q_seq_shards=1)


# ---------------------------------------------------------------------------------------------
# The call and its VJP.


def _check_call(q, k, v, segment_ids, sinks, is_mqa: bool, info, mask_heads: int, schedule_rows: int) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise TypeError(f"{_OP}: {name} must be an array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{_OP}: {name} must be a floating-point array, got dtype {x.dtype}")
    if q.ndim != 3:
        raise ValueError(f"{_OP}: q must be [heads, q_seq_len, head_dim], got shape {q.shape}")
    want = 2 if is_mqa else 3
    layout = "[kv_seq_len, head_dim] (an MQA kernel)" if is_mqa else "[kv_heads, kv_seq_len, head_dim]"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != want:
            raise ValueError(f"{_OP}: {name} must be {layout}, got shape {x.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{_OP}: k and v must have one shape but for the head dimension, got {k.shape} and {v.shape}"
        )
    heads, q_len, head_dim = q.shape
    if k.shape[-1] != head_dim:
        raise ValueError(f"{_OP}: head_dim of q ({head_dim}) and k ({k.shape[-1]}) differ")
    if not is_mqa and heads % k.shape[0]:
        raise ValueError(f"{_OP}: the kv heads ({k.shape[0]}) must divide the q heads ({heads})")
    if segment_ids is not None:
        if not isinstance(segment_ids, SegmentIds):
            raise TypeError(f"{_OP}: segment_ids must be a SegmentIds, got {type(segment_ids).__name__}")
        for name, ids in (("q", segment_ids.q), ("kv", segment_ids.kv)):
            dtype = getattr(ids, "dtype", None)
            if dtype is None or not (
                jnp.issubdtype(dtype, jnp.integer)
                or jnp.issubdtype(dtype, jnp.floating)
                or jnp.issubdtype(dtype, jnp.bool_)
            ):
                raise TypeError(
                    f"{_OP}: segment_ids.{name} must be an integer (or float, compared as given) "
                    f"array, got {type(ids).__name__} of dtype {dtype}"
                )
        if segment_ids.q.shape != (q_len,) or segment_ids.kv.shape != (k.shape[-2],):
            raise ValueError(
                f"{_OP}: segment_ids must be q [{q_len}] and kv [{k.shape[-2]}], got "
                f"{segment_ids.q.shape} and {segment_ids.kv.shape}"
            )
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"{_OP}: sinks must be [heads] = [{heads}], got shape {sinks.shape}")
    rows = info.steps.shape[0]  # of this call's head shards (inside shard_map: its own)
    if schedule_rows > 1 and heads != mask_heads * rows // schedule_rows:
        raise ValueError(
            f"{_OP}: q has {heads} heads, the kernel's mask {mask_heads * rows // schedule_rows} "
            f"(here; {mask_heads} in all): a mask with more than one distinct head mask serves "
            f"exactly its heads (make the kernel with one mask per head of q)"
        )


def _splash_attention(
    fwd_mask_info,
    dq_mask_info,
    dkv_mask_info,
    q,
    k,
    v,
    segment_ids: SegmentIds | None = None,
    sinks=None,
    *,
    is_mqa: bool,
    block_sizes: BlockSizes,
    save_residuals: bool,
    mask_value: float,
    attn_logits_soft_cap: float | None,
    residual_checkpoint_name: str | None,
    mask_function: Callable | None,
    interpret: Any,
    mask_shape: tuple[int, int],
    q_seq_shards: int,
    mask_heads: int,
    schedule_rows: int,
    patterns: tuple,
    fused_bwd: bool = False,
):
    _check_call(q, k, v, segment_ids, sinks, is_mqa, fwd_mask_info, mask_heads, schedule_rows)
    # Inside shard_map a call sees its shards' part of q (and of the schedule).
    local_shards = fwd_mask_info.steps.shape[1]
    want_q = mask_shape[0] // q_seq_shards * local_shards
    if (q.shape[1], k.shape[-2]) != (want_q, mask_shape[1]):
        raise ValueError(
            f"{_OP}: q [{q.shape[1]}] and k [{k.shape[-2]}] do not fit the kernel's mask of shape "
            f"{mask_shape} ({local_shards} of its {q_seq_shards} q shards here: q_seq_len {want_q}): call "
            f"it with the sequence lengths it was made for"
        )
    if interpret is True:
        interpret = pltpu.InterpretParams()
    cfg = _common.Config(
        is_mqa=is_mqa,
        mask_value=float(mask_value),
        attn_logits_soft_cap=None if attn_logits_soft_cap is None else float(attn_logits_soft_cap),
        mask_function=mask_function,
        interpret=interpret,
    )
    b = block_sizes
    fwd_blocks = (b.block_q, b.block_kv, b.block_kv_compute)
    if save_residuals:
        return _with_residuals(fwd_mask_info, q, k, v, segment_ids, sinks, cfg, fwd_blocks, patterns[0])
    static = _Static(cfg, b, residual_checkpoint_name, patterns, fused_bwd)
    return _attend(static, fwd_mask_info, dq_mask_info, dkv_mask_info, q, k, v, segment_ids, sinks)


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: _common.Config
    blocks: BlockSizes
    checkpoint_name: str | None
    patterns: tuple  # of the forward, dq and dk/dv schedules
    fused_bwd: bool = False  # BlockSizes.use_fused_bwd_kernel: dq computed in the dk/dv kernel


def _with_residuals(info, q, k, v, segment_ids, sinks, cfg, blocks, patterns):
    @jax.custom_vjp
    def run(q, k, v, sinks):
        out, lse = _forward.forward(
            info, q, k, v, segment_ids, sinks, cfg=cfg, blocks=blocks, patterns=patterns, keep_lse=True
        )
        return out, (lse,)

    def fwd(q, k, v, sinks):
        raise NotImplementedError(f"{_OP}: a kernel made with save_residuals=True is not differentiable")

    run.defvjp(fwd, lambda res, g: None)
    return run(q, k, v, sinks)


def _forward_pass(static, info, q, k, v, segment_ids, sinks, *, keep_lse: bool):
    blocks = (static.blocks.block_q, static.blocks.block_kv, static.blocks.block_kv_compute)
    return _forward.forward(
        info, q, k, v, segment_ids, sinks, cfg=static.cfg, blocks=blocks, patterns=static.patterns[0],
        keep_lse=keep_lse,
    )  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(static, fwd_info, dq_info, dkv_info, q, k, v, segment_ids, sinks):
    out, _ = _forward_pass(static, fwd_info, q, k, v, segment_ids, sinks, keep_lse=False)
    return out


def _attend_fwd(static, fwd_info, dq_info, dkv_info, q, k, v, segment_ids, sinks):
    out, lse = _forward_pass(static, fwd_info, q, k, v, segment_ids, sinks, keep_lse=True)
    if static.checkpoint_name is not None:
        from jax.ad_checkpoint import checkpoint_name

        out, lse = checkpoint_name(out, static.checkpoint_name), checkpoint_name(lse, static.checkpoint_name)
    return out, (dq_info, dkv_info, q, k, v, segment_ids, sinks, out, lse)


def _attend_bwd(static, residuals, d_out):
    dq_info, dkv_info, q, k, v, segment_ids, sinks, out, lse = residuals
    b = static.blocks
    dq, dk, dv, dsinks = _backward.backward(
        dq_info,
        dkv_info,
        q,
        k,
        v,
        segment_ids,
        sinks,
        out,
        lse,
        d_out,
        cfg=static.cfg,
        dq_blocks=(b.block_q_dq, b.block_kv_dq),
        dkv_blocks=(b.block_q_dkv, b.block_kv_dkv, b.block_kv_dkv_compute),
        patterns=static.patterns[1:],
        fused=static.fused_bwd,
    )
    return None, None, None, dq, dk, dv, None, dsinks


_attend.defvjp(_attend_fwd, _attend_bwd)
