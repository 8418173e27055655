"""TPU interpret mode's model of a TensorCore's MXUs (``language/mxu.py``): per
core and per MXU, the staging registers, the loaded weights, the result FIFO,
and (as cells) the ``pltpu.ACC`` accumulators.

The registers are hidden state of the core (``rules.HIDDEN_STATE``: carried
through loops and conds, one copy per core), made when the kernel uses an MXU op:

* ``mxu_staged``: f32[mxus, registers, 2K, K], what each staging register holds,
  and ``mxu_staged_rows`` (i32[mxus, registers]: its rows, 0 when empty); on v4, v5e
  and v5p the registers of an MXU share one store: one RHS staged at a time;
* ``mxu_weights`` / ``mxu_weight_rows``: the weights loaded into each MXU (rows 0: none);
* ``mxu_fifo``: i32[mxus, FIFO_ROWS, K], the result FIFO as a ring of rows (the bits
  of float32 or int32 results), ``mxu_fifo_head`` and ``mxu_fifo_len`` (rows), and
  ``mxu_fifo_int`` (1 where a row holds an int32 result).

Every operand the MXU takes is exact in float32 (bfloat16, float32, 8-bit floats and
integers, int4), so registers hold float32. Products are ``lax.dot`` at highest
precision, accumulated in float32 (float operands) or int32 (integer operands).
Errors, each naming the kernel, the line and the MXU: pushing to a full staging
register; loading an empty one; a matmul with no weights loaded, or with weights of
another depth than the LHS's; a FIFO over ``FIFO_ROWS`` rows (the hardware's depth is
not published: the model's is a bound, not the chip's); popping more rows than the FIFO
holds, or an int32 result as float32 (Mosaic refuses both); and at the kernel's end a
staging register still full or rows left in a FIFO. An accumulator must be empty when
its ``pl.run_scoped`` ends (``check_acc_empty``); reading or writing one other than by
``matmul_acc_lhs``/``matmul_pop`` is refused, as JAX's lowering refuses it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_tpu._src.interpret import rules
from pallas_tpu._src.interpret.refs import RefView
from pallas_tpu._src.language import mxu as tpu_mxu
from pallas_tpu._src.language import tpu_info

FIFO_ROWS = 512  # rows of results a model FIFO holds (per MXU)

STAGED, STAGED_ROWS = "mxu_staged", "mxu_staged_rows"
WEIGHTS, WEIGHT_ROWS = "mxu_weights", "mxu_weight_rows"
FIFO, FIFO_HEAD, FIFO_LEN, FIFO_INT = "mxu_fifo", "mxu_fifo_head", "mxu_fifo_len", "mxu_fifo_int"
NAMES = (STAGED, STAGED_ROWS, WEIGHTS, WEIGHT_ROWS, FIFO, FIFO_HEAD, FIFO_LEN, FIFO_INT)


def _facts():
    info = tpu_info.get_tpu_info()
    return info.num_mxus, tpu_mxu.num_staging_registers(info), info.mxu_column_size


def _initializers():
    def make(name):
        def init():
            m, r, k = _facts()
            shapes = {
                STAGED: ((m, r, 2 * k, k), jnp.float32),
                STAGED_ROWS: ((m, r), jnp.int32),
                WEIGHTS: ((m, 2 * k, k), jnp.float32),
                WEIGHT_ROWS: ((m,), jnp.int32),
                FIFO: ((m, FIFO_ROWS, k), jnp.int32),
                FIFO_HEAD: ((m,), jnp.int32),
                FIFO_LEN: ((m,), jnp.int32),
                FIFO_INT: ((m, FIFO_ROWS), jnp.int32),
            }
            shape, dtype = shapes[name]
            return jnp.zeros(shape, dtype)

        return init

    return {n: make(n) for n in NAMES}


for _p in tpu_mxu.MXU_PRIMITIVES:
    rules.HIDDEN_STATE[_p] = _initializers()


def _where(interp, eqn, mxu) -> str:
    return f"{interp.where(eqn)}: pltpu.{eqn.primitive.name} on MXU {mxu}"


def _push_rhs(interp, eqn, rhs):
    p, h = eqn.params, interp.hidden.named
    mxu, reg = p["mxu_index"], p["staging_register"]
    value = jnp.asarray(rhs).astype(jnp.float32)
    if p["transpose"]:
        value = value.T
    rows, k = value.shape
    full = h[STAGED_ROWS][mxu, reg]
    interp.check(
        full == 0,
        f"{_where(interp, eqn, mxu)}: staging register {reg} still holds an RHS that no matmul loaded "
        "(load it with load_staged_rhs before pushing again)",
    )
    info = tpu_info.get_tpu_info()
    at_once = tpu_mxu.staged_at_once(info)
    staged = jnp.sum((h[STAGED_ROWS][mxu] > 0).astype(jnp.int32))
    if at_once < tpu_mxu.num_staging_registers(info):
        interp.check(
            staged < at_once,
            f"{_where(interp, eqn, mxu)}: TPU {info.chip_version}'s MXU holds {at_once} staged RHS at a "
            f"time (its staging registers share one store) and {{0}} is staged already: load it with a "
            "matmul (load_staged_rhs) before pushing the next",
            [staged],
        )
    padded = jnp.zeros((2 * k, k), jnp.float32).at[:rows].set(value)
    h[STAGED] = h[STAGED].at[mxu, reg].set(padded)
    h[STAGED_ROWS] = h[STAGED_ROWS].at[mxu, reg].set(rows)
    return []


def _load_and_multiply(interp, eqn, mxu, lhs, reg):
    """Loads staging register ``reg`` (if given) into MXU ``mxu``'s weights; returns
    ``lhs @ weights`` (float32 or int32)."""
    h = interp.hidden.named
    if reg is not None:
        interp.check(
            h[STAGED_ROWS][mxu, reg] > 0,
            f"{_where(interp, eqn, mxu)}: load_staged_rhs={reg} but staging register {reg} is empty "
            "(push an RHS with pltpu.matmul_push_rhs first)",
        )
        h[WEIGHTS] = h[WEIGHTS].at[mxu].set(h[STAGED][mxu, reg])
        h[WEIGHT_ROWS] = h[WEIGHT_ROWS].at[mxu].set(h[STAGED_ROWS][mxu, reg])
        h[STAGED_ROWS] = h[STAGED_ROWS].at[mxu, reg].set(0)
    depth = lhs.shape[1]
    loaded = h[WEIGHT_ROWS][mxu]
    interp.check(
        loaded == depth,
        f"{_where(interp, eqn, mxu)}: the lhs is {depth} deep but the MXU's loaded weights have {{0}} rows "
        "(0: none loaded; push an RHS and pass load_staged_rhs)",
        [loaded],
    )
    weights = h[WEIGHTS][mxu, :depth]
    lhs = jnp.asarray(lhs)
    if jnp.issubdtype(lhs.dtype, jnp.integer):
        return lax.dot(lhs.astype(jnp.int32), weights.astype(jnp.int32), preferred_element_type=jnp.int32)
    return lax.dot(
        lhs.astype(jnp.float32), weights, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _acc_lhs(interp, eqn, acc, lhs):
    space = interp.cell_spaces[acc.cell]
    out = _load_and_multiply(interp, eqn, space.mxu_id, lhs, eqn.params["load_staged_rhs"])
    cur = interp.state[acc.cell]
    interp.state[acc.cell] = cur + out.astype(cur.dtype)
    return []


def _pop(interp, eqn, acc):
    value = interp.state[acc.cell]
    interp.state[acc.cell] = jnp.zeros_like(value)
    return value


def _lhs_fifo(interp, eqn, lhs):
    p, h = eqn.params, interp.hidden.named
    mxu = p["mxu_index"]
    out = _load_and_multiply(interp, eqn, mxu, lhs, p["load_staged_rhs"])
    rows = out.shape[0]
    length, head = h[FIFO_LEN][mxu], h[FIFO_HEAD][mxu]
    interp.check(
        length + rows <= FIFO_ROWS,
        f"{_where(interp, eqn, mxu)}: the result FIFO overflows: it holds {{0}} rows and this matmul adds "
        f"{rows} (the model's FIFO holds {FIFO_ROWS}; pop results with pltpu.matmul_pop_fifo first)",
        [length],
    )
    slots = (head + length + jnp.arange(rows, dtype=jnp.int32)) % FIFO_ROWS
    bits = lax.bitcast_convert_type(out, jnp.int32)
    is_int = np.int32(1 if out.dtype == jnp.int32 else 0)
    h[FIFO] = h[FIFO].at[mxu, slots].set(bits)
    h[FIFO_INT] = h[FIFO_INT].at[mxu, slots].set(is_int)
    h[FIFO_LEN] = h[FIFO_LEN].at[mxu].set(jnp.minimum(length + rows, FIFO_ROWS))
    return []


def _pop_fifo(interp, eqn):
    p, h = eqn.params, interp.hidden.named
    mxu, (rows, _), dtype = p["mxu_index"], p["shape"], np.dtype(p["dtype"])
    length, head = h[FIFO_LEN][mxu], h[FIFO_HEAD][mxu]
    interp.check(
        length >= rows,
        f"{_where(interp, eqn, mxu)}: popping {rows} rows but the result FIFO holds {{0}} "
        "(on a TPU this pop waits forever: Mosaic refuses it)",
        [length],
    )
    slots = (head + jnp.arange(rows, dtype=jnp.int32)) % FIFO_ROWS
    kinds = h[FIFO_INT][mxu, slots]
    want = np.int32(1 if dtype == np.int32 else 0)
    interp.check(
        jnp.all(kinds == want),
        f"{_where(interp, eqn, mxu)}: popping {dtype} results but the FIFO holds "
        f"{'float32' if want else 'int32'} ones (float operands give float32, integer ones int32)",
    )
    bits = h[FIFO][mxu, slots]
    h[FIFO_HEAD] = h[FIFO_HEAD].at[mxu].set((head + jnp.minimum(rows, length)) % FIFO_ROWS)
    h[FIFO_LEN] = h[FIFO_LEN].at[mxu].set(jnp.maximum(length - rows, 0))
    return lax.bitcast_convert_type(bits, dtype)


rules.STATE_RULES[tpu_mxu.matmul_push_rhs_p] = _push_rhs
rules.STATE_RULES[tpu_mxu.matmul_acc_lhs_p] = _acc_lhs
rules.STATE_RULES[tpu_mxu.matmul_pop_p] = _pop
rules.STATE_RULES[tpu_mxu.matmul_lhs_fifo_p] = _lhs_fifo
rules.STATE_RULES[tpu_mxu.matmul_pop_fifo_p] = _pop_fifo


def check_registers_empty(interp) -> None:
    """At the end of a core's kernel: no staging register full, no rows in a FIFO."""
    h = interp.hidden.named
    if STAGED_ROWS not in h:
        return
    staged = jnp.sum((h[STAGED_ROWS] > 0).astype(jnp.int32))
    interp.check(
        staged == 0,
        f"{interp.kernel_desc}: the kernel ends with {{0}} MXU staging register(s) still holding an RHS "
        "(pltpu.matmul_push_rhs without a matmul that loads it); a kernel must leave them empty",
        [staged],
    )
    rows = jnp.sum(h[FIFO_LEN])
    interp.check(
        rows == 0,
        f"{interp.kernel_desc}: the kernel ends with {{0}} rows of results in the MXU result FIFOs "
        "(pop them with pltpu.matmul_pop_fifo); a kernel must leave them empty",
        [rows],
    )


def check_acc_empty(interp, view: RefView, eqn) -> None:
    """An accumulator whose ``pl.run_scoped`` ends must hold no data (pop it)."""
    nonzero = jnp.sum((interp.state[view.cell] != 0).astype(jnp.int32))
    interp.check(
        nonzero == 0,
        f"{interp.where(eqn)}: accumulator {interp.describe_ref(view)} holds {{0}} nonzero values when its "
        "pl.run_scoped ends: pop it with pltpu.matmul_pop (a kernel must leave accumulators empty)",
        [nonzero],
    )


def refuse_direct_access(interp, view: RefView, eqn) -> None:
    """Reading or writing an accumulator other than by the MXU ops (as JAX's lowering refuses)."""
    if isinstance(interp.cell_spaces.get(view.cell), tpu_mxu.AccMemorySpace):
        raise ValueError(
            f"{interp.where(eqn)}: an accumulator Ref (pltpu.ACC) is not read or written directly: "
            "pltpu.matmul_acc_lhs adds into it and pltpu.matmul_pop reads it (and zeroes it). "
            "(JAX: Loading from an accumulator is not supported. Use `matmul_pop` instead.)"
        )
