"""``pallas_tpu.ops.megablox`` (``gmm``, ``tgmm``, the differentiable ``megablox.gmm``)
against a per-group numpy reference (float64), ``jax.lax.ragged_dot``, and JAX's
megablox ops of the same names (JAX's interpret mode), on fresh random data, run every
way of an op (tests/ways.py's ``every_way(op=True)``: our TPU interpret mode, our Mosaic
lowering by ``run_mosaic``, compiled by libtpu for the compile-only TPUs first).

Group sizes are uneven on purpose: empty groups, groups that share a row tile (two and
three to a tile), rows after the last group, k and n that the tiles do not divide."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ops_matmul import rand
from ways import compile_op, every_way

import pallas_tpu as pltpu
from pallas_tpu.ops import _policy, megablox
from pallas_tpu.ops.megablox import _blocks
from pallas_tpu.ops.megablox import _schedule as schedule

kernels = importlib.import_module("pallas_tpu.ops.megablox.gmm")  # the attribute `gmm` is the function


def group_rows(group_sizes, m):
    ends = np.minimum(np.cumsum(np.asarray(group_sizes)), m)
    return ends - np.asarray(group_sizes), ends


def gmm_reference(lhs, rhs, group_sizes, offset=0, transpose_rhs=False, existing=None):
    lhs64, rhs64 = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out = np.zeros((lhs.shape[0], n)) if existing is None else np.array(existing, np.float64)
    starts, ends = group_rows(group_sizes, lhs.shape[0])
    for j in range(rhs.shape[0]):
        g = offset + j
        w = rhs64[j].T if transpose_rhs else rhs64[j]
        out[starts[g] : ends[g]] = lhs64[starts[g] : ends[g]] @ w
    return out


def tgmm_reference(lhs_km, rhs, group_sizes, offset=0, num_local=None, existing=None):
    lhs64, rhs64 = np.asarray(lhs_km, np.float64), np.asarray(rhs, np.float64)
    starts, ends = group_rows(group_sizes, rhs.shape[0])
    num_local = len(group_sizes) - offset if num_local is None else num_local
    out = np.stack([lhs64[:, starts[offset + j] : ends[offset + j]] @ rhs64[starts[offset + j] : ends[offset + j]]
                    for j in range(num_local)])  # fmt: skip
    return out if existing is None else out + np.asarray(existing, np.float64)


def close(out, ref, tol):
    out = np.asarray(out)
    np.testing.assert_allclose(out.astype(np.float64), np.asarray(ref, np.float64), rtol=tol, atol=tol)


M, K, N = 512, 384, 256
SIZES = [100, 0, 250, 60, 90]  # sums to 500: the last 12 rows belong to no group
CROWDED = [10, 20, 30, 68, 200, 0, 184]  # three groups share the first tile of 128 rows

# name: (group sizes, local groups (offset, count), gmm keywords, n, dtype, tolerance)
GMM_CASES = {
    "uneven": (SIZES, None, dict(tiling=(128, 128, 128)), N, jnp.float32, 1e-4),
    "k_tail": (SIZES, None, dict(tiling=(128, 256, 128)), N, jnp.float32, 1e-4),
    "n_tail": (SIZES, None, dict(tiling=(128, 128, 128)), 320, jnp.float32, 1e-4),
    "chosen_tiling": (CROWDED, None, dict(), N, jnp.float32, 1e-4),
    "transpose_rhs": (SIZES, None, dict(tiling=(128, 128, 128), transpose_rhs=True), N, jnp.float32, 1e-4),
    "group_offset": (SIZES, (2, 2), dict(tiling=(128, 128, 128)), N, jnp.float32, 1e-4),
    "existing_out": (CROWDED, (1, 3), dict(tiling=(128, 128, 128)), N, jnp.float32, 1e-4),
    "bf16": (
        CROWDED,
        None,
        dict(tiling=(128, 128, 128), preferred_element_type=jnp.bfloat16),
        N,
        jnp.bfloat16,
        3e-2,
    ),
    # Tiles of 4 and 2 row chunks: a shared tile's visit computes only the chunks its group has.
    "chunks_k_steps": (CROWDED, None, dict(tiling=(512, 128, 256)), N, jnp.float32, 1e-4),
    "chunks_one_k_step": (SIZES, (1, 3), dict(tiling=(256, 384, 256)), N, jnp.float32, 1e-4),
    # 500 rows: the chosen tm (128) leaves a partial last tile.
    "m_tail": ([100, 0, 250, 60, 90], None, dict(m=500), N, jnp.float32, 1e-4),
}


def gmm_case(name, way):
    sizes, local, kw, n, dtype, tol = GMM_CASES[name]
    offset, count = local or (0, len(sizes))
    kw = dict(kw)
    m = kw.pop("m", M)
    lhs = rand(0, (m, K), dtype)
    rhs_shape = (count, n, K) if kw.get("transpose_rhs") else (count, K, n)
    rhs = rand(1, rhs_shape, dtype)
    args = [lhs, rhs, jnp.array(sizes, jnp.int32)]
    if local:
        kw["group_offset"] = jnp.array(offset, jnp.int32)
    existing = rand(2, (M, n)) if name == "existing_out" else None
    if existing is not None:
        kw["existing_out"] = existing
    mxu = way.mxu_operand
    ref = gmm_reference(mxu(lhs), mxu(rhs), sizes, offset, kw.get("transpose_rhs", False), existing)
    return args, kw, ref, tol


@pytest.mark.parametrize("case", GMM_CASES)
@every_way(op=True)
def test_gmm(way, case):
    args, kw, ref, tol = gmm_case(case, way)
    # Traced arrays (group_offset, existing_out) go in as arguments, the rest as keywords.
    arrays = {k: kw.pop(k) for k in ("group_offset", "existing_out") if k in kw}
    names = list(arrays)

    def op(lhs, rhs, sizes, *extra, interpret=False, **static):
        return kernels.gmm(lhs, rhs, sizes, **dict(zip(names, extra)), interpret=interpret, **static)

    out = way.op(op, *args, *arrays.values(), **kw)
    close(out, ref, tol * np.sqrt(K))


# name: (group sizes, local groups (offset, count), tiling, existing_out)
TGMM_CASES = {
    "uneven": (SIZES, None, (128, 128, 128), False),
    "chosen_tiling": (CROWDED, None, None, False),
    "local_groups": (CROWDED, (2, 4), (128, 128, 128), False),
    "existing_out": (SIZES, (1, 3), (128, 256, 128), True),
    "m_tail": (SIZES[:-1] + [80], None, None, False),  # m = 500 below: a partial last tile
    "chunks": (CROWDED, (1, 5), (512, 128, 256), False),
    "chunks_existing_out": (SIZES, None, (256, 128, 128), True),
}


@pytest.mark.parametrize("case", TGMM_CASES)
@every_way(op=True)
def test_tgmm(way, case):
    sizes, local, tiling, with_existing = TGMM_CASES[case]
    offset, count = local or (0, len(sizes))
    m = sum(sizes) if case == "m_tail" else M
    lhs_km, rhs = rand(3, (K, m)), rand(4, (m, N))
    existing = rand(5, (count, K, N)) if with_existing else None
    mxu = way.mxu_operand
    ref = tgmm_reference(mxu(lhs_km), mxu(rhs), sizes, offset, count, existing)
    extra = [jnp.array(offset, jnp.int32)] + ([existing] if with_existing else [])

    def op(lhs, rhs, sizes, group_offset, *existing_out, interpret=False):
        return kernels.tgmm(
            lhs, rhs, sizes, tiling=tiling, group_offset=group_offset, num_actual_groups=count,
            existing_out=existing_out[0] if existing_out else None, interpret=interpret,
        )  # fmt: skip

    out = way.op(op, lhs_km, rhs, jnp.array(sizes, jnp.int32), *extra)
    close(out, ref, 1e-4 * np.sqrt(M))


@every_way(op=True)
def test_tgmm_of_rows_first_lhs(way):
    """The backward pass's tgmm: lhs [m, k] as the forward has it, contracted over its rows."""
    lhs, rhs, sizes = (
        rand(6, (M, K), jnp.bfloat16),
        rand(7, (M, N), jnp.bfloat16),
        jnp.array(CROWDED, jnp.int32),
    )

    def op(lhs, rhs, sizes, interpret=False):
        return kernels.transposed_gmm(
            lhs, rhs, sizes, jnp.float32, (128, 128, 128), None, None, None, interpret, lhs_rows_first=True
        )

    out = way.op(op, lhs, rhs, sizes)
    close(out, tgmm_reference(lhs.T, rhs, CROWDED), 1e-4 * np.sqrt(M))


