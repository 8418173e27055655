"""JAX's own TPU kernels (``jax.experimental.pallas.ops.tpu``, ported by the
import rewrite of ``test_jax_tpu_ops.py``) through our Mosaic lowering.

For each op, the modules in the exported ``tpu_custom_call``s are decoded,
canonicalized and compared with the modules JAX's own lowering puts there for
the unmodified op: the same functions with the same signatures and attributes,
and the same ops (constants aside). Some also run through ``run_mosaic`` and
are compared with a ``jnp`` reference.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ways.compiled
import ways.jax_beside
import ways.mosaic
from jaxlib.mlir import passmanager
from test_jax_tpu_ops import (  # noqa: F401
    _flash_blocks,
    _paged_inputs,
    _ported_ops,
    attention_ref,
    load,
    load_jax,
    paged_attention_ref,
)
from test_lowering import funcs, structure

import pallas_tpu as pltpu
from pallas_tpu._src.executor import run as executor

exported_bodies = ways.mosaic.tpu_modules
run_ours = ways.mosaic.run_with_mosaic  # each pallas_call replaced by run_mosaic of our module


def modules(f, *args) -> list:
    """The canonicalized Mosaic modules of the custom calls ``f(*args)`` exports to."""
    out = []
    for body in exported_bodies(f, *args):
        m = executor.parse_module(body)
        with m.context:
            passmanager.PassManager.parse("builtin.module(canonicalize)").run(m.operation)
            assert m.operation.verify()
        out.append(m)
    return out


def op_counts(m) -> collections.Counter:
    names = re.findall(r"\b((?:arith|math|vector|tpu|memref|scf)\.[a-z_0-9]+)\b", str(m))
    return collections.Counter(n for n in names if n != "arith.constant")


EFFECTS = ("tpu.enqueue_dma", "tpu.wait_dma", "tpu.wait_dma2", "tpu.vector_store", "memref.store", "tpu.sem_")


def assert_same_as_jax(ours, theirs, *, same_ops=True):
    """Same functions, signatures and attributes; the same ops, or with
    ``same_ops=False`` the same side effects (DMAs, semaphores, stores)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert structure(a) == structure(b)
        # The kernel function's name aside: pallas-core names a functools.partial
        # kernel 'kernel', JAX the wrapped function.
        assert list(funcs(a))[1:] == list(funcs(b))[1:]
        ca, cb = op_counts(a), op_counts(b)
        if same_ops:
            assert ca == cb
        else:
            assert {k: n for k, n in ca.items() if k.startswith(EFFECTS)} == {
                k: n for k, n in cb.items() if k.startswith(EFFECTS)
            }


def shapes(*xs):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]


def test_matmul_same_as_jax_and_runs():
    mm, jmm = load("matmul"), load_jax("matmul")
    kw = dict(block_shape=(128, 128), block_k=128, out_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (256, 512), jnp.float32).astype(jnp.bfloat16)
    y = jax.random.normal(jax.random.key(2), (512, 256), jnp.float32).astype(jnp.bfloat16)
    assert_same_as_jax(
        modules(lambda a, b: mm.matmul(a, b, **kw), x, y), modules(lambda a, b: jmm.matmul(a, b, **kw), x, y)
    )
    [out] = run_ours(lambda a, b: mm.matmul(a, b, **kw), x, y)
    ref = jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32))
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2)


def _flash(fa, causal):
    return lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, block_sizes=_flash_blocks(fa))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward_same_as_jax_and_runs(causal):
    fa, jfa = load("flash_attention"), load_jax("flash_attention")
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 2, 256, 64), jnp.float32) for i in range(3))
    assert_same_as_jax(modules(_flash(fa, causal), q, k, v), modules(_flash(jfa, causal), q, k, v))
    [out] = run_ours(_flash(fa, causal), q, k, v)
    ref = attention_ref(q, k, v, causal=causal)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_flash_attention_backward_same_as_jax():
    fa, jfa = load("flash_attention"), load_jax("flash_attention")
    q = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.float32)

    def grads(mod):
        return jax.grad(lambda q, k, v: _flash(mod, False)(q, k, v).sum(), argnums=(0, 1, 2))

    ours = modules(grads(fa), q, q, q)
    assert len(ours) == 3  # forward with residuals, dK/dV, dQ
    assert_same_as_jax(ours, modules(grads(jfa), q, q, q))


