"""``pltpu.compile_check``: libtpu's Mosaic compiler on compile-only TPU devices
(no TPU needed). Skipped where libtpu is not installed (``pip install "jax[tpu]"``)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src.mosaic import compile_check

pytestmark = pytest.mark.skipif(
    not compile_check.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]"'
)


def scaled_exp(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.exp(x_ref[...]) * 2.0

    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 8,),
        in_specs=[spec],
        out_specs=spec,
    )(x)


def stochastic_bf16(x, bits):
    """Stochastic rounding to bfloat16: TPU v5 and later have it; Mosaic refuses it for v4."""

    def kernel(x_ref, b_ref, o_ref):
        o_ref[...] = pltpu.stochastic_round(x_ref[...], b_ref[...], target_dtype=jnp.bfloat16)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))(x, bits)


# A shape of its own: JAX reuses the lowering of an identical kernel (with its first locations).
_SR_ARGS = (jax.ShapeDtypeStruct((24, 384), jnp.float32), jax.ShapeDtypeStruct((24, 384), jnp.uint32))


# JAX 0.10.2's libtpu (0.0.42.1): its Mosaic errors do not name the module.
OLD_LIBTPU = jax.__version_info__ < (0, 11)


def _line_of(fn, text):
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_a_kernel_that_compiles_on_each_chip():
    x = jax.random.normal(jax.random.key(0), (32, 128))
    reports = pltpu.compile_check(scaled_exp, x, chips=("v5e", "v6e"))
    assert [(r.chip, r.compiled, r.error) for r in reports] == [("v5e", True, None), ("v6e", True, None)]
    assert all("pallas_call 'kernel'" in r.kernel and "test_compile_check.py" in r.kernel for r in reports)


def _in_fresh_process(check: str) -> None:
    """Runs ``check`` (code using this module's names) in a new Python: once JAX's own
    Pallas TPU module is imported in a process (other test files import it), libtpu's
    messages there carry no ``at location`` (seen with libtpu 0.0.48.1)."""
    script = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\nimport test_compile_check\nglobals().update(vars(test_compile_check))\n{check}"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_mosaic_error_names_the_users_line():
    _in_fresh_process(
        """
line = _line_of(stochastic_bf16, "pltpu.stochastic_round(")
v4, v5e = pltpu.compile_check(stochastic_bf16, *_SR_ARGS, chips=("v4", "v5e"))
assert (v5e.chip, v5e.compiled, v5e.error) == ("v5e", True, None)
assert v4.chip == "v4" and not v4.compiled
assert "pallas_call 'kernel'" in v4.kernel
assert f"at the kernel's line test_compile_check.py:{line}" in v4.error, v4.error
assert "Stochastic convert not supported" in v4.error and "TPU v4" in v4.error
"""
    )


def test_mosaic_error_inside_jit_compile_names_the_kernel_and_line():
    # A plain jax.jit(...).compile() for a TPU: libtpu's own message names the user's
    # line (every op carries its location), and from libtpu 0.0.48.1 (JAX 0.11.2) the
    # kernel (the module's name); 0.0.42.1's (JAX 0.10.2) says "Mosaic failed to compile
    # TPU kernel:" and no name. compile_for's message names both on every libtpu.
    _in_fresh_process(
        """
dev = compile_check.tpu_devices("v4")[0]
placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(dev)) for a in _SR_ARGS]
line = _line_of(stochastic_bf16, "pltpu.stochastic_round(")
try:
    jax.jit(stochastic_bf16).lower(*placed).compile()
    raise SystemExit("compiled")
except Exception as e:
    assert "Mosaic failed to compile TPU kernel" in str(e), str(e)
    assert OLD_LIBTPU or "MLIR module name `kernel`" in str(e), str(e)
    assert f'test_compile_check.py":{line}:' in str(e), str(e)
try:
    compile_check.compile_for(stochastic_bf16, placed, "v4")
    raise SystemExit("compiled")
except pltpu.MosaicCompileError as e:
    assert "refused pallas_call 'kernel' at test_compile_check.py:" in str(e), str(e)
    assert f"at the kernel's line test_compile_check.py:{line}" in str(e), str(e)