def dense_reference(lhs, rhs, sizes, offset=0, transpose_rhs=False, existing=None):
    """``gmm`` in plain jnp (one dense product per local group, masked): differentiable."""
    starts, ends = group_rows(sizes, lhs.shape[0])
    rows = jnp.arange(lhs.shape[0])[:, None]
    out = (
        jnp.zeros((lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]))
        if existing is None
        else existing
    )
    for j in range(rhs.shape[0]):
        g = offset + j
        w = rhs[j].T if transpose_rhs else rhs[j]
        mine = (rows >= starts[g]) & (rows < ends[g])
        out = jnp.where(mine, jnp.dot(lhs, w, precision=jax.lax.Precision.HIGHEST), out)
    return out


GRAD_CASES = {
    "plain": (SIZES, None, False, False),
    "transpose_rhs": (CROWDED, None, True, False),
    "group_offset_existing_out": (CROWDED, (2, 3), False, True),
}


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("interpret", ["tpu", "core"])
def test_gmm_gradients(interpret, case):
    """``jax.grad`` through the custom VJP, in our TPU interpret mode and pallas-core's.
    (The backward's kernels, gmm of a transposed rhs and the rows-first tgmm, run every
    way in the tests above; ``run_with_mosaic`` pairs exported kernels with calls in text
    order, which the jitted forward and backward kernels of a gradient do not keep.)"""
    sizes, local, transpose_rhs, with_existing = GRAD_CASES[case]
    offset, count = local or (0, len(sizes))
    lhs = rand(8, (M, K))
    rhs = rand(9, (count, N, K) if transpose_rhs else (count, K, N))
    existing = rand(10, (M, N)) if with_existing else None
    weights = rand(11, (M, N))
    group_sizes = jnp.array(sizes, jnp.int32)
    tiling = (128, 128, 128)

    def loss(lhs, rhs, existing, interpret=False):
        out = megablox.gmm(
            lhs, rhs, group_sizes, jnp.float32, tiling, jnp.array(offset, jnp.int32), existing,
            transpose_rhs, interpret,
        )  # fmt: skip
        return jnp.sum(out * weights)

    def reference_loss(lhs, rhs, existing):
        return jnp.sum(dense_reference(lhs, rhs, sizes, offset, transpose_rhs, existing) * weights)

    argnums = (0, 1, 2) if with_existing else (0, 1)

    def grads(lhs, rhs, *existing_out, interpret=False):
        ex = existing_out[0] if existing_out else None
        return jax.grad(lambda a, b, e: loss(a, b, e, interpret), argnums=argnums)(lhs, rhs, ex)

    args = (lhs, rhs) + ((existing,) if with_existing else ())
    got = grads(*args, interpret=pltpu.InterpretParams() if interpret == "tpu" else True)
    want = jax.grad(reference_loss, argnums=argnums)(lhs, rhs, existing)
    for g, w in zip(got, want):
        close(g, w, 1e-4 * np.sqrt(max(M, K)))


