"""The differentiable grouped matmul: ``gmm`` with a custom VJP, as JAX's
``megablox.ops.gmm``.

Backward of ``out = gmm(lhs, rhs)``: ``d lhs = gmm(d out, rhs)`` with the rhs
transposed in the kernel (its blocks read as they lie), ``d rhs = tgmm`` of the
forward's ``lhs`` and ``d out`` over the same groups. ``d rhs`` of a transposed
rhs is computed transposed (``tgmm`` of ``d out`` against ``lhs``), not
transposed afterwards. Rows outside the local groups took ``existing_out``'s
values, so its cotangent is ``d out`` there and zero elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_tpu.ops.megablox.gmm import gmm as grouped_matmul
from pallas_tpu.ops.megablox.gmm import local_rows, tgmm, transposed_gmm

# d rhs reads the forward's lhs [m, k] as it lies and contracts its rows in VMEM,
# instead of transposing it to [k, m] in HBM first.
LHS_ROWS_FIRST_IN_TGMM = True


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 7, 8))
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type: jax.typing.DTypeLike = jnp.float32,
    tiling=None,
    group_offset: jax.Array | None = None,
    existing_out: jax.Array | None = None,
    transpose_rhs: bool = False,
    interpret=False,
) -> jax.Array:
    """``lhs[rows of g] @ rhs[g]`` per group, differentiable in ``lhs``, ``rhs``
    and ``existing_out``; the arguments are ``megablox.gmm.gmm``'s."""
    return grouped_matmul(
        lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, existing_out,
        transpose_rhs=transpose_rhs, interpret=interpret,
    )  # fmt: skip


def _forward(lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, existing_out, transpose_rhs,
             interpret):  # fmt: skip
    out = gmm(lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, existing_out, transpose_rhs,
              interpret)  # fmt: skip
    keeps_existing = None if existing_out is None else jnp.zeros((), jnp.bool_)
    return out, (lhs, rhs, group_sizes, group_offset, keeps_existing)


def _backward(preferred_element_type, tiling, transpose_rhs, interpret, residuals, grad):
    lhs, rhs, group_sizes, group_offset, keeps_existing = residuals
    num_local = rhs.shape[0]
    d_lhs = grouped_matmul(
        grad, rhs, group_sizes, lhs.dtype, tiling, group_offset, transpose_rhs=not transpose_rhs,
        interpret=interpret,
    )  # fmt: skip
    # d rhs[g] = lhs[rows of g]^T @ grad[rows of g]; transposed: grad[rows]^T @ lhs[rows].
    left, right = (grad, lhs) if transpose_rhs else (lhs, grad)
    if LHS_ROWS_FIRST_IN_TGMM:
        d_rhs = transposed_gmm(
            left, right, group_sizes, rhs.dtype, tiling, group_offset, num_local, None, interpret,
            lhs_rows_first=True,
        )  # fmt: skip
    else:
        d_rhs = tgmm(
            left.swapaxes(0, 1), right, group_sizes, rhs.dtype, tiling, group_offset, num_local,
            interpret=interpret,
        )  # fmt: skip
    d_existing = None
    if keeps_existing is not None:
        d_existing = jnp.where(local_rows(group_sizes, group_offset, num_local, lhs.shape[0]), 0, grad)
        d_existing = d_existing.astype(grad.dtype)
    return d_lhs, d_rhs, None, None, d_existing


gmm.defvjp(_forward, _backward)
