"""Decode attention (one query token per sequence) at a serving size:
``pallas_gpu.ops.decode_attention.gqa`` and ``pallas_gpu.ops.paged_attention``
beside JAX's Pallas ``gqa`` and ``paged_attention``, XLA (plain jnp), cuDNN
through ``jax.nn.dot_product_attention(..., implementation="cudnn")`` and the
device copy ceiling, all measured in the same run.

Serving size: batch 32, 32 query heads over 8 KV heads, 8192 cached tokens,
head dim 128, bf16 (K + V read: 1.07 GB); paged: 16-token pages in a
shuffled pool, and (column "ours paged in-order") the same default kernel on a
pool that holds each sequence's pages in order, which shows what the shuffle
costs. Every sequence is full (the same bytes for every column).
Figures: ms and TB/s of KV bytes read (the copy ceiling: bytes read + written
by an XLA ``a + 1`` over 1 GiB), and the ratios ours / each reference. Our
defaults row is always printed; a few tuned configurations of ours are timed
beside it (2 quick rounds each, the best kept). Every candidate's output is
checked against an f32 XLA reference first (a failing one is reported, not
timed). Then a sweep over 1k-32k cached tokens (default arguments) writes
``benchmarks/results/decode_attention.csv`` and, if matplotlib imports,
``decode_attention.png`` (also copied to ``$OUT`` when set).

    python benchmarks/decode_attention.py            # on the GPU
    python benchmarks/decode_attention.py --small    # tiny shapes through the interpreters, no timing
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from _timing import RESULTS, Panel, measure, write_results

import pallas_gpu as plgpu
from pallas_gpu.ops import decode_attention as ours_dec
from pallas_gpu.ops import paged_attention as ours_paged

F32, BF16 = jnp.float32, jnp.bfloat16
FIELDS = ["tokens", "impl", "ms", "TBps_kv", "of_copy"]
FAST_INTERPRET = "--time" in sys.argv


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def jax_ops():
    """JAX's Pallas decode_attention and paged_attention modules, or (None, None)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import decode_attention as jdec
            from jax.experimental.pallas.ops.gpu import paged_attention as jpaged
        return jdec, jpaged
    except Exception as e:  # noqa: BLE001
        print(f"JAX's Pallas ops unavailable: {e!r}")
        return None, None