"""
    )


def test_llo_counts_in_a_child_process():
    # This process's libtpu does not dump Mosaic's passes: the counts come from a child process.
    assert "xla_mosaic_dump_to" not in os.environ.get("LIBTPU_INIT_ARGS", "")
    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    reports = pltpu.compile_check(scaled_exp, x, chips=("v5e",), llo=True)
    (r,) = reports
    assert r.compiled and r.llo_ops is not None
    # load, exp, multiply, store at least; the loop over the grid is outside the kernel body
    assert r.llo_ops >= 4 and r.llo_loop_ops == 0


def test_llo_op_counts_reads_loops():
    text = """module {
  func.func @k(%arg0: i32) attributes {iteration_bounds = array<i64: 2>, tpu.main} {
    %0 = llo.constant {value = 0 : i32} : i32
    scf.for %i = %c0 to %c4 step %c1 {
      %1 = llo.vector_load %arg0 : i32 -> vector<8x128xf32>
      scf.for %j = %c0 to %c4 step %c1 {
        %2 = llo.vexp.f32 %1 : vector<8x128xf32>
        llo.vector_store %2 into %arg0 : vector<8x128xf32> into i32
      }
    }
    return
  }
  func.func @transform_0(%arg0: i32) -> (i32) {
    %0 = llo.constant {value = 0 : i32} : i32
    return %0 : i32
  }
}"""
    assert compile_check.llo_op_counts(text) == (4, 2)


def test_unknown_chip_and_missing_libtpu(monkeypatch):
    with pytest.raises(pltpu.CompileCheckError, match="unknown TPU chip 'v9'; known: v4, v5e, v5p, v6e"):
        pltpu.compile_check(scaled_exp, jax.ShapeDtypeStruct((8, 128), jnp.float32), chips=("v9",))
    compile_check.tpu_devices.cache_clear()
    monkeypatch.setattr(compile_check, "libtpu_available", lambda: False)
    try:
        with pytest.raises(pltpu.CompileCheckError, match=r'needs libtpu.*pip install "jax\[tpu\]"'):
            pltpu.compile_check(scaled_exp, jax.ShapeDtypeStruct((8, 128), jnp.float32))
    finally:
        compile_check.tpu_devices.cache_clear()


def test_sharded_kernel_on_a_mesh_of_four_chips():
    # A shard_map over a mesh of four compile-only v5e chips, as a user checks a sharded kernel.
    mesh = jax.sharding.Mesh(np.array(compile_check.tpu_devices("v5e")[:4]), ("x",))
    spec = jax.sharding.PartitionSpec("x")
    f = jax.shard_map(scaled_exp, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, spec))
    reports = pltpu.compile_check(f, x, chips=("v5e",))
    assert [(r.chip, r.compiled) for r in reports] == [("v5e", True)]


def test_devices_are_libtpus_compile_only_topology():
    from jax.experimental import topologies

    want = topologies.get_topology_desc("v6e:2x2", "tpu").devices
    got = compile_check.tpu_devices("v6e")
    assert [(d.id, d.device_kind) for d in got] == [(d.id, d.device_kind) for d in want]
    assert all(d.platform == "tpu" and d.device_kind == "TPU v6 lite" for d in got)


def test_reused_compiles_compile_a_module_once_per_chip(monkeypatch):
    """``reuse_compiles`` (the compiled way's, tests/ways/compiled.py): the same module compiles
    once per chip, again for another chip; a refusal is raised again from what was kept."""
    compiles = []
    real = jax.stages.Lowered.compile

    def counted(self, *args, **kwargs):
        compiles.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    monkeypatch.setattr(compile_check, "_REUSED", collections.OrderedDict())
    monkeypatch.setattr(compile_check, "_reuse_limit", 0)
    x = jax.ShapeDtypeStruct((40, 128), jnp.float32)
    compile_check.compile_for(scaled_exp, [x], "v5e")
    compile_check.compile_for(scaled_exp, [x], "v5e")
    assert len(compiles) == 2  # off by default
    compile_check.reuse_compiles(8)
    for chip in ("v5e", "v5e", "v6e", "v6e", "v5e"):
        compile_check.compile_for(scaled_exp, [x], chip)
    assert len(compiles) == 4
    for _ in range(2):
        with pytest.raises(pltpu.MosaicCompileError, match="refused pallas_call 'kernel'"):
            compile_check.compile_for(stochastic_bf16, _SR_ARGS, "v4")
    assert len(compiles) == 5
    compile_check.reuse_compiles(1)  # the least recent dropped
    compile_check.compile_for(scaled_exp, [x], "v5e")
    assert len(compiles) == 6