def test_gmm_matches_ragged_dot_and_jax_op():
    """All groups local and covering every row: JAX's megablox (interpret mode),
    ``lax.ragged_dot`` and ours agree."""
    jax_gmm = pytest.importorskip("jax.experimental.pallas.ops.tpu.megablox.gmm")
    sizes = jnp.array([128, 0, 96, 160, 128], jnp.int32)
    lhs, rhs = rand(12, (M, K), jnp.bfloat16), rand(13, (5, K, N), jnp.bfloat16)
    ours = kernels.gmm(lhs, rhs, sizes, tiling=(128, 128, 128), interpret=pltpu.InterpretParams())
    theirs = jax_gmm.gmm(lhs, rhs, sizes, tiling=(128, 128, 128), interpret=True)
    ragged = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    close(ours, theirs, 1e-5 * np.sqrt(K))
    close(ours, ragged, 1e-5 * np.sqrt(K))
    ours_t = kernels.tgmm(lhs.T, lhs[:, :N], sizes, tiling=(128, 128, 128), interpret=pltpu.InterpretParams())
    theirs_t = jax_gmm.tgmm(lhs.T, lhs[:, :N], sizes, tiling=(128, 128, 128), interpret=True)
    close(ours_t, theirs_t, 1e-5 * np.sqrt(M))


