"""Memory-bound forward passes against the copy ceiling:
``pallas_gpu.ops`` softmax, layer norm and RMS norm, f32 and bf16,
16384 x 8192, beside JAX's Pallas ops of the same names, XLA (plain jnp) and
the device copy (an XLA ``a + 1`` over 1 GiB f32), all in the same run.

Figures are the bytes the kernel must move (read x, write y) over the time,
in TB/s, and the ratios ours / copy (target >= 0.95), ours / JAX's Pallas and
ours / XLA. Our defaults row is always printed; a few launch configurations
of ours are timed beside it (2 quick rounds each, the best kept as "tuned").
Every candidate's output is checked against an f32 XLA reference first.
Then a sweep over the row width (1k-16k features, 2**27 elements in all,
defaults only) writes ``benchmarks/results/memory_bound.csv`` and, if
matplotlib imports, ``memory_bound.png`` (also copied to ``$OUT`` when set).

    python benchmarks/memory_bound.py            # on the GPU
    python benchmarks/memory_bound.py --small    # tiny shapes through the interpreters, no timing
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
from _timing import RESULTS, Panel, measure, write_results
from jax import lax

import pallas_gpu as plgpu
from pallas_gpu.ops import _norm as ours_norm
from pallas_gpu.ops import layer_norm as ours_ln
from pallas_gpu.ops import rms_norm as ours_rms
from pallas_gpu.ops import softmax as ours_sm

F32, BF16 = jnp.float32, jnp.bfloat16
FIELDS = ["op", "dtype", "features", "rows", "impl", "ms", "TBps", "of_copy"]
FAST_INTERPRET = "--time" in sys.argv
OPS = ("softmax", "layer_norm", "rms_norm")
# (rows per program, warps, cache hint) timed beside softmax's and layer norm's defaults
LAUNCHES = [(r, w, ev) for r in (1, 2) for w in (4, 8, 16) for ev in (None, "evict_first")]


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def jax_ops():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import layer_norm as jln
            from jax.experimental.pallas.ops.gpu import rms_norm as jrms
            from jax.experimental.pallas.ops.gpu import softmax as jsm
        return {"softmax": jsm.softmax, "layer_norm": jln.layer_norm, "rms_norm": jrms.rms_norm}
    except Exception as e:  # noqa: BLE001
        print(f"JAX's Pallas ops unavailable: {e!r}")
        return {}


def xla(op):
    """Plain jnp (f32 math), as a user writes it."""

    def f(x, w, b):
        xf = x.astype(F32)
        if op == "softmax":
            return jax.nn.softmax(xf, axis=-1).astype(x.dtype)
        if op == "layer_norm":
            xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)
        return (y * w.astype(F32) + b.astype(F32)).astype(x.dtype)

    return jax.jit(f)


def columns(op, small, jax_fns, tuned=True):
    """{column: {config label: jitted f(x, w, b)}}; ours' first config is the default."""
    # --small: Triton's interpreter runs our generated kernels; --small --time: pallas-core's (fast on a CPU)
    it = (True if FAST_INTERPRET else plgpu.InterpretParams()) if small else False
    cols = {"ours": {}}
    tune = tuned and (not small or FAST_INTERPRET)
    if op == "softmax":
        cols["ours"]["default"] = jax.jit(lambda x, _w, _b: ours_sm.softmax(x, interpret=it))
        for rows, w, ev in LAUNCHES if tune else ():
            cols["ours"][f"{rows}r/{w}w/{ev or 'no hint'}"] = jax.jit(
                lambda x, _w, _b, rows=rows, w=w, ev=ev: ours_sm.forward(
                    x, block_rows=rows, num_warps=w, evict=ev, interpret=it
                )
            )
    elif op == "layer_norm":
        cols["ours"]["default"] = jax.jit(lambda x, wt, b: ours_ln.layer_norm(x, wt, b, interpret=it))
        for rows, w, ev in LAUNCHES if tune else ():
            cols["ours"][f"{rows}r/{w}w/{ev or 'no hint'}"] = jax.jit(
                lambda x, wt, b, rows=rows, w=w, ev=ev: ours_norm.forward(
                    x, wt, b, eps=1e-5, center=True, num_warps=w, num_stages=3, interpret=it,
                    name="layer_norm", block_rows=rows, evict=ev,
                )[0]
            )  # fmt: skip
    else:
        cols["ours"]["default"] = jax.jit(lambda x, wt, b: ours_rms.rms_norm(x, wt, b, interpret=it))
        if tuned and (not small or FAST_INTERPRET):
            for rows, w, ev in [(1, 8, "evict_first"), (1, 16, None), (1, 8, None), (2, 16, "evict_first"),
                                (1, 4, "evict_first"), (4, 16, "evict_first")]:  # fmt: skip
                cols["ours"][f"{rows}r/{w}w/{ev or 'no hint'}"] = jax.jit(
                    lambda x, wt, b, rows=rows, w=w, ev=ev: ours_rms.forward(
                        x, wt, b, block_rows=rows, num_warps=w, evict=ev, interpret=it
                    )
                )
    if op in jax_fns:
        fn, jit_ = jax_fns[op], bool(small)
        if op == "softmax":
            cols["JAX Pallas"] = {"default": jax.jit(lambda x, _w, _b: fn(x, interpret=jit_))}
        else:  # JAX's norms take [batch, seq, features]
            cols["JAX Pallas"] = {"default": jax.jit(lambda x, w, b: fn(x[None], w, b, interpret=jit_)[0])}
    cols["XLA"] = {"": xla(op)}
    return cols


