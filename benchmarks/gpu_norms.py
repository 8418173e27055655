"""``pallas_gpu.ops`` layer norm, RMS norm and softmax beside JAX's
``jax.experimental.pallas.ops.gpu`` versions, f32 16384 x 8192, in one run.

Forward, and forward + backward for the norms (a ``jax.vjp`` with a fixed
cotangent); each with its default launch parameters; outputs checked against
plain jnp. Figures are bytes the kernels must move (forward: read x, write y;
forward + backward: that plus read x and dy, write dx) over time, in TB/s,
medians of interleaved rounds (``_timing.measure``).

    python benchmarks/gpu_norms.py            # on the GPU
    python benchmarks/gpu_norms.py --small    # tiny shapes through Triton's interpreter, no timing
"""

from __future__ import annotations

import argparse
import sys
import warnings

import jax
import jax.numpy as jnp
from _timing import measure

import pallas_gpu as plgpu
from pallas_gpu.ops import layer_norm, rms_norm, softmax


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, Triton's interpreter, no timing")
    args = ap.parse_args()
    rows, n = (8, 256) if args.small else (16384, 8192)
    keys = jax.random.split(jax.random.key(0), 4)
    x, dy = (jax.random.normal(k, (rows, n), jnp.float32) for k in keys[:2])
    w, b = (jax.random.normal(k, (n,), jnp.float32) for k in keys[2:])
    mine = {"layer_norm": layer_norm.layer_norm, "rms_norm": rms_norm.rms_norm, "softmax": softmax.softmax}
    theirs = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import layer_norm as jln
            from jax.experimental.pallas.ops.gpu import rms_norm as jrms
            from jax.experimental.pallas.ops.gpu import softmax as jsm
        theirs = {"layer_norm": jln.layer_norm, "rms_norm": jrms.rms_norm, "softmax": jsm.softmax}
    except Exception as e:  # noqa: BLE001
        print(f"JAX's ops unavailable: {e!r}")
    interp = {"ours": plgpu.InterpretParams() if args.small else False, "JAX": bool(args.small)}
    xm = x - x.mean(-1, keepdims=True)
    refs = {
        "layer_norm": xm / jnp.sqrt((xm * xm).mean(-1, keepdims=True) + 1e-5) * w + b,
        "rms_norm": x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w + b,
        "softmax": jax.nn.softmax(x, axis=-1),
    }
    failed = []
    print(f"f32 {rows}x{n}; jax {jax.__version__}, device {jax.devices()[0]}")
    for name in mine:
        for what in ("forward", "forward+backward") if name != "softmax" else ("forward",):
            runners = {}
            for col, fns in (("ours", mine), ("JAX", theirs)):
                if name not in fns:
                    continue
                fn, it = fns[name], interp[col]
                call = (
                    (lambda x, w, b, fn=fn, it=it: fn(x, interpret=it))
                    if name == "softmax"
                    else (lambda x, w, b, fn=fn, it=it: fn(x[None], w, b, interpret=it)[0])
                )  # JAX's take [batch, seq, n]; fmt: skip
                if what == "forward":
                    run = jax.jit(call)
                else:
                    run = jax.jit(
                        lambda x, w, b, call=call: (lambda o, vjp: (o, *vjp(dy)))(*jax.vjp(call, x, w, b))
                    )
                try:
                    out = run(x, w, b)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {what} {col}: ERROR {type(e).__name__}: {str(e)[:300]}")
                    continue
                first = out[0] if isinstance(out, tuple) else out
                err = float(jnp.max(jnp.abs(first - refs[name])))
                ok = err < 1e-3
                print(f"  check {name} {what} {col}: {'PASS' if ok else 'FAIL'} max_abs_err={err:.2e}")
                if ok:
                    runners[col] = (lambda run=run: run(x, w, b), jax.block_until_ready)
                else:
                    failed.append(f"{name} {what} {col}")
            if args.small or not runners:
                continue
            t = measure(runners, rounds=9, min_round_s=0.1)
            nbytes = 4 * rows * n * (2 if what == "forward" else 5)
            figs = {col: nbytes / s / 1e12 for col, s in t.items()}
            line = " | ".join(f"{col} {v:.2f} TB/s" for col, v in figs.items())
            ratio = f"  ours/JAX = {figs['ours'] / figs['JAX']:.3f}x" if len(figs) == 2 else ""
            print(f"[{name} {what}] {line}{ratio}")
    print(f"failed checks: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