class Problem:
    """q, dense K/V [B, S, Hkv, D] and the same K/V as a shuffled page pool."""

    def __init__(self, B, Hq, Hkv, S, D, page_size, seed=0):
        self.shape = (B, Hq, Hkv, S, D)
        ks = jax.random.split(jax.random.key(seed), 3)
        self.q = jax.random.normal(ks[0], (B, Hq, D), F32).astype(BF16)
        self.k = jax.random.normal(ks[1], (B, S, Hkv, D), F32).astype(BF16)
        self.v = jax.random.normal(ks[2], (B, S, Hkv, D), F32).astype(BF16)
        pps = S // page_size
        perm = np.random.default_rng(seed).permutation(B * pps)
        self.tables = jnp.asarray(perm.reshape(B, pps), jnp.int32)
        inv = jnp.asarray(np.argsort(perm), jnp.int32)  # pool page p holds (row, page) inv[p]

        self.page_size = page_size
        self.k_pages, self.v_pages = self._pool(self.k)[:, inv], self._pool(self.v)[:, inv]
        self.lengths = jnp.full((B,), S, jnp.int32)
        self.scale = 1.0 / math.sqrt(D)
        self.kv_bytes = 2 * B * S * Hkv * D * 2

    def _pool(self, x):  # [B, S, Hkv, D] -> [Hkv, B * pps, page_size, D], each row's pages in order
        B, S, Hkv, D = x.shape
        return jnp.transpose(x.reshape(B * S // self.page_size, self.page_size, Hkv, D), (2, 0, 1, 3))

    def inorder(self):
        """(k_pages, v_pages, tables) of a pool that holds row b's pages in order at
        b * pps ... b * pps + pps - 1: a dense cache's layout, which separates what reading
        scattered pages costs from what the kernel does."""
        B, S = self.k.shape[:2]
        pps = S // self.page_size
        return self._pool(self.k), self._pool(self.v), jnp.arange(B * pps, dtype=jnp.int32).reshape(B, pps)

    def reference(self):
        """f32 XLA attention (the check for every candidate)."""
        B, Hq, Hkv, S, D = self.shape
        qg = self.q.astype(F32).reshape(B, Hkv, Hq // Hkv, D)
        s = jnp.einsum("bhgd,bshd->bhgs", qg, self.k.astype(F32), precision="highest") * self.scale
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhgs,bshd->bhgd", p, self.v.astype(F32), precision="highest")
        return o.reshape(B, Hq, D)


def xla_gqa(q, k, v, scale):
    """Plain jnp, as a user writes it: bf16 einsums with f32 accumulation, f32 softmax."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    s = jnp.einsum("bhgd,bshd->bhgs", q.reshape(B, Hkv, Hq // Hkv, D), k, preferred_element_type=F32) * scale
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgs,bshd->bhgd", p.astype(v.dtype), v, preferred_element_type=F32)
    return o.reshape(B, Hq, D).astype(q.dtype)


def columns(pb: Problem, small: bool, jdec, jpaged):
    """{column: {config label: zero-arg callable}}; the first config of "ours gqa"
    and "ours paged" is the default."""
    # --small: Triton's interpreter runs our generated kernels; --small --time: pallas-core's (fast on a CPU)
    it = (True if FAST_INTERPRET else plgpu.InterpretParams()) if small else False
    q, k, v, s = pb.q, pb.k, pb.v, pb.scale
    qs = (q.astype(F32) * s).astype(BF16)  # paged_attention does not scale logits
    P = (pb.k_pages, pb.v_pages, pb.tables, pb.lengths)

    def gqa(**kw):
        return jax.jit(lambda q, k, v: ours_dec.gqa(q, k, v, interpret=it, **kw)), (q, k, v)

    def paged(**kw):
        return jax.jit(lambda q, *a: ours_paged.paged_attention(q, *a, interpret=it, **kw)), (qs, *P)

    def paged_on(k_pages, v_pages, tables):
        f = jax.jit(lambda q, *a: ours_paged.paged_attention(q, *a, interpret=it))
        return f, (qs, k_pages, v_pages, tables, pb.lengths)

    cols = {"ours gqa": {"default": gqa()}, "ours paged": {"default": paged()}}
    if not small or FAST_INTERPRET:
        for bk, st, w, ks in [(64, 4, 4, None), (128, 2, 4, None), (128, 3, 8, None), (32, 4, 4, None),
                              (64, 3, 4, 4), (64, 3, 4, 16)]:  # fmt: skip
            cols["ours gqa"][f"bk{bk}/{st}s/{w}w/ks{ks or 'auto'}"] = gqa(
                block_k=bk, num_stages=st, num_warps=w, k_splits=ks
            )
        for pp, st, w, ks in [(4, 4, 4, None), (8, 2, 4, None), (8, 3, 8, None), (2, 4, 4, None), (4, 3, 4, 16)]:  # fmt: skip
            cols["ours paged"][f"pp{pp}/{st}s/{w}w/ks{ks or 'auto'}"] = paged(
                pages_per_compute_block=pp, num_stages=st, num_warps=w, k_splits=ks
            )
    if not small:  # the default kernel on a pool whose pages are in order: what the shuffle costs
        cols["ours paged in-order"] = {"default": paged_on(*pb.inorder())}
    if jdec is not None:
        cols["JAX gqa"] = {
            "default": (jax.jit(lambda q, k, v: jdec.gqa(q, k, v, interpret=bool(small))), (q, k, v))
        }
    if jpaged is not None:
        f = jax.jit(lambda q, *a: jpaged.paged_attention(q, *a, interpret=bool(small)))
        cols["JAX paged"] = {"default": (f, (qs, *P))}
    cols["XLA"] = {"": (jax.jit(lambda q, k, v: xla_gqa(q, k, v, s)), (q, k, v))}
    if not small:
        cudnn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, scale=s, implementation="cudnn")[
                :, 0
            ]
        )
        cols["cuDNN"] = {"": (cudnn, (q, k, v))}
    return cols


def checked(cols, ref, tol, failed):
    """Runs every candidate once; keeps those within ``tol`` of ``ref``: {column: {label: runner}}."""
    out = {}
    for col, cands in cols.items():
        for label, (f, args) in cands.items():
            name = f"{col} {label}".strip()
            try:
                got = f(*args)
                err = float(jnp.max(jnp.abs(got.astype(F32) - ref)))
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                if col.startswith("ours"):
                    failed.append(name)
                continue
            ok = err < tol
            if not ok or label in ("default", ""):
                print(f"  check {name}: {'PASS' if ok else 'FAIL'} max_abs_err={err:.2e}")
            if ok:
                out.setdefault(col, {})[label] = (lambda f=f, args=args: f(*args), jax.block_until_ready)
            elif col.startswith("ours"):
                failed.append(name)
    return out


def copy_runner(nbytes=1 << 30):
    x = jnp.ones((nbytes // 4,), F32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * nbytes, ((lambda: f(x)), jax.block_until_ready)


def main_table(pb, runners, copy):
    """Tunes ours (2 quick rounds per config), then times the defaults, the best
    tuned configs, the references and the copy in 7 interleaved rounds."""
    final, labels = {}, {}
    for col, cands in runners.items():
        if col.startswith("ours") and "default" in cands:
            final[f"{col} (default)"] = cands["default"]
            if len(cands) > 1:
                t = measure(cands, rounds=2, min_round_s=0.03)
                print(
                    f"  tune {col}: "
                    + " | ".join(f"{k} {pb.kv_bytes / v / 1e12:.2f}" for k, v in t.items())
                    + " TB/s"
                )
                best = min(t, key=t.get)
                final[f"{col} (tuned)"], labels[f"{col} (tuned)"] = cands[best], best
        else:
            final[col] = next(iter(cands.values()))
    final["copy"] = copy[1]
    t = measure(final, rounds=7, min_round_s=0.1)
    tbs = {c: (copy[0] if c == "copy" else pb.kv_bytes) / s / 1e12 for c, s in t.items()}
    print(f"\n{'column':22s} {'ms':>8s} {'TB/s':>7s}  (KV bytes read; copy: bytes read + written)")
    for c in t:
        print(f"{c:22s} {t[c] * 1e3:8.3f} {tbs[c]:7.2f}  {labels.get(c, '')}")
    print()
    for mine in [c for c in t if c.startswith("ours")]:
        parts = [
            f"{ref} {tbs[mine] / tbs[ref]:.3f}x"
            for ref in ("cuDNN", "JAX gqa", "JAX paged", "XLA", "copy")
            if ref in tbs
        ]
        print(f"{mine:22s} / " + " | ".join(parts))
    for mine in ("ours gqa (default)", "ours paged (default)"):
        if mine in t:
            goals = []
            if "cuDNN" in t:
                goals.append(f"time <= cuDNN's: {'MET' if t[mine] <= t['cuDNN'] else 'MISSED'}")
            goals.append(f">= 0.9x copy: {'MET' if tbs[mine] >= 0.9 * tbs['copy'] else 'MISSED'}")
            print(f"target {mine}: " + ", ".join(goals))
    return t, tbs


def sweep(args, jdec, jpaged, failed):
    """Default arguments over 1k-32k cached tokens -> CSV (+ PNG)."""
    tokens = [256, 512] if args.small else [1024, 2048, 4096, 8192, 16384, 32768]
    B, Hq, Hkv, D = (2, 8, 2, 32) if args.small else (32, 32, 8, 128)
    rows, copy = [], copy_runner(1 << (20 if args.small else 30))
    for S in tokens:
        pb = Problem(B, Hq, Hkv, S, D, 16, seed=S)
        cols = columns(pb, args.small, jdec, jpaged)
        cols = {c: {lb: r for lb, r in cands.items() if lb in ("default", "")} for c, cands in cols.items()}
        runners = checked(cols, pb.reference(), 3e-2, failed)
        if args.small and not args.time:
            print(f"  sweep {S} tokens: checked {sorted(runners)}")
            continue
        flat = {c: next(iter(r.values())) for c, r in runners.items()}
        flat["copy"] = copy[1]
        t = measure(flat, rounds=3, min_round_s=0.05)
        copy_tbs = copy[0] / t["copy"] / 1e12
        line = []
        for c, s in t.items():
            if c == "copy":
                continue
            tbs = pb.kv_bytes / s / 1e12
            rows.append({"tokens": S, "impl": c, "ms": f"{s * 1e3:.4f}", "TBps_kv": f"{tbs:.3f}",
                         "of_copy": f"{tbs / copy_tbs:.3f}"})  # fmt: skip
            line.append(f"{c} {tbs:.2f}")
        rows.append({"tokens": S, "impl": "copy", "ms": "", "TBps_kv": f"{copy_tbs:.3f}", "of_copy": "1.000"})
        print(f"  {S:6d} tokens (TB/s of KV): " + " | ".join(line) + f" | copy {copy_tbs:.2f}", flush=True)
        del pb, cols, runners, flat
        gc.collect()
    if rows:
        title = f"decode attention, B{B} {Hq}q/{Hkv}kv heads D{D} bf16"
        panel = Panel(title, "tokens", "TBps_kv", xlabel="cached tokens", ylabel="TB/s of KV read")
        write_results("decode_attention", rows, FIELDS, [panel], out_dir=args.out, panel_size=(8, 5))


def serving_table(args, jdec, jpaged, failed) -> None:
    shape = (2, 8, 2, 256, 32) if args.small else (32, 32, 8, 8192, 128)
    pb = Problem(*shape, page_size=16)
    print(f"decode: batch {shape[0]}, {shape[1]} q heads / {shape[2]} KV heads, {shape[3]} tokens, D{shape[4]}, "
          f"bf16, 16-token pages; KV read {pb.kv_bytes / 1e9:.3f} GB")  # fmt: skip
    runners = checked(columns(pb, args.small, jdec, jpaged), pb.reference(), 3e-2, failed)
    if not args.small or args.time:
        main_table(pb, runners, copy_runner(1 << (20 if args.small else 30)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--small", action="store_true", help="tiny shapes through the interpreters, no timing (any machine)"
    )
    ap.add_argument(
        "--time", action="store_true", help="with --small: also run the timing code (to test the script)"
    )
    ap.add_argument("--no-sweep", action="store_true", help="only the serving-size table")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep over 1k-32k cached tokens")
    ap.add_argument("--out", default=str(RESULTS), help="folder of the CSV and PNG")
    args = ap.parse_args()
    if not args.small and not has_gpu():
        print(
            "decode_attention benchmark: needs a GPU (none found by jax.devices()); --small checks on the CPU"
        )
        return 0
    jdec, jpaged = jax_ops()
    failed = []
    print(f"jax {jax.__version__}, device {jax.devices()[0]}")
    for wanted, part, what in ((not args.sweep_only, serving_table, "serving-size table"),
                               (not args.no_sweep, sweep, "sweep")):  # fmt: skip
        if not wanted:
            continue
        try:
            part(args, jdec, jpaged, failed)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed.append(what)
        gc.collect()
    print(f"failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