def make_data(rows, n, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (1.0 + 2.0 * jax.random.normal(k[0], (rows, n), F32)).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(k[1], (n,), F32)).astype(dtype)
    b = (0.1 * jax.random.normal(k[2], (n,), F32)).astype(dtype)
    return x, w, b


def checked(cols, args, ref, dtype, failed, verbose=True):
    """Runs every candidate once; keeps those whose max error relative to
    max|ref| is within 2e-2 (bf16) or 1e-4 (f32)."""
    tol = 2e-2 if dtype == BF16 else 1e-4
    scale = float(jnp.max(jnp.abs(ref)))
    out = {}
    for col, cands in cols.items():
        for label, f in cands.items():
            name = f"{col} {label}".strip()
            try:
                err = float(jnp.max(jnp.abs(f(*args).astype(F32) - ref))) / scale
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                if col == "ours":
                    failed.append(name)
                continue
            ok = err < tol
            if verbose and (not ok or label in ("default", "")):
                print(f"  check {name}: {'PASS' if ok else 'FAIL'} max_err/max|ref|={err:.1e}")
            if ok:
                out.setdefault(col, {})[label] = (lambda f=f: f(*args), jax.block_until_ready)
            elif col == "ours":
                failed.append(name)
    return out


def copy_runner(nbytes=1 << 30):
    x = jnp.ones((nbytes // 4,), F32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * nbytes, ((lambda: f(x)), jax.block_until_ready)


def same_bytes_copy(x):
    """XLA ``a + 1`` over an f32 array of as many bytes as ``x``: the copy of
    the bytes an op moves, with the fixed per-call costs that a copy of a
    smaller array pays alike (f32, since XLA's bf16 ``a + 1`` runs at about
    3.25 TB/s on the H200: it is no copy)."""
    a = jnp.ones((x.size * x.dtype.itemsize // 4,), F32)
    f = jax.jit(lambda a: a + 1.0)
    return (lambda: f(a)), jax.block_until_ready


def main_figures(title, runners, nbytes, copy, summary, same=None):
    final, labels = {}, {}
    for col, cands in runners.items():
        if col == "ours" and "default" in cands:
            final["ours (default)"] = cands["default"]
            if len(cands) > 1:
                t = measure(cands, rounds=2, min_round_s=0.03)
                print(
                    "  tune ours: "
                    + " | ".join(f"{k} {nbytes / v / 1e12:.2f}" for k, v in t.items())
                    + " TB/s"
                )
                best = min(t, key=t.get)
                final["ours (tuned)"], labels["ours (tuned)"] = cands[best], best
        else:
            final[col] = next(iter(cands.values()))
    final["copy"] = copy[1]
    if same is not None:
        final["copy, same bytes"] = same
    t = measure(final, rounds=7, min_round_s=0.1)
    tbs = {c: (copy[0] if c == "copy" else nbytes) / s / 1e12 for c, s in t.items()}
    print(f"[{title}] " + " | ".join(f"{c} {v:.2f} TB/s" + (f" ({labels[c]})" if c in labels else "")
                                    for c, v in tbs.items()))  # fmt: skip
    for mine in [c for c in tbs if c.startswith("ours")]:
        refs = ("copy", "copy, same bytes", "JAX Pallas", "XLA")
        parts = [f"{ref} {tbs[mine] / tbs[ref]:.3f}x" for ref in refs if ref in tbs]
        met = "MET" if tbs[mine] >= 0.95 * tbs["copy"] else "MISSED"
        print(f"  {mine} / " + " | ".join(parts) + f"   (target >= 0.95x copy: {met})")
    summary.append((title, tbs))


def sweep(args, jax_fns, failed):
    widths = [128, 256] if args.small else [1024, 4096, 8192, 16384]
    total = 2**11 if args.small else 2**27
    rows_out, copy = [], copy_runner(1 << (20 if args.small else 30))
    for op in OPS:
        for dtype in (F32, BF16):
            for n in widths:
                rows = total // n
                data = make_data(rows, n, dtype, seed=n)
                runners = checked(columns(op, args.small, jax_fns, tuned=False), data, xla(op)(*data).astype(F32),
                                  dtype, failed, verbose=False)  # fmt: skip
                if args.small and not args.time:
                    continue
                flat = {c: next(iter(r.values())) for c, r in runners.items()}
                flat["copy"] = copy[1]
                t = measure(flat, rounds=3, min_round_s=0.05)
                nbytes = 2 * rows * n * jnp.dtype(dtype).itemsize
                copy_tbs = copy[0] / t["copy"] / 1e12
                line = []
                for c, s in t.items():
                    tbs = copy_tbs if c == "copy" else nbytes / s / 1e12
                    rows_out.append({"op": op, "dtype": jnp.dtype(dtype).name, "features": n, "rows": rows,
                                     "impl": c, "ms": "" if c == "copy" else f"{s * 1e3:.4f}", "TBps": f"{tbs:.3f}",
                                     "of_copy": f"{tbs / copy_tbs:.3f}"})  # fmt: skip
                    line.append(f"{c} {tbs:.2f}")
                print(f"  {op} {jnp.dtype(dtype).name} {rows}x{n}: " + " | ".join(line) + " TB/s", flush=True)
                del data, runners, flat
                gc.collect()
    if rows_out:
        panels = [[Panel(f"{op} {dt}", "features", "TBps", {"op": op, "dtype": dt},
                         xlabel="features per row (2**27 elements)", ylabel="TB/s") for op in OPS]
                  for dt in ("float32", "bfloat16")]  # fmt: skip
        write_results("memory_bound", rows_out, FIELDS, panels, out_dir=args.out, panel_size=(5, 4))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--small", action="store_true", help="tiny shapes through the interpreters, no timing (any machine)"
    )
    ap.add_argument(
        "--time", action="store_true", help="with --small: also run the timing code (to test the script)"
    )
    ap.add_argument("--no-sweep", action="store_true", help="only the 16384 x 8192 figures")
    ap.add_argument("--out", default=str(RESULTS), help="folder of the CSV and PNG")
    args = ap.parse_args()
    if not args.small and not has_gpu():
        print("memory_bound benchmark: needs a GPU (none found by jax.devices()); --small checks on the CPU")
        return 0
    jax_fns, failed, summary = jax_ops(), [], []
    rows, n = (64, 256) if args.small else (16384, 8192)
    copy = copy_runner(1 << (20 if args.small else 30))
    print(f"jax {jax.__version__}, device {jax.devices()[0]}; {rows}x{n}, TB/s = (read x + write y) / time")
    for op in OPS:
        for dtype in (F32, BF16):
            title = f"{op} {jnp.dtype(dtype).name} {rows}x{n}"
            try:
                data = make_data(rows, n, dtype)
                print(title)
                runners = checked(
                    columns(op, args.small, jax_fns), data, xla(op)(*data).astype(F32), dtype, failed
                )
                if runners and (not args.small or args.time):
                    main_figures(title, runners, 2 * rows * n * jnp.dtype(dtype).itemsize, copy, summary,
                                 same_bytes_copy(data[0]))  # fmt: skip
                del data, runners
                gc.collect()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                failed.append(title)
    if summary:
        print("\nsummary (TB/s; copy measured alongside each row):")
        for title, tbs in summary:
            print(f"  {title:34s} " + " | ".join(f"{c} {v:.2f}" for c, v in tbs.items()))
    if not args.no_sweep:
        try:
            sweep(args, jax_fns, failed)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed.append("sweep")
    print(f"failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
