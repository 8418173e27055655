"""``pallas_tpu.ops.splash_attention`` against JAX's splash attention and XLA, on a TPU.

    python benchmarks/tpu_ops_splash.py [--only NAME ...] [--quick] [--sweep | --sweep-only] [--rounds N] [--smoke]

Rows (bf16, arguments made on the chip with ``jax.random``, the batch through ``jax.vmap`` of
the kernel as JAX's op is used):

* MHA B2 H16 L4096 D128: full mask and causal, forward; causal forward+backward;
* GQA B1 H32/8 L8192 D128 causal, and a sliding window of 1024 keys (``LocalMask``);
* D256: B1 H8 L8192 causal;
* chunked prefill against a 32k context: B1 H32 (MQA) 512 queries x 32768 keys, causal with
  the queries at the end (``CausalMask(offset=)``).

Candidates: ours with its own blocks; JAX's ``make_splash_mha``/``make_splash_mqa`` at its
default blocks (128; only up to 4096 queries and keys: beyond, a call takes 10-50 ms) and at
tuned ones (the best of 512 and 1024 square blocks, which fit its default scoped VMEM); XLA's
``jax.nn.dot_product_attention`` with the dense mask. ``--quick`` times ours and JAX's at 1024
only (and 512 for the window and D256 rows, where 512 can win) and checks ours against JAX's
(no XLA), so that each row takes well under 200 s on a v5e. Each time is
the median of rounds of back-to-back calls (``_timing.measure``); TFLOP/s count the visible
(query, key) pairs only (4 * pairs * head_dim forward, 14 * pairs * head_dim forward+backward);
peak is the v5e's 197 bf16 TFLOP/s; ratios are ours over JAX's best and over XLA. Each output is
checked against XLA's (max |diff| / max |XLA|). Writes results/tpu_ops_splash.csv.

``--sweep`` then times ours over block choices per workload. ``--smoke`` runs tiny shapes in
interpret mode on a CPU (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import pallas_tpu  # noqa: F401
except ImportError:  # run from a checkout: the packages' sources
    sys.path[:0] = [
        str(ROOT / "packages" / "pallas-core" / "src"),
        str(ROOT / "packages" / "pallas-tpu" / "src"),
    ]

import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_tpu as pltpu  # noqa: E402
from pallas_tpu.ops import splash_attention as ours  # noqa: E402

PEAK_V5E = 197.0
SWEEP = [
    (1024, 4096, 512), (1024, 4096, 1024), (2048, 2048, 512), (1024, 2048, 512), (1024, 2048, 1024),
    (1024, 1024, 512), (1024, 1024, 1024),
]  # fmt: skip


def _rand(seed, shape, dtype=jnp.bfloat16):
    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype))(jax.random.key(seed))


def _jax_splash():
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention as jsa

        return jsa
    except ImportError as e:
        print(f"JAX's splash attention does not import: {e}")
        return None


class Workload:
    """One row: ``mask(module)`` builds the mask with a module's classes (ours or JAX's)."""

    def __init__(self, name, batch, heads, kv_heads, q_len, kv_len, head_dim, mask, grad=False, small=False):
        self.name, self.batch, self.heads, self.kv_heads = name, batch, heads, kv_heads
        self.q_len, self.kv_len, self.head_dim, self.mask, self.grad = q_len, kv_len, head_dim, mask, grad
        self.small = small  # JAX's 512 blocks may beat its 1024 ones (kept by --quick)

    def args(self):
        b, h, kvh, lq, lk, d = self.batch, self.heads, self.kv_heads, self.q_len, self.kv_len, self.head_dim
        kv_shape = (b, lk, d) if kvh == 0 else (b, kvh, lk, d)
        q = _rand(0, (b, h, lq, d)) * (d**-0.5)
        return q, _rand(1, kv_shape), _rand(2, kv_shape)

    def dense(self):
        return np.asarray(self.mask(ours)[:, :])

    def flops(self):
        pairs = self.batch * self.heads * int(self.dense().sum())
        return (14 if self.grad else 4) * pairs * self.head_dim

    def kernel(self, module, blocks=None, interpret=None):
        mask = module.MultiHeadMask([self.mask(module)] * self.heads)
        make = (
            module.make_splash_mqa_single_device
            if self.kv_heads == 0
            else module.make_splash_mha_single_device
        )
        kw = {} if interpret is None else dict(interpret=interpret)
        return make(mask, block_sizes=blocks, **kw)

    def wrap(self, kernel):
        f = jax.vmap(kernel)
        if not self.grad:
            return jax.jit(f)
        return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))

    def xla(self):
        dense = jnp.asarray(self.dense())
        group = 1 if self.kv_heads == 0 else self.heads // self.kv_heads

        def attend(q, k, v):
            if self.kv_heads == 0:
                k, v = k[:, None], v[:, None]
                k, v = (
                    jnp.broadcast_to(k, (*k.shape[:1], self.heads, *k.shape[2:])),
                    jnp.broadcast_to(v, (*v.shape[:1], self.heads, *v.shape[2:])),
                )
            elif group > 1:
                k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
            t = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [b, l, h, d]
            out = jax.nn.dot_product_attention(t(q), t(k), t(v), mask=dense[None, None], scale=1.0)
            return t(out)

        if not self.grad:
            return jax.jit(attend)
        return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))


def workloads(smoke):
    def causal(shape, offset=0):
        return lambda m: m.CausalMask(shape, offset=offset)

    if smoke:
        s = (256, 256)
        return [
            Workload("MHA B1 H2 L256 D128 causal", 1, 2, 2, 256, 256, 128, causal(s)),
            Workload(
                "GQA B1 H4/2 L256 D128 local 64", 1, 4, 2, 256, 256, 128, lambda m: m.LocalMask(s, (64, 0), 0)
            ),
            Workload("MHA B1 H2 L256 D128 causal fwd+bwd", 1, 2, 2, 256, 256, 128, causal(s), grad=True),
            Workload("MHA B1 H2 L256 D256 causal", 1, 2, 2, 256, 256, 256, causal(s), small=True),
            Workload("MQA B1 H2 prefill 128 x 512 causal", 1, 2, 0, 128, 512, 128, causal((128, 512), 384)),
        ]
    s4, s8 = (4096, 4096), (8192, 8192)
    return [
        Workload("MHA B2 H16 L4096 D128 full", 2, 16, 16, 4096, 4096, 128, lambda m: m.FullMask(s4)),
        Workload("MHA B2 H16 L4096 D128 causal", 2, 16, 16, 4096, 4096, 128, causal(s4)),
        Workload("MHA B2 H16 L4096 D128 causal fwd+bwd", 2, 16, 16, 4096, 4096, 128, causal(s4), grad=True),
        Workload("MHA B2 H16 L4096 D128 full fwd+bwd", 2, 16, 16, 4096, 4096, 128, lambda m: m.FullMask(s4), grad=True),
        Workload("MHA B1 H16 L8192 D128 full fwd+bwd", 1, 16, 16, 8192, 8192, 128, lambda m: m.FullMask(s8), grad=True),
        Workload("MHA B1 H16 L8192 D128 causal fwd+bwd", 1, 16, 16, 8192, 8192, 128, causal(s8), grad=True),
        Workload("GQA B1 H32/8 L8192 D128 causal", 1, 32, 8, 8192, 8192, 128, causal(s8)),
        Workload("GQA B1 H32/8 L8192 D128 causal fwd+bwd", 1, 32, 8, 8192, 8192, 128, causal(s8), grad=True),
        Workload("GQA B1 H32/8 L8192 D128 window 1024", 1, 32, 8, 8192, 8192, 128, lambda m: m.LocalMask(s8, (1024, 0), 0), small=True),
        Workload("MHA B1 H8 L8192 D256 causal", 1, 8, 8, 8192, 8192, 256, causal(s8), small=True),
        Workload(
            "MQA B1 H32 prefill 512 x 32768 causal", 1, 32, 0, 512, 32768, 128, causal((512, 32768), 32768 - 512)
        ),
    ]  # fmt: skip


def jax_sizes(w, smoke, quick):
    """JAX's square blocks to time for ``w``: 128 (its default) up to 4096 queries and keys,
    512 and 1024; ``quick``: 1024, and 512 where it may win; ``smoke``: 128 only."""
    if smoke:
        return [128]
    if quick:
        return [512, 1024] if w.small else [1024]
    return ([128] if max(w.q_len, w.kv_len) <= 4096 else []) + [512, 1024]


def candidates(w, smoke, quick=False):
    interp = pltpu.InterpretParams() if smoke else None
    own_kernel = w.kernel(ours, interpret=interp)
    cands = {"ours": w.wrap(own_kernel)}
    if (
        w.grad
    ):  # ours' own blocks, the backward as two kernels (dq apart from dk and dv; the default fuses them)
        split = own_kernel.kwargs["block_sizes"]  # as kept: complete, the dq blocks those of dk/dv
        cands["ours split"] = w.wrap(w.kernel(ours, split, interpret=interp))
    jsa = _jax_splash()
    if jsa is not None:
        jinterp = True if smoke else None
        for size in jax_sizes(w, smoke, quick):
            label = "JAX default 128" if size == 128 else f"JAX {size}"
            bq, bkv = min(size, w.q_len), min(size, w.kv_len)
            blocks = jsa.BlockSizes(
                block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv,
            )  # fmt: skip
            variants = {label: blocks}
            if w.grad and not smoke:  # JAX's fused dk/dv/dq kernel (its dq blocks unset)
                fused = dict(block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True)
                variants[f"JAX {size} fused"] = dataclasses.replace(blocks, **fused)
            for name, b in variants.items():
                try:
                    cands[name] = w.wrap(w.kernel(jsa, b, interpret=jinterp))
                except Exception as e:  # blocks JAX's op refuses for this shape
                    print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if not quick or smoke:
        cands["XLA"] = w.xla()
    return cands


def _err(out, ref):
    errs = [
        float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))))
        / (float(jnp.max(jnp.abs(r.astype(jnp.float32)))) + 1e-30)
        for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref))
    ]
    return max(errs)


def time_all(cands, args, rounds, smoke, first=None):
    """``({name: seconds a call}, {name: why it failed})``; ``first``, a dict, gets each one's
    first call (trace, lower, compile and run: a kernel of its own per candidate) in seconds."""
    runnable, failed = {}, {}
    for name, fn in cands.items():
        try:
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            if first is not None:
                first[name] = time.perf_counter() - start
            runnable[name] = (functools.partial(fn, *args), jax.block_until_ready)
        except Exception as e:  # one that does not compile here does not hide the others
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if smoke:
        return {name: 1.0 for name in runnable}, failed
    return _timing.measure(runnable, rounds=rounds, min_round_s=0.05), failed


def report(w, cands, rounds, smoke, rows):
    args = w.args()
    times, failed = time_all(cands, args, rounds, smoke)
    # the reference of the error column: XLA's, else (--quick) JAX's largest blocks
    ref_name = (
        "XLA" if "XLA" in times else next((n for n in reversed(list(times)) if n.startswith("JAX")), None)
    )
    ref = cands[ref_name](*args) if ref_name is not None else None
    best_jax = min((t for n, t in times.items() if n.startswith("JAX")), default=None)
    flops = w.flops()
    for impl in cands:
        if impl in failed:
            print(f"| {w.name} | {impl} | FAILED {failed[impl]} |")
            rows.append(dict(workload=w.name, impl=impl, error=failed[impl]))
            continue
        t = times[impl]
        tflops = flops / t / 1e12
        err = _err(cands[impl](*args), ref) if ref is not None and impl != ref_name else 0.0
        row = dict(
            workload=w.name, impl=impl, ms=round(t * 1e3, 4), tflops=round(tflops, 2),
            peak=round(tflops / PEAK_V5E, 3), vs_jax_best=round(best_jax / t, 3) if best_jax else "",
            vs_xla=round(times["XLA"] / t, 3) if "XLA" in times else "", err=f"{err:.2g}",
        )  # fmt: skip
        rows.append(row)
        print(
            f"| {w.name} | {impl} | {row['ms']:.3f} | {tflops:.1f} | {row['peak']:.0%} | {row['vs_jax_best']} "
            f"| {row['vs_xla']} | {row['err']} |",
            flush=True,
        )


def sweep(ws, rounds, smoke, rows):
    print("\n## sweep: ours over blocks (block_q, block_kv, block_kv_compute)\n")
    print("| workload | blocks | ms | TFLOP/s | peak | first call s |\n|---|---|---|---|---|---|")
    interp = pltpu.InterpretParams() if smoke else None
    for w in ws:
        args, flops, cands = w.args(), w.flops(), {}
        for bq, bkv, bc in SWEEP[:2] if smoke else SWEEP:
            bq, bkv, bc = min(bq, w.q_len), min(bkv, w.kv_len), min(bc, w.kv_len)
            try:
                blocks = ours.BlockSizes(bq, bkv, bc)
                cands[f"{bq}/{bkv}/{bc}"] = w.wrap(w.kernel(ours, blocks, interpret=interp))
            except ValueError as e:
                print(f"| {w.name} | {bq}/{bkv}/{bc} | {e} |")
        first: dict[str, float] = {}
        times, failed = time_all(cands, args, rounds, smoke, first)
        for label, t in sorted(times.items(), key=lambda kv: kv[1]):
            tf = flops / t / 1e12
            print(
                f"| {w.name} | {label} | {t * 1e3:.3f} | {tf:.1f} | {tf / PEAK_V5E:.0%} | {first[label]:.2f} |",
                flush=True,
            )
            rows.append(
                dict(workload=w.name, impl=f"ours {label}", ms=round(t * 1e3, 4), tflops=round(tf, 2),
                     first_call_s=round(first[label], 2))
            )  # fmt: skip
        for label, why in failed.items():
            print(f"| {w.name} | {label} | FAILED {why} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in TPU interpret mode (no TPU needed)")
    ap.add_argument("--sweep", action="store_true", help="also time ours over block sizes")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep")
    ap.add_argument(
        "--only", nargs="*", default=[], help="substrings of the workloads' names (e.g. D256 MQA)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="ours and JAX's 1024 blocks (and 512 where it may win) only"
    )
    ap.add_argument("--exact", action="store_true", help="--only names whole workloads, not substrings")
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args(argv)
    ws = [
        w for w in workloads(a.smoke)
        if not a.only or any(s == w.name if a.exact else s in w.name for s in a.only)
    ]  # fmt: skip
    if not ws:
        sys.exit(f"no workload's name contains any of {a.only}: {[w.name for w in workloads(a.smoke)]}")
    print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}")
    rows = []
    if not a.sweep_only:
        print(
            "| workload | impl | ms | TFLOP/s | peak | ours/JAX best | /XLA | err |\n|---|---|---|---|---|---|---|---|"
        )
        for w in ws:
            report(w, candidates(w, a.smoke, a.quick), a.rounds, a.smoke, rows)
    if a.sweep or a.sweep_only:
        sweep(ws, max(3, a.rounds // 2), a.smoke, rows)
    out = ROOT / "benchmarks" / "results" / "tpu_ops_splash.csv"
    if not a.smoke:
        out.parent.mkdir(exist_ok=True)
        keys = sorted({k for r in rows for k in r})
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