def test_public_names_match_jax():
    jax_megablox = pytest.importorskip("jax.experimental.pallas.ops.tpu.megablox")
    jax_kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    assert {n for n in dir(jax_megablox) if not n.startswith("_")} <= set(dir(megablox)) | {"common", "ops"}
    assert {"gmm", "tgmm", "LutFn"} <= set(dir(kernels))
    import inspect

    for name in ("gmm", "tgmm"):
        ours = list(inspect.signature(getattr(kernels, name)).parameters)
        theirs = list(inspect.signature(getattr(jax_kernels, name)).parameters)
        assert ours == theirs, name
    jax_common = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.common")
    common = importlib.import_module("pallas_tpu.ops.megablox.common")
    theirs = {n for n in dir(jax_common) if not n.startswith("_") and callable(getattr(jax_common, n))}
    assert theirs - {"jax", "jnp", "re"} <= set(dir(common))
    lhs, rhs = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.float32)
    assert common.select_input_dtype(lhs, lhs) == jnp.bfloat16
    assert common.select_input_dtype(lhs, rhs) == jnp.float32
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        common.assert_is_supported_dtype(jnp.int8)


def visits_by_enumeration(sizes, offset, count, m, tm, *, by_group):
    """The visits the schedule should hold, enumerated in Python: (tile, local group or
    None, rows lo, rows hi)."""
    starts, ends = group_rows(sizes, m)
    tiles = -(-m // tm)
    local = range(offset, offset + count)
    visits = []
    if by_group:
        for g in local:
            if ends[g] == starts[g]:
                visits.append((min(starts[g] // tm, tiles - 1), g - offset, 0, 0))
            for t in range(starts[g] // tm, (ends[g] - 1) // tm + 1) if ends[g] > starts[g] else ():
                visits.append((t, g - offset, max(starts[g] - t * tm, 0), min(ends[g] - t * tm, tm)))
        return visits
    for t in range(tiles):
        mine = [g for g in local if ends[g] > starts[g] and starts[g] < (t + 1) * tm and ends[g] > t * tm]
        visits += [(t, g - offset, max(starts[g] - t * tm, 0), min(ends[g] - t * tm, tm)) for g in mine]
        if not mine:
            visits.append((t, None, 0, 0))
    return visits


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["gmm", "tgmm"])
def test_schedule_visits(kind, seed):
    rng = np.random.default_rng(seed)
    num_groups, m, tm = int(rng.integers(1, 12)), 640, 128
    sizes = rng.multinomial(int(rng.integers(m // 2, m + 1)), np.ones(num_groups) / num_groups)
    sizes[rng.random(num_groups) < 0.3] = 0
    offset = int(rng.integers(0, num_groups))
    count = int(rng.integers(1, num_groups - offset + 1))
    make = schedule.gmm_schedule if kind == "gmm" else schedule.tgmm_schedule
    table = np.asarray(make(jnp.array(sizes, jnp.int32), jnp.int32(offset), m=m, tm=tm, num_local=count))
    real = (table[schedule.FLAGS] & schedule.REAL) != 0
    computes = (table[schedule.FLAGS] & schedule.COMPUTE) != 0
    got = [
        (int(t), int(g) if c or kind == "tgmm" else None, int(lo), int(hi))
        for t, g, lo, hi, c in zip(
            table[schedule.TILE][real], table[schedule.GROUP][real], table[schedule.LO][real],
            table[schedule.HI][real], computes[real],
        )
    ]  # fmt: skip
    assert got == visits_by_enumeration(sizes, offset, count, m, tm, by_group=kind == "tgmm")
    assert table.shape[1] == schedule.max_visits(-(-m // tm), count) >= len(got)
    # Steps that compute nothing fetch the blocks of a step that does.
    if computes.any():
        fetched = set(zip(table[schedule.FETCH_TILE], table[schedule.FETCH_GROUP]))
        assert fetched <= set(zip(table[schedule.TILE][computes], table[schedule.GROUP][computes]))


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4", "v5p"])
def test_choose_tiling_fits_each_chip(chip):
    info = pltpu.get_tpu_info(chip)
    tm, tk, tn = kernels.choose_tiling(8192, 2048, 2048, 8, jnp.bfloat16, jnp.float32, info=info)
    assert tm == 512 and 2048 % tk == 0 and 2048 % tn == 0
    if info.num_cores > 1:
        assert 2048 // tn >= 2
    tm, tk, tn = kernels.choose_tiling(16384, 4096, 4096, 32, jnp.bfloat16, jnp.bfloat16, info=info)
    assert tm == 512 and tk % 128 == 0 and tn % 128 == 0
    assert kernels.choose_tiling(4096, 1024, 1024, 64, jnp.bfloat16, jnp.float32, info=info)[0] == 128


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v4", "v5p"])
def test_choose_tiling_keeps_a_step_to_the_code_cap(chip):
    """A step's product is straight-line code: at most ``max_step_pushes`` MXU pushes (8192 on
    the chips without a measured instruction memory), n shrunk first (on the v5e 4096^3 in 8
    groups was 77k bundles in 4 overlays at tn=2048, 39k at 1024)."""
    info = pltpu.get_tpu_info(chip)
    cap = _blocks.max_step_pushes(_policy.facts(info))
    assert cap == 8192
    shapes = [(4096, 4096, 4096, 8), (16384, 4096, 4096, 32), (8192, 2048, 2048, 8), (2048, 16384, 512, 4)]
    for m, k, n, g in shapes:
        for out in (jnp.float32, jnp.bfloat16):
            tm, tk, tn = kernels.choose_tiling(m, k, n, g, jnp.bfloat16, out, info=info)
            assert _blocks.mxu_pushes(tm, tk, tn, 2, info) <= cap, (m, k, n, tm, tk, tn)
            assert k % tk == 0 and n % tn == 0, (m, k, n, tm, tk, tn)
    if chip == "v5e":
        assert kernels.choose_tiling(4096, 4096, 4096, 8, jnp.bfloat16, jnp.float32, info=info) == (
            512,
            4096,
            1024,
        )
        assert kernels.choose_tiling(8192, 2048, 2048, 8, jnp.bfloat16, jnp.float32, info=info) == (
            512,
            2048,
            2048,
        )
        # n as narrow as 512 already: k shrinks instead.
        assert kernels.choose_tiling(2048, 16384, 512, 4, jnp.bfloat16, jnp.float32, info=info) == (
            512,
            8192,
            512,
        )
        # tgmm's output tiles are well under the cap: unchanged.
        got = kernels.choose_tiling(
            4096, 4096, 4096, 8, jnp.bfloat16, jnp.float32, transposed=True, info=info
        )
        assert got == (512, 1024, 1024)


def test_gmm_default_tiling_compiles_at_scale():
    s = jax.ShapeDtypeStruct
    args = (s((8192, 2048), jnp.bfloat16), s((8, 2048, 2048), jnp.bfloat16), s((8,), jnp.int32))
    compile_op(lambda a, b, c: megablox.gmm(a, b, c, jnp.bfloat16), args)


def _gmm(**kw):
    base = dict(
        lhs=jnp.ones((256, 128)), rhs=jnp.ones((2, 128, 128)), group_sizes=jnp.array([128, 128], jnp.int32)
    )
    base.update(kw)
    return lambda: kernels.gmm(**base)


BAD_CALLS = {
    "lhs 3-d": (_gmm(lhs=jnp.ones((2, 256, 128))), "'lhs' must be a 2-d array"),
    "rhs 2-d": (_gmm(rhs=jnp.ones((128, 128))), "'rhs' must be a 3-d array"),
    "int lhs": (_gmm(lhs=jnp.ones((256, 128), jnp.int32)), "'lhs' must be bfloat16 or float32"),
    "k differs": (_gmm(rhs=jnp.ones((2, 256, 128))), "disagree on k"),
    "group_sizes int64-like": (
        _gmm(group_sizes=jnp.array([128, 128], jnp.int16)),
        "'group_sizes' must be int32",
    ),
    "group_sizes 2-d": (_gmm(group_sizes=jnp.ones((2, 1), jnp.int32)), "'group_sizes' must be a 1-d"),
    "too few groups": (_gmm(group_sizes=jnp.array([256], jnp.int32)), "fewer than the 2"),
    "tm does not divide m": (_gmm(tiling=(96, 128, 128)), "tm=96 does not divide the 256 rows"),
    "tn off the lane tile": (_gmm(tiling=(128, 128, 64)), "tn=64 must be a multiple of 128"),
    "tiling not three ints": (_gmm(tiling=(128, 128)), "'tiling' must be three positive ints"),
    "group_offset not scalar": (
        _gmm(group_offset=jnp.array([0], jnp.int32)),
        "'group_offset' must be a ()-shaped",
    ),
    "existing_out dtype": (
        _gmm(existing_out=jnp.ones((256, 128), jnp.bfloat16)),
        "'existing_out' dtype bfloat16 must match preferred_element_type float32",
    ),
    "existing_out shape": (
        _gmm(existing_out=jnp.ones((128, 128))),
        "'existing_out' must have the output's shape",
    ),
    "tgmm m differs": (
        lambda: kernels.tgmm(jnp.ones((128, 256)), jnp.ones((128, 128)), jnp.array([128, 128], jnp.int32)),
        "disagree on m",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


@pytest.mark.parametrize("seed", range(2))
def test_dense_gmm_schedule_equals_search(seed):
    """``gmm_schedule_dense`` (gmm's table where small: ``gmm_visit_table``) is the same table,
    for sizes that leave rows out, overrun m, are negative or zero, and an m no tile divides."""
    rng = np.random.default_rng(seed)
    for _ in range(4):
        num_groups, tm = int(rng.integers(1, 10)), int(rng.choice([8, 128]))
        m = int(rng.integers(1, 7)) * tm - int(rng.integers(0, tm) if rng.random() < 0.3 else 0)
        sizes = rng.integers(-2, max(2 * m // num_groups, 1) + 3, num_groups)
        offset = int(rng.integers(0, num_groups))
        count = int(rng.integers(1, num_groups - offset + 1))
        args = (jnp.array(sizes, jnp.int32), jnp.int32(offset))
        kw = dict(m=m, tm=tm, num_local=count)
        want = np.asarray(schedule.gmm_schedule(*args, **kw))
        np.testing.assert_array_equal(np.asarray(schedule.gmm_schedule_dense(*args, **kw)), want)


def test_visit_table_picks_dense_when_small(monkeypatch):
    """``gmm_visit_table`` equals the searched table on both of its paths."""
    sizes, offset = jnp.array([300, 0, 700, 24], jnp.int32), jnp.int32(0)
    kw = dict(m=1024, tm=128, num_local=4)
    want = np.asarray(schedule.gmm_schedule(sizes, offset, **kw))
    calls = []
    for limit in (1 << 20, 10):  # 11 steps: dense under the first bound, the search over the second
        monkeypatch.setattr(schedule, "DENSE_TABLE_MAX", limit)
        dense = schedule.gmm_schedule_dense
        monkeypatch.setattr(
            schedule, "gmm_schedule_dense", lambda *a, **k: calls.append(limit) or dense(*a, **k)
        )
        np.testing.assert_array_equal(np.asarray(schedule.gmm_visit_table(sizes, offset, **kw)), want)
        monkeypatch.setattr(schedule, "gmm_schedule_dense", dense)
    assert calls == [1 << 20]


def test_gmm_empty_dimensions():
    """m = 0: the empty result; k = 0: the local groups' rows are zeros (the rest kept from
    existing_out); tgmm with no rows: zeros."""
    sizes = jnp.array([8, 4], jnp.int32)
    assert kernels.gmm(
        jnp.ones((0, 128)), jnp.ones((2, 128, 128)), jnp.zeros(2, jnp.int32), interpret=True
    ).shape == (0, 128)
    existing = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 20))), (16, 128))
    out = kernels.gmm(jnp.ones((16, 0)), jnp.ones((2, 0, 128)), sizes, existing_out=existing, interpret=True)
    want = jnp.where(jnp.arange(16)[:, None] < 12, 0.0, existing)
    np.testing.assert_array_equal(out, want)
    out = kernels.tgmm(jnp.ones((128, 0)), jnp.ones((0, 128)), jnp.zeros(2, jnp.int32), interpret=True)
    np.testing.assert_array_equal(out, np.zeros((2, 128, 128)))


def test_gmm_negative_group_sizes_refused():
    lhs, rhs = jnp.ones((16, 128)), jnp.ones((2, 128, 128))
    with pytest.raises(
        ValueError, match=r"gmm: 'group_sizes' must be >= 0 .rows per group., got -4 for group 1"
    ):
        kernels.gmm(lhs, rhs, jnp.array([20, -4], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"tgmm: 'group_sizes' must be >= 0"):
        kernels.tgmm(lhs.T, lhs, jnp.array([-1, 17], jnp.int32), interpret=True)


def test_gmm_lane_tiling_explained():
    """tk/tn not a multiple of 128 (JAX's op runs them in interpret mode only): the error says why
    and what to use."""
    with pytest.raises(
        ValueError, match=r"gmm: 'tiling' tk=100 must be a multiple of 128 .*Mosaic.*use tk=128"
    ):
        kernels.gmm(jnp.ones((256, 256)), jnp.ones((2, 256, 256)), jnp.array([100, 156], jnp.int32),
                     tiling=(128, 100, 200), interpret=True)  # fmt: skip


def test_make_group_metadata_matches_jax():
    jax_gmm = pytest.importorskip("jax.experimental.pallas.ops.tpu.megablox.gmm")
    jax_gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    rng = np.random.default_rng()
    for _ in range(20):
        groups, tm = int(rng.integers(1, 6)), int(rng.choice([8, 16]))
        m = tm * int(rng.integers(1, 5))
        cuts = np.sort(rng.integers(0, m + 1, groups - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int32)
        start = int(rng.integers(0, groups))
        kw = dict(group_sizes=jnp.asarray(sizes), m=m, tm=tm, start_group=jnp.int32(start),
                  num_nonzero_groups=int(rng.integers(1, groups - start + 1)), visit_empty_groups=bool(rng.integers(2)))  # fmt: skip
        for ours, theirs in zip(jax.tree.leaves(kernels.make_group_metadata(**kw)),
                                jax.tree.leaves(jax_gmm.make_group_metadata(**kw))):  # fmt: skip
            np.testing.assert_array_equal(ours, theirs, err_msg=str(kw))