def test_paged_attention_same_as_jax():
    pa, jpa = load("paged_attention"), load_jax("paged_attention")
    args = _paged_inputs()

    def call(mod):
        return lambda *a: mod.paged_attention(*a, pages_per_compute_block=2)

    # JAX's module keeps a loop whose result nothing uses (pallas-core drops it
    # when tracing the kernel); everything else is the same.
    ours, theirs = modules(call(pa), *args), modules(call(jpa), *args)
    assert not op_counts(ours[0]) - op_counts(theirs[0])
    assert_same_as_jax(ours, theirs, same_ops=False)


def test_paged_attention_runs():
    pa = load("paged_attention")
    args = _paged_inputs()
    [out] = run_ours(lambda *a: pa.paged_attention(*a, pages_per_compute_block=2), *args)
    np.testing.assert_allclose(out, paged_attention_ref(*args), rtol=1e-4, atol=1e-4)


def test_example_kernel_same_as_jax():
    ex, jex = load("example_kernel"), load_jax("example_kernel")
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    assert_same_as_jax(modules(ex.double, x), modules(jex.double, x))


def _splash(m, S=256):
    mask = m.MultiHeadMask([m.CausalMask((S, S)), m.LocalMask((S, S), (64, 32), 0)])
    sizes = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128)
    blocks = m.BlockSizes(**sizes, block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    return m.make_splash_mha_single_device(mask, block_sizes=blocks)


def test_splash_attention_same_as_jax():
    sa, jsa = load("splash_attention"), load_jax("splash_attention")
    q = jax.ShapeDtypeStruct((2, 256, 128), jnp.float32)
    assert_same_as_jax(modules(_splash(sa), q, q, q), modules(_splash(jsa), q, q, q))

    def grads(m):
        return jax.grad(lambda q, k, v: _splash(m)(q, k, v).sum(), argnums=(0, 1, 2))

    assert_same_as_jax(modules(grads(sa), q, q, q), modules(grads(jsa), q, q, q))


def _ragged_args():
    NP, PS, KH, D, PPS = 32, 16, 2, 128, 4
    q = jax.random.normal(jax.random.key(60), (32, 4, D), jnp.float32)
    kv_pages = jax.random.normal(jax.random.key(61), (NP, PS, 2 * KH, D), jnp.float32)
    kv_lens = jnp.array([40, 17, 64, 0], jnp.int32)
    cu_q_lens = jnp.array([0, 8, 9, 32, 32], jnp.int32)
    pages = jax.random.permutation(jax.random.key(62), NP)[: 4 * PPS].reshape(4, PPS).astype(jnp.int32)
    return q, kv_pages, kv_lens, pages, cu_q_lens, jnp.array([3], jnp.int32)


def test_ragged_paged_attention_same_as_jax():
    rpa, jrpa = load("ragged_paged_attention.kernel"), load_jax("ragged_paged_attention.kernel")

    def call(m):
        return lambda *a: m.ragged_paged_attention(
            *a, sm_scale=0.5, num_kv_pages_per_block=2, num_queries_per_block=8
        )

    # Not op for op: pltpu.store(..., mask=...) is a read-select-write in our
    # kernel language (JAX: a masked tpu.vector_store), and JAX brackets einsums
    # with tpu.trace_start/stop.
    args = _ragged_args()
    assert_same_as_jax(modules(call(rpa), *args), modules(call(jrpa), *args), same_ops=False)


def test_ragged_paged_attention_runs():
    from test_jax_tpu_ops import ragged_paged_attention_ref

    rpa = load("ragged_paged_attention.kernel")
    args = _ragged_args()
    call = lambda *a: rpa.ragged_paged_attention(
        *a, sm_scale=0.5, num_kv_pages_per_block=2, num_queries_per_block=8
    )
    [out] = run_ours(call, *args)
    np.testing.assert_allclose(out, ragged_paged_attention_ref(*args, sm_scale=0.5), rtol=1e-4, atol=1e-4)


def test_splash_attention_forward_runs():
    sa = load("splash_attention")
    q, k, v = (jax.random.normal(jax.random.key(70 + i), (2, 256, 128), jnp.float32) for i in range(3))
    [out] = run_ours(_splash(sa), q, k, v)
    i, j = np.arange(256)[:, None], np.arange(256)[None, :]
    masks = [j <= i, (i - 64 <= j) & (j <= i + 32)]  # CausalMask, LocalMask((64, 32))
    for h in range(2):
        s = np.where(masks[h], q[h] @ k[h].T, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        expect = (p / p.sum(-1, keepdims=True)) @ v[h]
        np.testing.assert_allclose(out[h], expect, rtol=1e-3, atol=1e-3)


def test_all_gather_lowers_with_remote_dmas():
    ag = load("all_gather")
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    for space in (ag.pltpu.VMEM, ag.pl.ANY):
        [m] = pltpu.mosaic_modules(
            lambda a: ag.all_gather(a, mesh=mesh, axis_name="x", memory_space=space), x
        )
        executor.parse_module(m).operation.verify()
        assert re.search(r"tpu.enqueue_dma .*source_semaphore.*device_id", m)
        assert "tpu.sem_barrier" in m and "tpu.device_id" in m


def test_emit_pipeline_inside_a_kernel_runs():
    import pallas as pl

    def kernel(x_hbm, o_hbm):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0 + 1.0

        spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
        pltpu.emit_pipeline(body, grid=(4,), in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

    def f(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((32, 128), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
        )(x)

    x = jax.random.normal(jax.random.key(80), (32, 128), jnp.float32)
    [m] = modules(f, x)
    assert "tpu.enqueue_dma" in str(m) and ("scf.for" in str(m) or "scf.if" in str(m))
    [out] = run_ours(f, x)
    np.testing.assert_allclose(out, x * 2.0 + 1.0, rtol=1e-6)


# ---------------------------------------------------------------------------
# The compiled way for the ops above: each ported op lowered by us and compiled by
# libtpu's Mosaic for ways.compiled.COMPILE_CHIPS, JAX's original compiled beside it where
# ways.jax_beside.wanted (ways.compiled.compile_both; benchmarks/tpu_llo.py sets
# PALLAS_TPU_JAX_BESIDE=1 and reads their LLO op counts). The
# values of these ops are checked by the tests above and in test_jax_tpu_ops.py.


def _grads(f):
    return jax.grad(lambda *a: f(*a).sum(), argnums=tuple(range(3)))


def _gmm(m, with_vjp):
    gs = jnp.array([100, 0, 250, 162], jnp.int32)
    if not with_vjp:
        return lambda a, b: m.gmm(a, b, gs)
    return lambda a, b: jax.grad(lambda a, b: m.gmm(a, b, gs).sum(), argnums=(0, 1))(a, b)


_QKV = (jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.float32),) * 3
_SPLASH = (jax.ShapeDtypeStruct((2, 256, 128), jnp.float32),) * 3
_GMM = (jax.ShapeDtypeStruct((512, 256), jnp.float32), jax.ShapeDtypeStruct((4, 256, 256), jnp.float32))
COMPILED_OPS = {
    # name: (module, make(m) -> f, args)
    "flash_fwd": ("flash_attention", lambda m: _flash(m, False), _QKV),
    "flash_fwd_causal": ("flash_attention", lambda m: _flash(m, True), _QKV),
    "flash_fwd_bwd": ("flash_attention", lambda m: _grads(_flash(m, False)), _QKV),
    "splash_fwd": ("splash_attention", _splash, _SPLASH),
    "splash_fwd_bwd": ("splash_attention", lambda m: _grads(_splash(m)), _SPLASH),
    "paged": ("paged_attention", lambda m: lambda *a: m.paged_attention(*a, pages_per_compute_block=2), None),
    "ragged_paged": (
        "ragged_paged_attention.kernel",
        lambda m: (
            lambda *a: m.ragged_paged_attention(
                *a, sm_scale=0.5, num_kv_pages_per_block=2, num_queries_per_block=8
            )
        ),
        None,
    ),
    "megablox_gmm": ("megablox.ops", lambda m: _gmm(m, False), _GMM),
    "megablox_gmm_fwd_bwd": ("megablox.ops", lambda m: _gmm(m, True), _GMM),
    "matmul": (
        "matmul",
        lambda m: lambda x, y: m.matmul(x, y, block_shape=(128, 128), block_k=128, out_dtype=jnp.float32),
        (jax.ShapeDtypeStruct((256, 512), jnp.float32), jax.ShapeDtypeStruct((512, 256), jnp.float32)),
    ),
}


@pytest.mark.parametrize("op", list(COMPILED_OPS))
def test_jax_op_compiled(op):
    rel, make, args = COMPILED_OPS[op]
    if args is None:
        args = {"paged": _paged_inputs, "ragged_paged": _ragged_args}[op]()

    def build(pl, pltpu):
        return make(load(rel) if pl.__name__ == "pallas" else load_jax(rel))

    ways.compiled.compile_both(build, args, ways.compiled.COMPILE_CHIPS)
