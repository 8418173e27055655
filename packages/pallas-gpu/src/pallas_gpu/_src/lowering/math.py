"""Lowering rules for elementwise math and casts, and the GPU-only
elementwise primitives (``plgpu.approx_tanh``, ``plgpu.elementwise_inline_asm``,
``plgpu.max_contiguous``). Each rule returns the generated expression for its
result; trivial ones are registered from tables."""

from __future__ import annotations

import dataclasses
import functools
import typing

import ml_dtypes
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_gpu._src import compat
from pallas_gpu._src.language import primitives as gpu_primitives
from pallas_gpu._src.lowering.lowering import (
    RuleContext,
    Val,
    cast,
    const,
    is_bool,
    is_float,
    is_signed_int,
    is_unsigned_int,
    lower_fun,
    next_pow2,
    register_lowering,
    tl_dtype,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
_HALF = {np.dtype("float16"), BF16}


def upcast(rc: RuleContext, x: Val) -> Val:
    """16-bit floats are computed in f32 (Triton's math functions take f32/f64)."""
    return cast(rc.em, x, np.float32) if x.dtype in _HALF else x


def _finish(rc: RuleContext, expr: str, dtype) -> Val:
    """Assigns ``expr`` (computed in ``dtype``) and casts it to the output dtype."""
    a = rc.avals_out[0]
    v = rc.em.assign(expr, a.shape, dtype)
    return cast(rc.em, v, a.dtype)


def _f32_ctx(rc: RuleContext) -> RuleContext:
    """``rc`` with f32 in place of bf16 output avals."""
    avals = [a.update(dtype=np.dtype(np.float32)) if a.dtype == BF16 else a for a in rc.avals_out]
    return dataclasses.replace(rc, avals_out=avals)


def _bf16_via_f32(rule):
    """Runs ``rule`` on bf16 operands widened to f32, and rounds the result
    back (one f32 op rounded to bf16 is exactly the bf16 op; it also keeps
    Triton's interpreter, which holds bf16 as raw uint16, correct)."""

    @functools.wraps(rule)
    def wrapped(rc: RuleContext, *xs, **params):
        if not xs or xs[0].dtype != BF16:
            return rule(rc, *xs, **params)
        wide = [cast(rc.em, x, np.float32) if x.dtype == BF16 else x for x in xs]
        return cast(rc.em, rule(_f32_ctx(rc), *wide, **params), rc.avals_out[0].dtype)

    return wrapped


# ---------------------------------------------------------------------------
# Elementwise

_INFIX = {
    lax.add_p: "+",
    compat.add_any_p: "+",
    lax.sub_p: "-",
    lax.mul_p: "*",
    lax.and_p: "&",
    lax.or_p: "|",
    lax.xor_p: "^",
    lax.eq_p: "==",
    lax.ne_p: "!=",
    lax.lt_p: "<",
    lax.le_p: "<=",
    lax.gt_p: ">",
    lax.ge_p: ">=",
    lax.shift_left_p: "<<",
}


def _wide(rc: RuleContext, fmt: str, *xs: Val) -> Val:
    """``fmt.format(*exprs)``, computed in f32 when the operands are bf16."""

    def rule(rc, *xs):
        return rc.out(fmt.format(*[x.expr for x in xs]))

    return _bf16_via_f32(rule)(rc, *xs)


def _infix_rule(op: str):
    def rule(rc: RuleContext, x, y, **_):
        return _wide(rc, "{} " + op + " {}", x, y)

    return rule


for _p, _op in _INFIX.items():
    register_lowering(_p)(_infix_rule(_op))


@register_lowering(lax.div_p)
def _div_rule(rc: RuleContext, x, y, **_):
    if is_float(x.dtype):
        return _wide(rc, "{} / {}", x, y)
    if _plain_divisor(x, y):
        return rc.out(f"{x.expr} // {y.expr}")  # Triton's // truncates, like lax.div
    # x / 0 is -1 (all ones) as in XLA.
    all_ones = const(rc.em, -1 if is_signed_int(x.dtype) else np.iinfo(x.dtype).max, x.dtype)
    return rc.out(f"tl.where({y.expr} == 0, {all_ones.expr}, {x.expr} // {_safe_divisor(rc, x, y)})")


@register_lowering(lax.rem_p)
def _rem_rule(rc: RuleContext, x, y, **_):
    if is_float(x.dtype):
        return _wide(rc, "{} % {}", x, y)  # C fmod semantics, like lax.rem
    if _plain_divisor(x, y):
        return rc.out(f"{x.expr} % {y.expr}")  # srem, like lax.rem
    # x % 0 is x as in XLA.
    return rc.out(f"tl.where({y.expr} == 0, {x.expr}, {x.expr} % {_safe_divisor(rc, x, y)})")


def _plain_divisor(x: Val, y: Val) -> bool:
    """A divisor known at trace time to be neither 0 nor (signed) -1."""
    return y.static is not None and int(y.static) != 0 and (int(y.static) != -1 or not is_signed_int(x.dtype))


def _safe_divisor(rc: RuleContext, x: Val, y: Val) -> str:
    """``y`` with 1 where the division is undefined on the hardware: by zero,
    and INT_MIN / -1 (whose XLA results, INT_MIN and 0, are x / 1 and x % 1)."""
    one = const(rc.em, 1, y.dtype)
    bad = f"({y.expr} == 0)"
    if is_signed_int(x.dtype):
        lo, m1 = const(rc.em, np.iinfo(x.dtype).min, x.dtype), const(rc.em, -1, y.dtype)
        bad = f"({bad} | (({x.expr} == {lo.expr}) & ({y.expr} == {m1.expr})))"
    return rc.em.assign(f"tl.where({bad}, {one.expr}, {y.expr})", y.shape, y.dtype, "d").expr


def _minmax(fn: str, bool_op: str):
    def rule(rc: RuleContext, x, y, **_):
        if is_bool(x.dtype):
            return rc.out(f"{x.expr} {bool_op} {y.expr}")
        if is_float(x.dtype):
            return _wide(rc, f"tl.{fn}({{}}, {{}}, propagate_nan=tl.PropagateNan.ALL)", x, y)
        return rc.out(f"tl.{fn}({x.expr}, {y.expr})")

    return rule


register_lowering(lax.max_p)(_minmax("maximum", "|"))
register_lowering(lax.min_p)(_minmax("minimum", "&"))


def _shift_right(logical: bool):
    # Triton's >> is arithmetic on signed and logical on unsigned ints: shift
    # the bits reinterpreted with the signedness the primitive asks for.
    def rule(rc: RuleContext, x, y, **_):
        if logical == is_unsigned_int(x.dtype):
            return rc.out(f"{x.expr} >> {y.expr}")
        bits = 8 * x.dtype.itemsize
        as_ = f"tl.{'u' if logical else ''}int{bits}"
        return rc.out(
            f"({x.expr}.to({as_}, bitcast=True) >> {y.expr}.to({as_}, bitcast=True))"
            f".to({tl_dtype(x.dtype)}, bitcast=True)"
        )

    return rule


register_lowering(lax.shift_right_arithmetic_p)(_shift_right(logical=False))
register_lowering(lax.shift_right_logical_p)(_shift_right(logical=True))


# Float functions: primitive -> call (computed in f32 for 16-bit floats).
_FLOAT_FNS = {
    lax.exp_p: "tl.exp",
    lax.exp2_p: "tl.exp2",
    lax.log_p: "tl.log",
    plb.lax_primitive("log2_p"): "tl.log2",  # None on JAX 0.10 (skipped)
    lax.log1p_p: "libdevice.log1p",
    lax.expm1_p: "libdevice.expm1",
    lax.sqrt_p: "tl.sqrt",
    lax.rsqrt_p: "tl.rsqrt",
    lax.cbrt_p: "libdevice.cbrt",
    lax.sin_p: "tl.sin",
    lax.cos_p: "tl.cos",
    lax.tan_p: "libdevice.tan",
    lax.tanh_p: "libdevice.tanh",
    lax.asin_p: "libdevice.asin",
    lax.acos_p: "libdevice.acos",
    lax.atan_p: "libdevice.atan",
    lax.sinh_p: "libdevice.sinh",
    lax.cosh_p: "libdevice.cosh",
    lax.asinh_p: "libdevice.asinh",
    lax.acosh_p: "libdevice.acosh",
    lax.atanh_p: "libdevice.atanh",
    lax.erf_p: "tl.erf",
    lax.erfc_p: "libdevice.erfc",
    lax.lgamma_p: "libdevice.lgamma",
    lax.erf_inv_p: "libdevice.erfinv",
    lax.floor_p: "tl.floor",
    lax.ceil_p: "tl.ceil",
    lax.pow_p: "libdevice.pow",
    lax.atan2_p: "libdevice.atan2",
    lax.nextafter_p: "libdevice.nextafter",
}


def _float_fn(fn: str):
    def rule(rc: RuleContext, *xs, **_):
        if not is_float(xs[0].dtype):
            raise rc.error(f"{fn} needs floating-point operands, got {xs[0].dtype}")
        us = [upcast(rc, x) for x in xs]
        return _finish(rc, f"{fn}({', '.join(u.expr for u in us)})", us[0].dtype)

    return rule


for _p, _fn in _FLOAT_FNS.items():
    register_lowering(_p)(_float_fn(_fn))


@register_lowering(lax.digamma_p)
def _digamma_rule(rc: RuleContext, x, **_):
    # libdevice has no digamma: pallas-core's jnp definition (XLA's approximation).
    if not is_float(x.dtype) or x.dtype == np.float64:
        raise rc.error(f"digamma takes float32, float16 or bfloat16 operands, got {x.dtype}")
    return lower_fun(plb.in_float32(plb.digamma_f32), rc, x)


@register_lowering(lax.logistic_p)
def _logistic_rule(rc: RuleContext, x, **_):
    u = upcast(rc, x)
    return _finish(rc, f"1.0 / (1.0 + tl.exp(-{u.expr}))", u.dtype)


@register_lowering(lax.round_p)
def _round_rule(rc: RuleContext, x, *, rounding_method, **_):
    u = upcast(rc, x)
    fn = (
        "libdevice.rint"
        if int(rounding_method) == int(lax.RoundingMethod.TO_NEAREST_EVEN)
        else "libdevice.round"
    )
    return _finish(rc, f"{fn}({u.expr})", u.dtype)


@register_lowering(lax.is_finite_p)
def _is_finite_rule(rc: RuleContext, x, **_):
    u = upcast(rc, x)
    return rc.out(f"tl.abs({u.expr}) < float('inf')")


@register_lowering(lax.abs_p)
def _abs_rule(rc: RuleContext, x, **_):
    return _wide(rc, "tl.abs({})", x)


@register_lowering(lax.neg_p)
def _neg_rule(rc: RuleContext, x, **_):
    return _wide(rc, "-{}", x)


@register_lowering(lax.not_p)
def _not_rule(rc: RuleContext, x, **_):
    return rc.out(f"~{x.expr}")


@register_lowering(lax.sign_p)
@_bf16_via_f32
def _sign_rule(rc: RuleContext, x, **_):
    one, zero = const(rc.em, 1, x.dtype), const(rc.em, 0, x.dtype)
    if is_unsigned_int(x.dtype):
        return rc.out(f"tl.where({x.expr} > {zero.expr}, {one.expr}, {zero.expr})")
    return rc.out(
        f"tl.where({x.expr} > {zero.expr}, {one.expr}, tl.where({x.expr} < {zero.expr}, -{one.expr}, {x.expr}))"
    )


@register_lowering(lax.square_p)
def _square_rule(rc: RuleContext, x, **_):
    return _wide(rc, "{0} * {0}", x)


@register_lowering(plb.lax_primitive("one_minus_square_p"))  # what jax.grad of tanh emits
def _one_minus_square_rule(rc: RuleContext, x, **_):
    one = const(rc.em, 1, x.dtype)
    return _wide(rc, f"{one.expr} - {{0}} * {{0}}", x)


def _int_bits(rc: RuleContext, what: str, x) -> int:
    if np.dtype(x.dtype).kind not in "iu" or x.dtype.itemsize not in (4, 8):
        raise rc.error(f"{what} takes 32- or 64-bit integers in Triton kernels, got {x.dtype}")
    return 8 * x.dtype.itemsize


def _signed(x) -> str:
    """``x`` as a signed integer of its width (libdevice's bit functions take those)."""
    if not is_unsigned_int(x.dtype):
        return x.expr
    return f"{x.expr}.to(tl.int{8 * x.dtype.itemsize}, bitcast=True)"


@register_lowering(lax.clz_p)
def _clz_rule(rc: RuleContext, x, **_):
    _int_bits(rc, "lax.clz", x)
    return rc.out(f"libdevice.clz({_signed(x)}).to({tl_dtype(x.dtype)})")


@register_lowering(lax.population_count_p)
def _popcount_rule(rc: RuleContext, x, **_):
    _int_bits(rc, "lax.population_count", x)
    return rc.out(f"libdevice.popc({_signed(x)}).to({tl_dtype(x.dtype)})")


@register_lowering(lax.mulhi_p)
def _mulhi_rule(rc: RuleContext, x, y, **_):
    _int_bits(rc, "lax.mulhi", x)
    return rc.out(f"libdevice.mulhi({x.expr}, {y.expr})")


@register_lowering(lax.integer_pow_p)
@_bf16_via_f32
def _integer_pow_rule(rc: RuleContext, x, *, y, **_):
    em = rc.em
    if y == 0:
        return const(em, 1, x.dtype, x.shape)
    acc, base, n = None, x, abs(y)
    while n:  # square-and-multiply
        if n & 1:
            acc = base if acc is None else em.assign(f"{acc.expr} * {base.expr}", x.shape, x.dtype)
        n >>= 1
        if n:
            base = em.assign(f"{base.expr} * {base.expr}", x.shape, x.dtype)
    if y < 0:
        one = const(em, 1, x.dtype)
        # y != 0, so the loop above met a set bit of n and acc is a Val.
        return rc.out(f"{one.expr} / {typing.cast(Val, acc).expr}")
    return acc


@register_lowering(lax.clamp_p)
@_bf16_via_f32
def _clamp_rule(rc: RuleContext, lo, x, hi, **_):
    if is_float(x.dtype):
        nan = "propagate_nan=tl.PropagateNan.ALL"
        return rc.out(f"tl.minimum(tl.maximum({x.expr}, {lo.expr}, {nan}), {hi.expr}, {nan})")
    return rc.out(f"tl.minimum(tl.maximum({x.expr}, {lo.expr}), {hi.expr})")


@register_lowering(lax.select_n_p)
def _select_n_rule(rc: RuleContext, pred, *cases, **_):
    if len(cases) == 1:
        return cases[0]
    if is_bool(pred.dtype):
        return rc.out(f"tl.where({pred.expr}, {cases[1].expr}, {cases[0].expr})")
    expr = cases[-1].expr
    for i in range(len(cases) - 2, -1, -1):
        expr = f"tl.where({pred.expr} == {i}, {cases[i].expr}, {expr})"
    return rc.out(expr)


@register_lowering(lax.convert_element_type_p)
def _convert_rule(rc: RuleContext, x, *, new_dtype, **_):
    return cast(rc.em, x, new_dtype)


@register_lowering(lax.bitcast_convert_type_p)
def _bitcast_rule(rc: RuleContext, x, *, new_dtype, **_):
    if np.dtype(new_dtype).itemsize != x.dtype.itemsize:
        raise rc.error("bitcast_convert_type between dtypes of different widths is not supported")
    return rc.out(f"{x.expr}.to({tl_dtype(new_dtype)}, bitcast=True)")


@register_lowering(lax.copy_p)
def _copy_rule(rc: RuleContext, x, **_):
    return x


# ---------------------------------------------------------------------------
# GPU-only elementwise primitives


@register_lowering(gpu_primitives.approx_tanh_p)
def _approx_tanh_rule(rc: RuleContext, x):
    # ``_approx_tanh`` comes from the module preamble: PTX tanh.approx.f32 on
    # the GPU, libdevice tanh under Triton's interpreter (which runs no PTX).
    u = upcast(rc, x)
    return _finish(rc, f"_approx_tanh({u.expr})", u.dtype)


@register_lowering(gpu_primitives.elementwise_inline_asm_p)
def _inline_asm_rule(rc: RuleContext, *args, asm, constraints, pack, result_shape_dtypes):
    kl, em = rc.lowering, rc.em
    kl.gpu_only.append(f"plgpu.elementwise_inline_asm at {kl.source_line(rc.eqn)}")
    dtypes = [tl_dtype(r.dtype) for r in result_shape_dtypes]
    dtype = dtypes[0] if len(dtypes) == 1 else f"({', '.join(dtypes)},)"
    operands = ", ".join(a.expr for a in args)
    expr = (
        f"tl.inline_asm_elementwise({asm!r}, {constraints!r}, [{operands}], dtype={dtype}, "
        f"is_pure=True, pack={pack})"
    )
    if len(dtypes) == 1:
        return [rc.out(expr, hint="asm")]
    names = [em.fresh("asm") for _ in dtypes]
    em.emit(f"{', '.join(names)} = {expr}")
    return [Val(n, a.shape, a.dtype) for n, a in zip(names, rc.avals_out)]


@register_lowering(gpu_primitives.max_contiguous_p)
def _max_contiguous_rule(rc: RuleContext, x, *, values):
    if x.shape == ():
        return x
    # A dim held padded (to a power of two) has garbage past its end: runs there
    # are not known, and the hint holds for the held tensor only as 1.
    values = [v if next_pow2(n) == n else 1 for v, n in zip(values, x.shape)]
    return rc.out(f"tl.max_contiguous({x.expr}, {values})")
