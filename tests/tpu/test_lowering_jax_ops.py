"""JAX's own TPU kernels (``jax.experimental.pallas.ops.tpu``, ported by the
import rewrite of ``test_jax_tpu_ops.py``) through our Mosaic lowering.

For each op, the modules in the exported ``tpu_custom_call``s are decoded,
canonicalized and compared with the modules JAX's own lowering puts there for
the unmodified op: the same functions with the same signatures and attributes,
and the same ops (constants aside). Some also run through ``run_mosaic`` and
are compared with a ``jnp`` reference.
"""

from __future__ import annotations

import base64
import collections
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import three_way
from jax import export
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
from pallas_tpu._src import executor


def custom_call_bodies(text: str) -> list[bytes]:
    """The serialized modules in the ``tpu_custom_call``s of exported text
    (MLIR escapes a string attribute's bytes as ``\\XX`` hex pairs)."""
    out = []
    for m in re.finditer(r'custom_call @tpu_custom_call\(.*?backend_config = "((?:[^"\\]|\\.)*)"', text):
        raw = re.sub(r"\\([0-9A-Fa-f]{2})", lambda h: chr(int(h.group(1), 16)), m.group(1))
        out.append(base64.b64decode(json.loads(raw)["custom_call_config"]["body"]))
    return out


def exported_bodies(f, *args) -> list[bytes]:
    with jax.sharding.use_abstract_mesh(three_way.TPU_V5E):
        text = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    return custom_call_bodies(text)


def run_ours(f, *args):
    """``f(*args)`` with each pallas_call replaced by run_mosaic of our exported module."""
    bodies = exported_bodies(f, *args)
    closed = jax.make_jaxpr(f)(*args)
    outs = _eval(closed.jaxpr, closed.consts, list(args), bodies)
    assert not bodies
    return outs


CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}
CALLS["custom_vjp_call"] = "call_jaxpr"


def _eval(jaxpr, consts, args, bodies):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if type(v).__name__ == "Literal" else env[v]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "pallas_call":
            shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            aliases = dict(eqn.params.get("input_output_aliases", ()))
            outs = pltpu.run_mosaic(bodies.pop(0), *ins, out_shape=shapes, input_output_aliases=aliases)
        elif eqn.primitive.name in CALLS:
            sub = eqn.params[CALLS[eqn.primitive.name]]
            outs = _eval(sub.jaxpr, sub.consts, ins, bodies)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


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
    ``same_ops=False`` the same side effects and no op JAX does not emit."""
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
            assert not ca - cb
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
    assert_same_as_jax(modules(call(pa), *args), modules(call(jpa), *args), same_ops=False)


@pytest.mark.xfail(
    jax.__version_info__ >= (0, 12),
    reason="run_mosaic does not execute tpu.wait_dma yet (the DMA wait JAX 0.12's lowering, and ours, emit)",
)
def test_paged_attention_runs():
    pa = load("paged_attention")
    args = _paged_inputs()
    [out] = run_ours(lambda *a: pa.paged_attention(*a, pages_per_compute_block=2), *args)
    np.testing.assert_allclose(out, paged_attention_ref(*args), rtol=1e-4, atol=1e-4)


def test_example_kernel_same_as_jax():
    ex, jex = load("example_kernel"), load_jax("example_kernel")
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    assert_same_as_jax(modules(ex.double, x), modules(jex.double, x))
