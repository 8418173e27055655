"""tokamax's Pallas Triton flash attention on JAX's Pallas and on ours, on the GPU.

    python benchmarks/tokamax_attention.py            # needs tokamax (pip install tokamax) and a GPU

tokamax (openxla's kernel library) writes its Triton attention in Pallas. This runs
``tokamax.dot_product_attention(..., implementation="triton")`` unchanged, forward and
forward+backward (``jax.grad``), causal and not, twice, each side in a fresh process:
on JAX's Pallas Triton backend (the reference), and on ours, tokamax's Pallas imports
rewritten to ``pallas``/``pallas_gpu`` at import time (``tests/downstream/pallas_rewrite.py``;
no tokamax code is copied). Each process also times cuDNN (``jax.nn.dot_product_attention``)
on the same arrays. The table prints TFLOP/s, ours / JAX's, and how far apart the two
sides' results are (max abs difference of outputs and gradients, and each side's error
against an f32 XLA reference).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
B, S, H, D = 4, 4096, 32, 128


def _flops(causal: bool, bwd: bool) -> float:
    f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)  # fwd + bwd: the forward again (recomputed) and 2.5x for the gradients


def _child(side: str, out: Path) -> None:
    if side == "ours":
        sys.path.insert(0, str(ROOT / "tests" / "downstream"))
        import pallas_rewrite

        pallas_rewrite.install("tokamax")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tokamax
    from _timing import measure

    assert jax.default_backend() == "gpu", "needs a GPU"
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, S, H, D), jnp.bfloat16) for key in (kq, kk, kv))
    dout = jax.random.normal(kg, (B, S, H, D), jnp.bfloat16)
    rows, results = {}, {}
    for causal in (False, True):

        def fwd(q, k, v, impl, causal=causal):
            if impl == "cudnn":
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
            return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="triton")

        def fwd_bwd(q, k, v, impl):
            o, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, impl), q, k, v)
            return (o, *vjp(dout))

        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            cands = {}
            for impl in ("triton", "cudnn"):
                f = jax.jit(lambda q, k, v, fn=fn, impl=impl: fn(q, k, v, impl))
                cands[impl] = (lambda f=f: f(q, k, v), jax.block_until_ready)
            t = measure(cands)
            tag = f"{name}{' causal' if causal else ''}"
            flops = _flops(causal, name != "fwd")
            rows[tag] = {impl: flops / s / 1e12 for impl, s in t.items()}
            got = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, "triton"))(q, k, v)
            got = got if isinstance(got, tuple) else (got,)
            for i, g in enumerate(got):
                np.save(out / f"{side}-{tag}-{i}.npy", np.asarray(g.astype(jnp.float32)))
            results[tag] = len(got)
    (out / f"{side}.json").write_text(json.dumps({"rows": rows, "outputs": results}))


def _reference(out: Path) -> None:
    """f32 XLA attention and its gradients, written beside the sides' outputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, S, H, D), jnp.bfloat16).astype(jnp.float32) for key in (kq, kk, kv))
    dout = jax.random.normal(kg, (B, S, H, D), jnp.bfloat16).astype(jnp.float32)
    for causal in (False, True):

        def f(q, k, v, causal=causal):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

        def fwd_bwd(q, k, v, dout, f=f):  # one jit: a vjp closure handed to jit is a constant of GBs
            o, vjp = jax.vjp(f, q, k, v)
            return (o, *vjp(dout))

        o, *grads = jax.jit(fwd_bwd)(q, k, v, dout)
        tag = " causal" if causal else ""
        np.save(out / f"ref-fwd{tag}-0.npy", np.asarray(o))
        for i, g in enumerate((o, *grads)):
            np.save(out / f"ref-fwd+bwd{tag}-{i}.npy", np.asarray(g))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("jax", "ours", "ref"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side == "ref":
        _reference(Path(args.out))
        return 0
    if args.side:
        _child(args.side, Path(args.out))
        return 0
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
        for side in ("jax", "ours", "ref"):
            print(f"--- {side} ...", flush=True)
            subprocess.run([sys.executable, __file__, "--side", side, "--out", tmp], env=env, check=True)
        res = {side: json.loads((out / f"{side}.json").read_text()) for side in ("jax", "ours")}
        print(f"\ntokamax attention, implementation='triton', B{B} S{S} H{H} D{D} bf16 (TFLOP/s)")
        print(
            f"{'workload':<17} {'JAX Pallas':>10} {'ours':>8} {'ours/JAX':>9} {'cuDNN':>7} {'ours/cuDNN':>10}"
            f" {'|ours-JAX|':>10} {'err JAX':>8} {'err ours':>8}"
        )
        for tag in res["jax"]["rows"]:
            j, o = res["jax"]["rows"][tag], res["ours"]["rows"][tag]
            n = res["jax"]["outputs"][tag]
            diff = err_j = err_o = 0.0
            for i in range(n):
                a = np.load(out / f"jax-{tag}-{i}.npy")
                b = np.load(out / f"ours-{tag}-{i}.npy")
                r = np.load(out / f"ref-{tag}-{i}.npy")
                scale = float(np.abs(r).max())
                diff = max(diff, float(np.abs(a - b).max()) / scale)
                err_j = max(err_j, float(np.abs(a - r).max()) / scale)
                err_o = max(err_o, float(np.abs(b - r).max()) / scale)
            cudnn = (j["cudnn"] + o["cudnn"]) / 2
            print(
                f"{tag:<17} {j['triton']:>10.0f} {o['triton']:>8.0f} {o['triton'] / j['triton']:>9.2f}"
                f" {cudnn:>7.0f} {o['triton'] / cudnn:>10.2f} {diff:>10.1e} {err_j:>8.1e} {err_o:>8.1e}"
            )
        print(
            "errors: max abs difference over outputs (and dq, dk, dv), relative to the reference's max |value|"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
