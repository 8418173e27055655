"""pallas-gpu and jax-triton share one Triton interpreter and one lock: a
pallas-gpu kernel and a ``triton_call`` interpreted at the same time, and a
GPU compile meanwhile, do not race on the interpreter's global state (the
program id, the patched ``triton.language``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import threading
    import jax, jax.numpy as jnp, numpy as np
    import triton, triton.language as tl
    import jax_triton as jt
    import pallas as pl, pallas_gpu as plgpu
    from pallas_gpu._src.compile import compiler
    from pallas_gpu._src.pallas_call_registration import lowered_kernel

    @triton.jit
    def scale_kernel(x_ptr, o_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs) * 2.0 + tl.program_id(0))

    def pallas_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 3.0 + pl.program_id(0).astype(jnp.float32)

    x = jnp.arange(4096, dtype=jnp.float32)
    ids = np.repeat(np.arange(64, dtype=np.float32), 64)
    tc = jax.jit(lambda x: jt.triton_call(x, kernel=scale_kernel, out_shape=x, grid=64, BLOCK=64))
    pc = jax.jit(pl.pallas_call(
        pallas_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(64,),
        in_specs=[pl.BlockSpec((64,), lambda i: (i,))], out_specs=pl.BlockSpec((64,), lambda i: (i,)),
        interpret=plgpu.InterpretParams()))
    errors = []

    def loop(f, want):
        try:
            for _ in range(4):
                np.testing.assert_array_equal(np.asarray(f(x)), want)
        except BaseException as e:
            errors.append(repr(e)[:2000])

    def compile_for_gpu():
        try:
            for n in (1024, 2048, 3072):
                f = pl.pallas_call(
                    lambda x_ref, o_ref: o_ref.__setitem__(Ellipsis, x_ref[...] + 1.0),
                    jax.ShapeDtypeStruct((n,), jnp.float32), grid=(n // 512,),
                    in_specs=[pl.BlockSpec((512,), lambda i: (i,))],
                    out_specs=pl.BlockSpec((512,), lambda i: (i,)))
                eqn = [e for e in jax.make_jaxpr(f)(jnp.zeros(n)).jaxpr.eqns if e.primitive.name == "pallas_call"][0]
                lk = lowered_kernel(eqn.params["jaxpr"], eqn.params["grid_mapping"])
                assert compiler.compiled_configs(lk, 90, [plgpu.CompilerParams()])[0][1].image
        except BaseException as e:
            errors.append(repr(e)[:2000])

    xs = np.asarray(x)
    threads = [threading.Thread(target=loop, args=(tc, xs * 2 + ids)),
               threading.Thread(target=loop, args=(pc, xs * 3 + ids)),
               threading.Thread(target=compile_for_gpu)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors, errors
    print("OK")
    """
)


def test_pallas_gpu_and_triton_call_interpret_and_compile_at_once(tmp_path):
    path = tmp_path / "script.py"  # @triton.jit reads its source from a file
    path.write_text(SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PALLAS_GPU_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().endswith("OK")
