"""The compiled way's recorder (``tpu_compiled.py``) on a kernel written here: traced in
TPU interpret mode on JAX's Pallas and on ours, then lowered by each side and compiled
by libtpu's Mosaic for v5e and v6e; a kernel that only ours refuses to lower is reported
as such. Each side runs in a fresh process (the recorder patches ``pallas_call_p.bind``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='needs libtpu: pip install "jax[tpu]"'
)

CODE = """
import json, sys
sys.path.insert(0, {here!r})
import jax, jax.numpy as jnp
import tpu_compiled
side = {side!r}
tpu_compiled.record(side)
if side == "jax":
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
else:
    import pallas as pl
    import pallas_tpu as pltpu
pltpu.set_tpu_interpret_mode(pltpu.InterpretParams())

def scaled(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...]) * 2.0

def f(x):
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
    y = pl.pallas_call(scaled, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                       in_specs=[spec], out_specs=spec)(x)
    return jax.vmap(lambda r: r * 2)(y)

x = jax.random.normal(jax.random.key(0), (16, 128), jnp.float32)
out = jax.jit(f)(x)
assert jnp.allclose(out, jnp.exp(x) * 4.0, rtol=1e-5)
jax.jit(f)(x)  # cached: no second record
print(json.dumps(tpu_compiled.compile_recorded(side)))
"""


@pytest.mark.parametrize("side", ["jax", "ours"])
def test_records_and_compiles_each_kernel_once(side):
    code = CODE.format(here=str(HERE), side=side)
    env = {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(r[0].partition(" at ")[0], r[1], r[2]) for r in rows] == [
        ("scaled", "v5e", "compiled"),
        ("scaled", "v6e", "compiled"),
    ], rows
