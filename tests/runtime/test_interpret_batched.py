"""The shared Triton interpreter runs many programs in one pass (a program
axis on every program-dependent value) and falls back to one program at a
time where that could differ: every kernel here is checked against ``jnp`` /
NumPy, batched and one by one (``JAX_KERNEL_RUNTIME_INTERPRET_BATCH=1``), and
a spy on the passes says which path ran."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import jax_triton as jt  # noqa: E402
from jax_kernel_runtime.triton import _batched, _interpret  # noqa: E402


@pytest.fixture
def passes(monkeypatch):
    """The outcome (True: batched) of every pass the interpreter tried."""
    seen: list[bool] = []
    original = _batched.run_chunk

    def spy(rewritten, call_args, coords):
        out = original(rewritten, call_args, coords)
        seen.append(out[0])
        return out

    monkeypatch.setattr(_batched, "run_chunk", spy)
    return seen


@pytest.fixture(params=["batched", "one_by_one"])
def mode(request, monkeypatch):
    if request.param == "one_by_one":
        monkeypatch.setenv("JAX_KERNEL_RUNTIME_INTERPRET_BATCH", "1")
    return request.param


def rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@triton.jit
def axpy_kernel(x_ptr, y_ptr, n, a, o_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask, other=1.0)
    tl.store(o_ptr + offs, a * x + tl.exp(y) / (1.0 + tl.abs(y)), mask=mask)


def test_elementwise_kernel_runs_batched(passes, mode):
    n = 37 * 64 - 5  # a masked tail in the last program
    x, y = rand((n,), 0), rand((n,), 1)
    out = jt.triton_call(x, y, n, 1.5, kernel=axpy_kernel, out_shape=x, grid=37, BLOCK=64)
    want = 1.5 * x + jnp.exp(y) / (1.0 + jnp.abs(y))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    if mode == "batched":
        assert passes and all(passes)  # 16 programs, then the other 21 in one pass
        assert len(passes) == 2
    else:
        assert passes == []


@triton.jit
def grid_ids_kernel(o_ptr):
    x, y, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n1, n2 = tl.num_programs(1), tl.num_programs(2)
    tl.store(o_ptr + (x * n1 + y) * n2 + z, x * 100 + y * 10 + z)


def test_three_dimensional_grid_program_ids(passes, mode):
    out = jt.triton_call(
        kernel=grid_ids_kernel, out_shape=jax.ShapeDtypeStruct((5, 3, 4), jnp.int32), grid=(5, 3, 4)
    )
    i, j, k = np.meshgrid(np.arange(5), np.arange(3), np.arange(4), indexing="ij")
    np.testing.assert_array_equal(out, i * 100 + j * 10 + k)
    assert all(passes) and (mode == "one_by_one") == (passes == [])


@triton.jit
def rows_kernel(x_ptr, w_ptr, sum_ptr, max_ptr, arg_ptr, cum_ptr, dot_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    r = tl.arange(0, 8)[:, None]
    c = tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + row * 8 * N + r * N + c)  # an 8 x N tile per program
    tl.store(sum_ptr + row * 8 + tl.arange(0, 8), tl.sum(x, axis=1))
    tl.store(max_ptr + row, tl.max(x))
    tl.store(arg_ptr + row * N + tl.arange(0, N), tl.argmax(x, axis=0))
    tl.store(cum_ptr + row * 8 * N + r * N + c, tl.cumsum(x, axis=1))
    w = tl.load(w_ptr + tl.arange(0, N)[:, None] * 8 + tl.arange(0, 8)[None, :])  # N x 8, shared
    tl.store(dot_ptr + row * 64 + r * 8 + tl.arange(0, 8)[None, :], tl.dot(x, w))
    tl.store(dot_ptr + row * 64 + r * 8 + tl.arange(0, 8)[None, :], tl.dot(x, w).T.T)


def test_reductions_scans_and_dots(passes, mode):
    rows, n = 24, 16
    x, w = rand((rows, 8, n), 2), rand((n, 8), 3)
    shapes = [
        jax.ShapeDtypeStruct((rows, 8), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
        jax.ShapeDtypeStruct((rows, n), jnp.int32),
        jax.ShapeDtypeStruct((rows, 8, n), jnp.float32),
        jax.ShapeDtypeStruct((rows, 8, 8), jnp.float32),
    ]
    s, m, a, c, d = jt.triton_call(x, w, kernel=rows_kernel, out_shape=shapes, grid=rows, N=n)
    np.testing.assert_allclose(s, x.sum(2), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(m, x.max((1, 2)))
    np.testing.assert_array_equal(a, x.argmax(1))
    np.testing.assert_allclose(c, jnp.cumsum(x, 2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d, jnp.einsum("rik,kj->rij", x, w), rtol=1e-4, atol=1e-4)
    assert all(passes) and (mode == "one_by_one") == (passes == [])


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _nan_max(a, b):
    """A docstring does not hide the one operation."""
    return tl.maximum(b, a, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _plain_max(a, b):  # NaN handling differs between Triton releases: ints only
    return tl.maximum(a, b)


@triton.jit
def _sub_abs(a, b):  # not one commutative ufunc: Triton's generic reduction
    return tl.abs(a - b)


@triton.jit
def combine_kernel(
    x_ptr, i_ptr, sum_ptr, max_ptr, xor_ptr, cum_ptr, prod_ptr, gen_ptr, imax_ptr, fmax_ptr, N: tl.constexpr
):
    row = tl.program_id(0)
    r = tl.arange(0, 8)[:, None]
    c = tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + row * 8 * N + r * N + c)
    i = tl.load(i_ptr + row * 8 * N + r * N + c)
    tl.store(sum_ptr + row * 8 + tl.arange(0, 8), tl.reduce(x, 1, _add))
    tl.store(max_ptr + row * N + tl.arange(0, N), tl.reduce(x, 0, _nan_max))
    tl.store(xor_ptr + row, tl.reduce(i, None, _xor))
    tl.store(cum_ptr + row * 8 * N + r * N + c, tl.associative_scan(x, 1, _add, reverse=True))
    tl.store(prod_ptr + row * 8 * N + r * N + c, tl.associative_scan(i, 1, _mul))
    tl.store(gen_ptr + row * 8 + tl.arange(0, 8), tl.reduce(x, 1, _sub_abs))
    tl.store(imax_ptr + row * 8 + tl.arange(0, 8), tl.reduce(i, 1, _plain_max))
    tl.store(fmax_ptr + row * 8 + tl.arange(0, 8), tl.reduce(x, 1, _plain_max))


def test_reductions_and_scans_by_user_combine_functions(passes, mode, monkeypatch):
    """Combine functions of one ufunc (``jax_kernel_runtime.triton._combine``) reduce and scan
    with NumPy, batched and one by one; NaN propagates through ``tl.maximum``
    with ``PropagateNan.ALL`` as in the interpreter's own call of it; int32
    products wrap; any other combine function keeps Triton's generic path."""
    from triton.runtime import interpreter

    generic = []  # the combine functions Triton's per-element reduction and scan ran
    for cls, name in ((interpreter.ReduceOps, "generic_reduce"), (interpreter.ScanOps, "generic_scan")):
        original = getattr(cls, name)

        def spy(self, input, original=original):
            generic.append(self.combine_fn.__name__)
            return original(self, input)

        monkeypatch.setattr(cls, name, spy)
    rows, n = 12, 16
    x = np.array(rand((rows, 8, n), 4))
    x[3, 5, 7] = np.nan
    i = np.array(jax.random.randint(jax.random.key(5), (rows, 8, n), -(2**31), 2**31 - 1, jnp.int32))
    f32, i32 = jnp.float32, jnp.int32
    shapes = [
        jax.ShapeDtypeStruct((rows, 8), f32),
        jax.ShapeDtypeStruct((rows, n), f32),
        jax.ShapeDtypeStruct((rows,), i32),
        jax.ShapeDtypeStruct((rows, 8, n), f32),
        jax.ShapeDtypeStruct((rows, 8, n), i32),
        jax.ShapeDtypeStruct((rows, 8), f32),
        jax.ShapeDtypeStruct((rows, 8), i32),
        jax.ShapeDtypeStruct((rows, 8), f32),
    ]
    s, m, xr, cum, prod, gen, imax, fmax = jt.triton_call(
        jnp.asarray(x), jnp.asarray(i), kernel=combine_kernel, out_shape=shapes, grid=rows, N=n
    )
    ok = ~np.isnan(x).any(2)
    np.testing.assert_allclose(np.asarray(s)[ok], x.sum(2)[ok], rtol=1e-5, atol=1e-5)
    assert np.isnan(np.asarray(s)[~ok]).all()
    np.testing.assert_array_equal(m, np.maximum.reduce(x, axis=1))  # NaN at [3, 7]
    assert np.isnan(np.asarray(m)[3, 7])
    np.testing.assert_array_equal(xr, np.bitwise_xor.reduce(i.reshape(rows, -1), axis=1))
    want_cum = np.flip(np.cumsum(np.flip(x, 2), 2), 2)
    np.testing.assert_allclose(np.asarray(cum)[ok], want_cum[ok], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(prod, np.multiply.accumulate(i, axis=2, dtype=np.int32))
    # _sub_abs folds left to right: |...||x0 - x1| - x2| ...|
    want_gen = np.abs(x[..., 0] - x[..., 1])
    for k in range(2, n):
        want_gen = np.abs(want_gen - x[..., k])
    np.testing.assert_allclose(np.asarray(gen)[ok], want_gen[ok], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(imax, i.max(2))
    np.testing.assert_array_equal(np.asarray(fmax)[ok], x.max(2)[ok])
    # _sub_abs cannot run batched: every pass was abandoned, and the launch ran one by one.
    assert not any(passes) and (mode == "one_by_one") == (passes == [])
    # Once per program each, the others never element by element.
    assert generic == ["_sub_abs", "_plain_max"] * rows


def test_combine_ufunc_recognizes_one_operation_only():
    from jax_kernel_runtime.triton._combine import combine_ufunc

    assert combine_ufunc(_add) is np.add
    assert combine_ufunc(_nan_max) is np.maximum
    assert combine_ufunc(_xor) is np.bitwise_xor
    assert combine_ufunc(_mul) is np.multiply
    assert combine_ufunc(_plain_max) is np.maximum  # (taken on integers only)
    assert combine_ufunc(_sub_abs) is None
    assert combine_ufunc(tl.standard._argmax_combine_tie_break_left) is None  # four arguments

    def a_minus_b(a, b):
        return a - b  # not commutative

    def a_plus_a(a, b):
        return a + a

    def two_steps(a, b):
        c = a + b
        return c

    def np_maximum(a, b):
        return np.maximum(a, b)  # not triton.language's

    for fn in (a_minus_b, a_plus_a, two_steps, np_maximum, len):
        assert combine_ufunc(fn) is None, fn


@triton.jit
def in_place_kernel(x_ptr, o_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs) * 2.0 + 1.0)  # o_ptr is x_ptr's buffer


def test_in_place_update_through_an_alias(passes, mode):
    x = rand((40 * 32,), 4)
    out = jt.triton_call(
        x, kernel=in_place_kernel, out_shape=x, grid=40, BLOCK=32, input_output_aliases={0: 0}
    )
    np.testing.assert_allclose(out, x * 2.0 + 1.0, rtol=1e-6)
    assert all(passes) and (mode == "one_by_one") == (passes == [])


@triton.jit
def branchy_kernel(x_ptr, flag, o_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(o_ptr + offs, x)  # stored before the branch: undone when the pass is abandoned
    if flag:  # the same for every program: stays batched
        x = x + 1.0
    if pid % 3 == 0:  # differs between programs: one by one
        x = x * 10.0
    for _ in range(pid % 2):  # a loop bound that differs too
        x = x - 5.0
    tl.store(o_ptr + offs, x)


def test_program_dependent_control_flow_falls_back(passes, mode):
    x = rand((30, 16), 5)
    out = jt.triton_call(x, True, kernel=branchy_kernel, out_shape=x, grid=30, BLOCK=16)
    pid = np.arange(30)[:, None]
    want = (np.asarray(x) + 1.0) * np.where(pid % 3 == 0, 10.0, 1.0) - 5.0 * (pid % 2)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert not any(passes)


@triton.jit
def uniform_branch_kernel(x_ptr, flag, o_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    if flag:
        x = x + 1.0
    if tl.program_id(1) == 0:  # grid axis 1 has one program: uniform
        x = x * 3.0
    tl.store(o_ptr + offs, x)


@pytest.mark.parametrize("flag", [True, False])
def test_uniform_control_flow_stays_batched(passes, flag):
    x = rand((30, 16), 6)
    out = jt.triton_call(x, flag, kernel=uniform_branch_kernel, out_shape=x, grid=(30, 1), BLOCK=16)
    np.testing.assert_allclose(out, (np.asarray(x) + (1.0 if flag else 0.0)) * 3.0, rtol=1e-6)
    assert passes and all(passes)


@triton.jit
def histogram_atomic_kernel(x_ptr, o_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(o_ptr + tl.program_id(0) % 4, tl.sum(tl.load(x_ptr + offs)))


def test_atomics_run_one_by_one(passes, mode):
    x = rand((64, 8), 7)
    out = jt.triton_call(
        x, kernel=histogram_atomic_kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=64, BLOCK=8
    )
    want = np.asarray(x).sum(1).reshape(16, 4).sum(0)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert not any(passes) and len(passes) <= 1  # the first pass tells: no more tries


@triton.jit
def chain_kernel(x_ptr, o_ptr):
    # Program i reads what program i - 1 stored: in order, a running sum.
    pid = tl.program_id(0)
    prev = tl.load(o_ptr + pid - 1, mask=pid > 0, other=0.0)
    tl.store(o_ptr + pid, prev + tl.load(x_ptr + pid))


def test_programs_reading_each_others_stores_run_in_order(passes, mode):
    x = rand((50,), 8)
    out = jt.triton_call(x, kernel=chain_kernel, out_shape=x, grid=50)
    np.testing.assert_allclose(out, np.cumsum(np.asarray(x)), rtol=1e-5, atol=1e-5)
    assert not any(passes)


@triton.jit
def shared_store_kernel(x_ptr, o_ptr, BLOCK: tl.constexpr):
    # Every program stores to element 0 (the last program's value wins in order).
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs))
    tl.store(o_ptr, tl.load(x_ptr + pid * BLOCK) * 0.0 + pid.to(tl.float32))


def test_programs_storing_the_same_element_run_in_order(passes, mode):
    x = rand((20 * 8,), 9)
    out = np.asarray(jt.triton_call(x, kernel=shared_store_kernel, out_shape=x, grid=20, BLOCK=8))
    want = np.asarray(x).copy()
    want[0] = 19.0
    np.testing.assert_array_equal(out, want)
    assert not any(passes)


@triton.jit
def one_program_out_of_bounds(x_ptr, o_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK) + (pid == 7).to(tl.int32) * 100000
    tl.store(o_ptr + offs, tl.load(x_ptr + offs))


def test_out_of_bounds_names_the_program(passes, mode):
    x = rand((16 * 8,), 10)
    with pytest.raises(Exception, match=r"program \(7, 0, 0\): a load is out of bounds") as info:
        jax.block_until_ready(
            jt.triton_call(x, kernel=one_program_out_of_bounds, out_shape=x, grid=16, BLOCK=8)
        )
    assert "OutOfBoundsError" in str(info.value)
    assert not any(passes)


@triton.jit
def print_kernel(x_ptr, o_ptr):
    pid = tl.program_id(0)
    x = tl.load(x_ptr + pid)
    tl.device_print("x", x)
    tl.store(o_ptr + pid, x + 1.0)


def test_device_print_runs_one_by_one(passes, capfd):
    x = rand((4,), 11)
    out = jt.triton_call(x, kernel=print_kernel, out_shape=x, grid=4)
    np.testing.assert_allclose(out, np.asarray(x) + 1.0, rtol=1e-6)
    printed = [ln for ln in capfd.readouterr().out.splitlines() if " x: " in ln]
    assert [ln.split(")")[0] + ")" for ln in printed] == [f"({i}, 0, 0)" for i in range(4)]
    assert passes == [False]


def test_pallas_gpu_interpret_k_loop_runs_batched(passes, mode):
    pl = pytest.importorskip("pallas")
    plgpu = pytest.importorskip("pallas_gpu")

    def matmul(x_ref, y_ref, o_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    x, y = rand((64, 96), 12), rand((96, 48), 13)
    out = pl.pallas_call(
        matmul,
        out_shape=jax.ShapeDtypeStruct((64, 48), jnp.float32),
        grid=(4, 3, 3),
        in_specs=[
            pl.BlockSpec((16, 32), lambda i, j, k: (i, k)),
            pl.BlockSpec((32, 16), lambda i, j, k: (k, j)),
        ],
        out_specs=pl.BlockSpec((16, 16), lambda i, j, k: (i, j)),
        interpret=plgpu.InterpretParams(),
    )(x, y)
    np.testing.assert_allclose(out, x @ y, rtol=1e-4, atol=1e-4)
    assert all(passes) and (mode == "one_by_one") == (passes == [])


def test_batch_size_setting():
    import os

    old = os.environ.pop("JAX_KERNEL_RUNTIME_INTERPRET_BATCH", None)
    try:
        assert _interpret.max_batch() == 4096
        for value, want in (("1", 1), ("0", 1), ("64", 64), ("many", 4096)):
            os.environ["JAX_KERNEL_RUNTIME_INTERPRET_BATCH"] = value
            assert _interpret.max_batch() == want
    finally:
        os.environ.pop("JAX_KERNEL_RUNTIME_INTERPRET_BATCH", None)
        if old is not None:
            os.environ["JAX_KERNEL_RUNTIME_INTERPRET_BATCH"] = old


def test_pallas_gpu_loop_with_program_dependent_bounds(passes, mode):
    # The generated kernel's loop bounds go through _loop_bound: each program
    # has its own, so the programs run one by one.
    pl = pytest.importorskip("pallas")
    plgpu = pytest.importorskip("pallas_gpu")
    from jax import lax

    x = rand((16, 8), 14)

    def kernel(x_ref, o_ref):
        p = pl.program_id(0)

        def body(i, c):
            return c + x_ref[pl.ds(i, 1), :] * (i + 1).astype(jnp.float32)

        o_ref[...] = lax.fori_loop(p - 1, 2 * p - 1, body, jnp.zeros((1, 8), jnp.float32))

    out = pl.pallas_call(
        kernel,
        jax.ShapeDtypeStruct((8, 8), jnp.float32),
        grid=(8,),
        in_specs=[pl.BlockSpec((16, 8), lambda p: (0, 0))],
        out_specs=pl.BlockSpec((1, 8), lambda p: (p, 0)),
        interpret=plgpu.InterpretParams(),
    )(x)
    xs, rows = np.asarray(x), np.arange(16)[:, None]
    want = np.stack(
        [np.where((rows >= p - 1) & (rows < 2 * p - 1), xs * (rows + 1), 0).sum(0) for p in range(8)]
    )
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert not any(passes)


@triton.jit
def descriptor_tile_kernel(
    x_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr
):
    # Device-side TMA descriptors (tl.make_tensor_descriptor): the interpreter's
    # descriptor loads and stores reach the shared patches with keyword arguments.
    i, j = tl.program_id(0), tl.program_id(1)
    src = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    dst = tl.make_tensor_descriptor(o_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    dst.store([i * BM, j * BN], src.load([i * BM, j * BN]) * 2.0 + 1.0)


def test_tensor_descriptor_tiles_with_partial_edges(mode):
    x = rand((100, 80), 7)  # 100 = 3 * 32 + 4 rows, 80 = 2 * 32 + 16 cols: partial edge tiles
    out = jt.triton_call(
        x, kernel=descriptor_tile_kernel, out_shape=x, grid=(4, 3), M=100, N=80, BM=32, BN=32
    )
    np.testing.assert_allclose(out, x * 2.0 + 1.0, rtol=1e-6, atol=1e-6)
