"""JAX 0.12's MXU ops: ``pltpu.matmul_push_rhs``, ``matmul_lhs_fifo`` and
``matmul_pop_fifo`` (chips whose MXUs return results through a FIFO: v4, v5e, v5p,
v6e), ``matmul_acc_lhs`` and ``matmul_pop`` into ``pltpu.ACC`` accumulators (TPU7x).

Each kernel runs against a jnp reference on fresh random data, the ways of tests/ways
for one chip generation (``way.with_params(chip=...)``): in TPU interpret mode
(``InterpretParams(chip_version=...)``: the MXU model of ``interpret/mxu.py``); our
lowering exported for that chip and run by ``run_mosaic`` (``executor/mxu_state.py``);
our lowering compiled by libtpu for that chip, then run so; and compiled for every chip
that has the op (what Mosaic refuses on the others is asserted too). JAX's interpret
mode has no rule for these ops and JAX 0.11 has no such names, so there is no JAX
result to compare with. Every bad input has a test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jaxlib.mosaic.python import tpu as mosaic_tpu
from ways import every_way
from ways.mosaic import abstract_mesh

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.executor import run as executor
from pallas_tpu._src.language import tpu_info
from pallas_tpu._src.mosaic import compile_check

FIFO_CHIPS = ("v5e", "v6e")  # interpreted and run_mosaic'd; compiled: every FIFO chip below
FIFO_COMPILE_CHIPS = ("v4", "v5e", "v5p", "v6e")
HAS_FIFO_OPS = hasattr(mosaic_tpu, "matmul_lhs_fifo")  # jaxlib >= 0.11.2


def _k(chip):
    return tpu_info.get_tpu_info(chip).mxu_column_size


def rand(seed, shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        hi = 8 if jnp.dtype(dtype).itemsize * 8 > 4 and dtype != jnp.int4 else 4
        return jax.random.randint(jax.random.key(seed), shape, -hi, hi, jnp.int32).astype(dtype)
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def ref_dot(a, b):
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.asarray(a, np.int64) @ np.asarray(b, np.int64)
    return np.asarray(a.astype(jnp.float32), np.float64) @ np.asarray(b.astype(jnp.float32), np.float64)


def _mesh(chip):
    return jax.sharding.use_abstract_mesh(abstract_mesh(1, chip))


# -- the result FIFO ----------------------------------------------------------------------


def fifo_kernel(x, w1, w2, *, interpret, out_dtype=jnp.float32, reg2=1):
    """Two RHS staged in turn (the second transposed, pushed while the MXU multiplies
    with the first: v5e holds one staged RHS at a time), three LHS through the FIFO (the
    second with the weights of the first still loaded, the third loading the second
    RHS), popped in order: ``x @ w1 + 2 * (x @ w1) - x @ w2.T`` in parts."""
    k = w1.shape[1]

    def kernel(x_ref, w1_ref, w2_ref, o_ref):
        pltpu.matmul_push_rhs(w1_ref[...], 0, 0)
        pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)
        pltpu.matmul_push_rhs(w2_ref[...], reg2, 0, transpose=True)
        pltpu.matmul_lhs_fifo(x_ref[...], 0)
        pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=reg2)
        a = pltpu.matmul_pop_fifo((x.shape[0], k), out_dtype, 0)
        b = pltpu.matmul_pop_fifo((x.shape[0], k), out_dtype, 0)
        c = pltpu.matmul_pop_fifo((x.shape[0], k), out_dtype, 0)
        o_ref[...] = a + 2 * b - c

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], k), out_dtype), interpret=interpret
    )(x, w1, w2)


# tests/ways' ways of a kernel written against our modules only (JAX 0.11 has no such names
# and its interpret mode no rule for them): tpu_interpret, mosaic, compiled (ours alone), each
# for one chip generation (``way.with_params(chip=...)``).
FIFO_WAYS = every_way(op=True)


def skip_without_fifo_ops(way):
    if way.name != "tpu_interpret" and not HAS_FIFO_OPS:
        pytest.skip(
            f"jaxlib {jax.__version__} has no tpu.matmul_lhs_fifo (0.11.2 has): test_old_jaxlib_error"
        )


def _fifo_cases():
    for chip in FIFO_CHIPS:
        for dtype in (jnp.bfloat16, jnp.float32, jnp.int8):
            yield pytest.param(chip, dtype, id=f"{chip}-{jnp.dtype(dtype).name}")


@FIFO_WAYS
@pytest.mark.parametrize("chip,dtype", list(_fifo_cases()))
def test_fifo_matmul(chip, dtype, way):
    way = way.with_params(chip=chip)
    skip_without_fifo_ops(way)
    k = _k(chip)
    m = 32
    x, w1, w2 = rand(0, (m, k), dtype), rand(1, (k, k), dtype), rand(2, (k, k), dtype)
    out_dtype = jnp.int32 if dtype == jnp.int8 else jnp.float32
    interpret = way.interpret() or False
    y = way.jit(lambda *a: fifo_kernel(*a, interpret=interpret, out_dtype=out_dtype))(x, w1, w2)
    want = 3 * ref_dot(x, w1) - ref_dot(x, w2.T)
    assert y.dtype == out_dtype
    if out_dtype == jnp.int32:
        np.testing.assert_array_equal(np.asarray(y), want.astype(np.int32))
    else:
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("chip", FIFO_COMPILE_CHIPS + ("7x",))
def test_fifo_ops_compile_where_the_chip_has_them(chip):
    """libtpu compiles the FIFO kernel for v4, v5e, v5p and v6e (bfloat16); TPU7x has
    accumulators instead: ours refuses the FIFO ops there at trace time, naming them."""
    if not compile_check.libtpu_available():
        pytest.skip('needs libtpu: pip install "jax[tpu]"')
    if not HAS_FIFO_OPS:
        pytest.skip(f"jaxlib {jax.__version__} has no tpu.matmul_lhs_fifo (0.11.2 has)")
    k = _k(chip)
    args = (rand(3, (16, k), jnp.bfloat16), rand(4, (k, k), jnp.bfloat16), rand(5, (k, k), jnp.bfloat16))
    g = jax.jit(
        lambda *a: fifo_kernel(*a, interpret=False, reg2=0 if chip == "v4" else 1)
    )  # v4: one register
    if chip == "7x":
        with pytest.raises(
            ValueError, match=r"matmul_lhs_fifo: TPU 7x's MXUs have accumulators, not a result FIFO"
        ):
            with _mesh(chip):
                compile_check.compile_for(g, args, chip)
        return
    with _mesh(chip):
        compile_check.compile_for(g, args, chip)


@FIFO_WAYS
@pytest.mark.parametrize("chip", FIFO_CHIPS)
def test_sub_byte_fifo_matmul(chip, way):
    """int4: the contraction is 2K deep (RHS 2K x K, LHS M x 2K)."""
    way = way.with_params(chip=chip)
    skip_without_fifo_ops(way)
    k = _k(chip)
    x, w = rand(6, (64, 2 * k), jnp.int4), rand(7, (2 * k, k), jnp.int4)

    def f(x, w, interpret):
        def kernel(x_ref, w_ref, o_ref):
            pltpu.matmul_push_rhs(w_ref[...], 1, 1)
            pltpu.matmul_lhs_fifo(x_ref[...], 1, load_staged_rhs=1)
            o_ref[...] = pltpu.matmul_pop_fifo((64, k), jnp.int32, 1)

        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((64, k), jnp.int32), interpret=interpret
        )(x, w)

    interpret = way.interpret() or False
    y = way.jit(lambda x, w: f(x, w, interpret))(x, w)
    np.testing.assert_array_equal(np.asarray(y), ref_dot(x, w).astype(np.int32))


# -- accumulators (TPU7x) -------------------------------------------------------------------


def acc_kernel(x, w, *, interpret):
    """``acc += x @ w`` twice (the second reuses the loaded weights), on MXU 1, then a
    second accumulator on MXU 0 of ``x[:32] @ w``: both popped."""
    k = w.shape[1]

    def kernel(x_ref, w_ref, o_ref, o2_ref):
        def body(acc, acc2):
            pltpu.matmul_push_rhs(w_ref[...], 1, 1)
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_acc_lhs(acc, x_ref[...], load_staged_rhs=1)
            pltpu.matmul_acc_lhs(acc, x_ref[...])
            pltpu.matmul_acc_lhs(acc2, x_ref[:32, :], load_staged_rhs=0)
            o_ref[...] = pltpu.matmul_pop(acc)
            o2_ref[...] = pltpu.matmul_pop(acc2)

        pl.run_scoped(body, pltpu.ACC(1)((x.shape[0], k), jnp.float32), pltpu.ACC(0)((32, k), jnp.float32))

    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((x.shape[0], k), jnp.float32),
            jax.ShapeDtypeStruct((32, k), jnp.float32),
        ),
        interpret=interpret,
    )(x, w)


@FIFO_WAYS
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn])
def test_accumulator_matmul(dtype, way):
    way, k = way.with_params(chip="7x"), _k("7x")
    x, w = rand(10, (64, k), dtype), rand(11, (k, k), dtype)
    interpret = way.interpret() or False
    y, y2 = way.jit(lambda x, w: acc_kernel(x, w, interpret=interpret))(x, w)
    np.testing.assert_allclose(np.asarray(y), 2 * ref_dot(x, w), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(y2), ref_dot(x[:32], w), rtol=1e-5, atol=1e-3)


# -- errors ------------------------------------------------------------------------------


def _fifo_call(body, chip="v5e", m=16, out_dtype=jnp.float32, **params):
    k = _k(chip)
    x, w = rand(20, (m, k), jnp.bfloat16), rand(21, (k, k), jnp.bfloat16)

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = body(x_ref, w_ref, k)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, k), out_dtype),
        interpret=pltpu.InterpretParams(chip_version=chip, **params),
    )(x, w)


def _raises_at_run(match, body, **kw):
    pltpu.reset_tpu_interpret_mode_state()
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda: _fifo_call(body, **kw))())
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.interpret_only(reason="the interpreter's run-time checks of the MXU model")
class TestRunTimeErrors:
    def test_push_to_a_full_staging_register(self):
        def body(x_ref, w_ref, k):
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)
            return pltpu.matmul_pop_fifo((16, k), jnp.float32, 0)

        _raises_at_run(r"matmul_push_rhs on MXU 0: staging register 0 still holds an RHS", body)

    def test_v5e_holds_one_staged_rhs(self):
        """Mosaic: "Cannot schedule FIFO push instruction when the FIFO is full" (v5e, v5p)."""

        def body(x_ref, w_ref, k):
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_push_rhs(w_ref[...], 1, 0)
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=1)
            return pltpu.matmul_pop_fifo((16, k), jnp.float32, 0) + pltpu.matmul_pop_fifo(
                (16, k), jnp.float32, 0
            )

        _raises_at_run(r"TPU v5e's MXU holds 1 staged RHS at a time .* and 1 is staged already", body)

    def test_load_an_empty_staging_register(self):
        def body(x_ref, w_ref, k):
            pltpu.matmul_lhs_fifo(x_ref[...], 2, load_staged_rhs=1)
            return pltpu.matmul_pop_fifo((16, k), jnp.float32, 2)

        _raises_at_run(r"matmul_lhs_fifo on MXU 2: load_staged_rhs=1 but staging register 1 is empty", body)

    def test_matmul_without_weights(self):
        def body(x_ref, w_ref, k):
            pltpu.matmul_lhs_fifo(x_ref[...], 0)
            return pltpu.matmul_pop_fifo((16, k), jnp.float32, 0)

        _raises_at_run(r"loaded weights have 0 rows \(0: none loaded", body)

    def test_pop_more_than_the_fifo_holds(self):
        def body(x_ref, w_ref, k):
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)
            a = pltpu.matmul_pop_fifo((16, k), jnp.float32, 0)
            return a + pltpu.matmul_pop_fifo((16, k), jnp.float32, 0)

        _raises_at_run(r"matmul_pop_fifo on MXU 0: popping 16 rows but the result FIFO holds 0", body)

    def test_pop_an_int_result_as_float(self):
        k = _k("v5e")
        x, w = rand(22, (32, k), jnp.int8), rand(23, (k, k), jnp.int8)

        def kernel(x_ref, w_ref, o_ref):
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)
            o_ref[...] = pltpu.matmul_pop_fifo((32, k), jnp.float32, 0)

        f = pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((32, k), jnp.float32), interpret=pltpu.InterpretParams()
        )
        pltpu.reset_tpu_interpret_mode_state()
        with pytest.raises(Exception, match=r"popping float32 results but the FIFO holds int32 ones"):
            jax.block_until_ready(jax.jit(f)(x, w))
        pltpu.reset_tpu_interpret_mode_state()

    def test_fifo_overflow(self):
        def body(x_ref, w_ref, k):
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)

            def loop(i, c):
                pltpu.matmul_lhs_fifo(x_ref[...], 0)
                return c

            jax.lax.fori_loop(0, 40, loop, 0)
            return pltpu.matmul_pop_fifo((16, k), jnp.float32, 0)

        _raises_at_run(r"the result FIFO overflows: it holds 512 rows and this matmul adds 16", body)

    def test_kernel_ends_with_a_full_staging_register(self):
        def body(x_ref, w_ref, k):
            pltpu.matmul_push_rhs(w_ref[...], 1, 3)
            return jnp.zeros((16, k), jnp.float32)

        _raises_at_run(r"ends with 1 MXU staging register\(s\) still holding an RHS", body)

    def test_kernel_ends_with_rows_in_the_fifo(self):
        def body(x_ref, w_ref, k):
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_lhs_fifo(x_ref[...], 0, load_staged_rhs=0)
            return jnp.zeros((16, k), jnp.float32)

        _raises_at_run(r"ends with 16 rows of results in the MXU result FIFOs", body)

    def test_accumulator_not_popped(self):
        k = _k("7x")
        x, w = rand(24, (16, k), jnp.bfloat16), rand(25, (k, k), jnp.bfloat16)

        def kernel(x_ref, w_ref, o_ref):
            def body(acc):
                pltpu.matmul_push_rhs(w_ref[...], 0, 0)
                pltpu.matmul_acc_lhs(acc, x_ref[...], load_staged_rhs=0)

            pl.run_scoped(body, pltpu.ACC(0)((16, k), jnp.float32))
            o_ref[...] = jnp.zeros_like(o_ref)

        f = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16, k), jnp.float32),
            interpret=pltpu.InterpretParams(chip_version="7x"),
        )
        pltpu.reset_tpu_interpret_mode_state()
        with pytest.raises(
            Exception, match=r"accumulator .* holds \d+ nonzero values when its pl.run_scoped ends"
        ):
            jax.block_until_ready(jax.jit(f)(x, w))
        pltpu.reset_tpu_interpret_mode_state()


def _trace(body, chip="v5e", m=16):
    """Traces a kernel calling ``body(x_ref, w_ref, k)`` for ``chip`` (interpret mode)."""
    return jax.jit(lambda: _fifo_call(body, chip=chip, m=m)).lower()


class TestTraceTimeErrors:
    def test_staging_register_out_of_range(self):
        with pytest.raises(
            ValueError, match=r"matmul_push_rhs: staging_register must be in \[0, 2\) on TPU v5e, got 2"
        ):
            _trace(lambda x, w, k: pltpu.matmul_push_rhs(w[...], 2, 0))

    def test_v4_has_one_staging_register(self):
        with pytest.raises(ValueError, match=r"staging_register must be in \[0, 1\) on TPU v4, got 1"):
            _trace(lambda x, w, k: pltpu.matmul_push_rhs(w[...], 1, 0), chip="v4")

    def test_mxu_index_out_of_range(self):
        with pytest.raises(
            ValueError, match=r"matmul_push_rhs: mxu_index must be in \[0, 2\) on TPU v6e, got 2"
        ):
            _trace(lambda x, w, k: pltpu.matmul_push_rhs(w[...], 0, 2), chip="v6e")

    def test_mxu_index_not_an_int(self):
        with pytest.raises(TypeError, match=r"matmul_lhs_fifo: mxu_index must be a static int, got 0.5"):
            _trace(lambda x, w, k: pltpu.matmul_lhs_fifo(x[...], 0.5))

    def test_rhs_shape(self):
        with pytest.raises(
            ValueError, match=r"matmul_push_rhs: rhs must be 128 x 128 .* got bfloat16\[64, 128\]"
        ):
            _trace(lambda x, w, k: pltpu.matmul_push_rhs(w[:64, :], 0, 0))

    def test_lhs_shape(self):
        with pytest.raises(
            ValueError, match=r"matmul_lhs_fifo: lhs must be M x 128 .* got bfloat16\[16, 64\]"
        ):
            _trace(lambda x, w, k: pltpu.matmul_lhs_fifo(x[:, :64], 0))

    def test_lhs_rows(self):
        with pytest.raises(ValueError, match=r"lhs rows M must be a positive multiple of 16 .* got 8"):
            _trace(lambda x, w, k: pltpu.matmul_lhs_fifo(x[:8, :], 0))

    def test_load_staged_rhs_true(self):
        with pytest.raises(
            TypeError, match=r"load_staged_rhs must be an integer or None \(True would name register 1\)"
        ):
            _trace(lambda x, w, k: pltpu.matmul_lhs_fifo(x[...], 0, load_staged_rhs=True))

    def test_transpose_not_a_bool(self):
        with pytest.raises(TypeError, match=r"matmul_push_rhs: transpose must be True or False, got 'yes'"):
            _trace(lambda x, w, k: pltpu.matmul_push_rhs(w[...], 0, 0, transpose="yes"))

    def test_pop_fifo_dtype(self):
        with pytest.raises(
            ValueError, match=r"matmul_pop_fifo: the result FIFO holds float32 or int32 results, got bfloat16"
        ):
            _trace(lambda x, w, k: pltpu.matmul_pop_fifo((16, k), jnp.bfloat16, 0))

    def test_pop_fifo_shape(self):
        with pytest.raises(ValueError, match=r"matmul_pop_fifo: shape must be \(M, 128\) .* got \(16, 64\)"):
            _trace(lambda x, w, k: pltpu.matmul_pop_fifo((16, 64), jnp.float32, 0))

    def test_int32_operands(self):
        with pytest.raises(
            TypeError, match=r"integer operands of the MXU are int8 or int4, got rhs of int32"
        ):
            _trace(lambda x, w, k: pltpu.matmul_push_rhs(w[...].astype(jnp.int32), 0, 0))

    def test_type_the_chip_lacks(self):
        """Mosaic refuses int8 operands on v4 and TPU7x: ours says so at trace time."""
        with pytest.raises(
            TypeError, match=r"the MXUs of TPU v4 take float32, bfloat16 operands, got rhs of int8"
        ):
            _trace(lambda x, w, k: pltpu.matmul_push_rhs(w[...].astype(jnp.int8), 0, 0), chip="v4")

    def test_fifo_ops_on_a_chip_with_accumulators(self):
        with pytest.raises(
            ValueError, match=r"matmul_pop_fifo: TPU 7x's MXUs have accumulators, not a result FIFO"
        ):
            _trace(lambda x, w, k: pltpu.matmul_pop_fifo((16, k), jnp.float32, 0), chip="7x")

    def test_acc_on_a_chip_without_accumulators(self):
        with pytest.raises(ValueError, match=r"pltpu.ACC: accumulators are not available on TPU v5e"):

            def body(x, w, k):
                pl.run_scoped(lambda acc: None, pltpu.ACC(0)((16, k), jnp.float32))
                return jnp.zeros((16, k), jnp.float32)

            _trace(body)

    @pytest.mark.parametrize(
        "args,match",
        [
            (
                (0, (16, 128), jnp.float32),
                r"minor dimension of an accumulator Ref must be the MXU's width 256",
            ),
            ((0, (12, 256), jnp.float32), r"positive multiple of 8 \(the sublanes\), got 12"),
            ((0, (16, 256), jnp.bfloat16), r"an accumulator holds float32 or int32, got bfloat16"),
            ((2, (16, 256), jnp.float32), r"mxu_id must be in \[0, 2\) on TPU 7x, got 2"),
            ((0, (256,), jnp.float32), r"an accumulator Ref is at least 2-D"),
        ],
    )
    def test_acc_ref_types(self, args, match):
        mxu, shape, dtype = args
        with tpu_info.modeled_chip("7x"), pytest.raises(ValueError, match=match):
            pltpu.ACC(mxu)(shape, dtype)

    def test_acc_mxu_id_not_an_int(self):
        with pytest.raises(TypeError, match=r"pltpu.ACC: mxu_id must be an int, got '0'"):
            pltpu.ACC("0")

    def _acc_kernel(self, body, dtype=jnp.bfloat16):
        k = _k("7x")
        x, w = rand(26, (16, k), dtype), rand(27, (k, k), dtype)

        def kernel(x_ref, w_ref, o_ref):
            o_ref[...] = pl.run_scoped(
                lambda acc: body(acc, x_ref, w_ref), pltpu.ACC(0)((16, k), jnp.float32)
            )

        f = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((16, k), jnp.float32),
            interpret=pltpu.InterpretParams(chip_version="7x"),
        )
        return jax.jit(f).lower(x, w)

    def test_acc_lhs_needs_an_acc_ref(self):
        def body(acc, x_ref, w_ref):
            pltpu.matmul_acc_lhs(w_ref, x_ref[...])
            return pltpu.matmul_pop(acc)

        with pytest.raises(
            TypeError, match=r"matmul_acc_lhs: acc must be a Ref in an MXU's accumulator memory"
        ):
            self._acc_kernel(body)

    def test_acc_lhs_rows_must_match(self):
        def body(acc, x_ref, w_ref):
            pltpu.matmul_push_rhs(w_ref[...], 0, 0)
            pltpu.matmul_acc_lhs(acc, jnp.concatenate([x_ref[...], x_ref[...]]), load_staged_rhs=0)
            return pltpu.matmul_pop(acc)

        with pytest.raises(
            ValueError, match=r"acc must be M x K with the lhs's M rows: acc \[16, 256\], lhs \[32, 256\]"
        ):
            self._acc_kernel(body)

    def test_acc_lhs_view_refused(self):
        def body(acc, x_ref, w_ref):
            pltpu.matmul_acc_lhs(acc.at[:8], x_ref[:8], load_staged_rhs=0)
            return pltpu.matmul_pop(acc)

        with pytest.raises(
            NotImplementedError, match=r"acc must be a whole accumulator Ref \(no .at\[...\] view\)"
        ):
            self._acc_kernel(body, dtype=jnp.float32)

    def test_type_7x_lacks(self):
        def body(acc, x_ref, w_ref):
            pltpu.matmul_acc_lhs(acc, x_ref[...].astype(jnp.float8_e5m2).astype(jnp.int8), load_staged_rhs=0)
            return pltpu.matmul_pop(acc)

        with pytest.raises(TypeError, match=r"the MXUs of TPU 7x take .* got lhs of int8"):
            self._acc_kernel(body)

    def test_acc_read_directly(self):
        def body(acc, x_ref, w_ref):
            return acc[...]

        with pytest.raises(
            ValueError, match=r"not read or written directly.*Loading from an accumulator is not supported"
        ):
            self._acc_kernel(body)

    def test_acc_as_scratch_refused(self):
        with tpu_info.modeled_chip("7x"):
            scratch = pltpu.ACC(0)((16, 256), jnp.float32)
        f = pl.pallas_call(
            lambda o_ref, acc: None,
            out_shape=jax.ShapeDtypeStruct((16, 256), jnp.float32),
            scratch_shapes=[scratch],
            interpret=pltpu.InterpretParams(chip_version="7x"),
        )
        with pytest.raises(
            ValueError,
            match=r"scratch_shapes\[0\]: an MXU accumulator \(pltpu.ACC\) is allocated with pl.run_scoped",
        ):
            jax.jit(f).lower()


def test_old_jaxlib_error_or_op_emitted():
    """jaxlib < 0.11.2 has no tpu.matmul_lhs_fifo: lowering one names the release that
    has it. Newer: the module holds the op."""
    k = _k("v5e")
    args = (rand(30, (16, k), jnp.bfloat16), rand(31, (k, k), jnp.bfloat16), rand(32, (k, k), jnp.bfloat16))
    g = jax.jit(lambda *a: fifo_kernel(*a, interpret=False))
    if not HAS_FIFO_OPS:
        with (
            _mesh("v5e"),
            pytest.raises(
                Exception,
                match=r"pltpu.matmul_lhs_fifo \(tpu.matmul_lhs_fifo\) needs Mosaic's support from JAX/jaxlib >= 0.11.2",
            ),
        ):
            export.export(g, platforms=["tpu"])(*args)
        return
    with _mesh("v5e"):
        txt = export.export(g, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in txt
    (module,) = executor.custom_call_bodies(txt)
    assert module  # the module run_mosaic takes; its ops are checked by test_fifo_matmul
