"""Plain-``jnp`` splash attention (JAX's ``make_masked_mha_reference`` family): a dense mask,
float32 logits, differentiated by JAX."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)


def attention_reference(
    mask,
    q,
    k,
    v,
    segment_ids,
    sinks=None,
    *,
    mask_value: float = DEFAULT_MASK_VALUE,
    save_residuals: bool = False,
    custom_type: str = "flash",
    attn_logits_soft_cap: float | None = None,
):
    """One head: ``mask [q_len, kv_len]``, ``q [q_len, d]``, ``k``, ``v [kv_len, d]``; returns
    the attention in float32 (with ``save_residuals`` also ``(logsumexp,)``). A query row that
    sees no key (and has no sink) gives zeros and a logsumexp of +inf, as the kernels do
    (JAX's reference: the mean of ``v``)."""
    del custom_type  # every backward here is JAX's autodiff of the same formula
    logits = jnp.einsum("qd,kd->qk", q.astype(jnp.float32), k.astype(jnp.float32))
    if segment_ids is not None:
        mask = mask & (segment_ids.q[:, None] == segment_ids.kv[None, :])
    if attn_logits_soft_cap is not None:
        logits = attn_logits_soft_cap * jnp.tanh(logits / attn_logits_soft_cap)
    logits = jnp.where(mask, logits, mask_value)
    top = jnp.max(logits, axis=-1)
    if sinks is not None:
        top = jnp.maximum(top, sinks.astype(jnp.float32))
    e = jnp.exp(logits - top[:, None])
    total = jnp.sum(e, axis=-1)
    if sinks is not None:
        total = total + jnp.exp(sinks.astype(jnp.float32) - top)
    out = jnp.einsum("qk,kd->qd", e / total[:, None], v.astype(jnp.float32))
    lse = top + jnp.log(total)
    if sinks is None:
        seen = jnp.any(mask, axis=-1)
        out = jnp.where(seen[:, None], out, 0.0)
        lse = jnp.where(seen, lse, jnp.inf)
    if save_residuals:
        return out, (lse,)
    return out


def make_attention_reference(mask, is_mqa: bool, backward_impl: str = "vanilla", **params: Any):
    """A reference over all heads for ``mask`` (``[heads, q_len, kv_len]``, a NumPy array or a
    ``MultiHeadMask``): ``f(q, k, v, segment_ids=None, sinks=None, *, mask_value,
    save_residuals, attn_logits_soft_cap)`` with the kernel's argument shapes.
    ``backward_impl`` is accepted for JAX's signature (the gradient is JAX's autodiff)."""
    del backward_impl
    dense = jnp.asarray(np.asarray(mask[:, :, :], dtype=np.bool_))

    @functools.partial(jax.jit, static_argnames=["mask_value", "save_residuals", "attn_logits_soft_cap"])
    def run(
        mask,
        q,
        k,
        v,
        segment_ids=None,
        sinks=None,
        *,
        mask_value: float = DEFAULT_MASK_VALUE,
        save_residuals: bool = False,
        attn_logits_soft_cap: float | None = None,
    ):
        one: Callable[..., Any] = functools.partial(
            attention_reference,
            mask_value=mask_value,
            save_residuals=save_residuals,
            attn_logits_soft_cap=attn_logits_soft_cap,
            **params,
        )
        heads = q.shape[0]
        if is_mqa:
            kk = jnp.broadcast_to(k, (heads, *k.shape))
            vv = jnp.broadcast_to(v, (heads, *v.shape))
        else:
            group = heads // k.shape[0]
            kk, vv = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
        sink_axis = None if sinks is None else 0
        return jax.vmap(one, in_axes=(0, 0, 0, 0, None, sink_axis))(mask, q, kk, vv, segment_ids, sinks)

    return functools.partial(run, dense)
