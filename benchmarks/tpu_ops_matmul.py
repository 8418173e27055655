"""``pallas_tpu.ops.matmul`` and ``pallas_tpu.ops.megablox`` against JAX's ops and XLA, on a TPU.

    python benchmarks/tpu_ops_matmul.py [--only NAME ...] [--sweep | --sweep-only] [--rounds N] [--smoke]
    python benchmarks/tpu_ops_matmul.py --candidates --rounds 5   # the candidate kernel variants

Rows (bf16 operands, arguments made on the chip with ``jax.random``):

* matmul 8192^3 and 4096^3 (bf16 out), and skinny ones (64-256 rows against 4096-28672:
  decode projections; ours also at the blocks ``pltpu.estimate`` ranks best): ours with its own blocks, ours with JAX's example
  blocks (512/512/1024), JAX's example kernel (``ops.tpu.matmul``, blocks 512/512/1024),
  XLA's ``jnp.dot``;
* gmm G8 8192x2048x2048 (even groups, and uneven: a routing histogram), and G32
  16384x4096x4096 uneven (bf16 out), G8 even with an f32 result: ours with its own
  tiling, JAX's ``megablox.gmm`` with its default tiling (128, 128, 128) and a tuned one
  (512, 1024, 1024: the largest of its tiles that fit the v5e's default 16 MiB of scoped
  VMEM, which JAX's op does not raise), XLA's ``lax.ragged_dot``;
* tgmm (the weight gradient) G8 8192x2048x2048: ours (lhs [k, m] as ``tgmm`` takes it, and
  lhs [m, k] as the custom VJP hands it over), JAX's ``tgmm`` (default and tuned), XLA's
  transpose of ``ragged_dot`` (``jax.vjp``);
* gmm fwd+bwd G8 8192x2048x2048 uneven: ``jax.grad`` (d lhs, d rhs) of the differentiable
  ``megablox.gmm``, ours and JAX's (default and tuned tiling), and of ``ragged_dot``
  (3 x 2mkn flops).

Each time is the median of 10 rounds (``_timing.measure``: back-to-back calls of at least
50 ms per round, candidates alternating) after a warm-up call; TFLOP/s count 2mkn, the
fraction of peak is of the v5e's 197 bf16 TFLOP/s, the ratios are ours (own blocks) over
XLA and over JAX's best. Each output is checked against XLA's (max |diff| / max |XLA|).
Writes results/tpu_ops_matmul.csv (and .png).

``--sweep`` then times ours over block choices at the same shapes (matmul
``(bm, bn, bk)``, gmm and tgmm ``(tm, tk, tn)``; 5 rounds each) and prints the fastest per
shape: the rows of the v5e's matmul table (``pallas_tpu.ops._policy.v5e``) and ``megablox.gmm.choose_tiling``.
``--candidates`` times, instead of the rows above, the variants that
benchmarks/tpu_gmm_schedule.py ranks best (``MATMUL_CANDIDATES``, ``GMM_CANDIDATES``: blocks,
and module switches such as ``matmul._kernel.FIRST_STEP`` and ``megablox.gmm.GMM_TABLE`` set while
the op is traced) beside the defaults, JAX's op and XLA at matmul 4096^3 and gmm G8
8192x2048x2048 even, and gmm's visit table alone; writes results/tpu_ops_matmul_candidates.csv.
``--sweep-only`` runs the sweep alone, ``--only`` then picking its shapes ("matmul",
"gmm G8", "gmm G32", "tgmm"). ``--smoke`` runs tiny shapes in
interpret mode on a CPU (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
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
from pallas_tpu.ops import matmul as ours_matmul  # noqa: E402

ours_gmm = importlib.import_module("pallas_tpu.ops.megablox.gmm")
PEAK_V5E = 197.0
JAX_EXAMPLE_BLOCKS = (512, 512, 1024)  # (bm, bn, bk)
JAX_TUNED_TILING = (512, 1024, 1024)  # (tm, tk, tn)

MATMUL_SWEEP = [
    (512, 512, 1024), (512, 1024, 1024), (1024, 512, 1024), (1024, 1024, 512), (1024, 1024, 1024),
    (1024, 1024, 2048), (2048, 1024, 512), (1024, 2048, 512), (2048, 1024, 1024), (1024, 2048, 1024),
    (2048, 2048, 256), (2048, 2048, 512),
]  # fmt: skip
GMM_SWEEP = {
    2048: [(256, 2048, 2048), (512, 2048, 2048), (512, 2048, 1024), (512, 1024, 2048), (512, 1024, 1024),
           (1024, 2048, 2048), (1024, 2048, 1024), (512, 512, 2048)],
    4096: [(512, 4096, 1024), (512, 4096, 2048), (512, 2048, 2048), (512, 2048, 4096), (256, 4096, 2048),
           (512, 1024, 4096), (1024, 4096, 1024), (512, 4096, 512)],
}  # fmt: skip
TGMM_SWEEP = [
    (512, 1024, 1024), (256, 1024, 1024), (1024, 1024, 1024), (512, 2048, 1024), (512, 1024, 2048),
    (512, 2048, 2048), (512, 512, 1024), (512, 512, 512),
]  # fmt: skip


def _rand(seed, shape, dtype=jnp.bfloat16):
    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype))(jax.random.key(seed))


def _group_sizes(groups, m, even):
    if even:
        sizes = np.full(groups, m // groups, np.int32)
    else:  # a routing histogram (benchmarks/tpu_ops.py's): uneven, a few groups small
        w = np.random.default_rng(0).dirichlet(np.ones(groups) * 4)
        sizes = np.floor(w * m).astype(np.int32)
    sizes[-1] += m - sizes.sum()
    return jax.device_put(jnp.asarray(sizes, jnp.int32))


class Side:
    """How to call ours and JAX's ops here: on a TPU as they are; with ``--smoke`` in
    interpret mode (ours: TPU interpret mode; JAX's: its interpret modes)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke

    def ours(self):
        return dict(interpret=pltpu.InterpretParams()) if self.smoke else {}

    def jax_megablox(self):
        return dict(interpret=True) if self.smoke else {}

    def jax_matmul(self, fn):
        if not self.smoke:
            return fn
        from jax.experimental.pallas import tpu as jax_pltpu

        def interpreted(*args):
            with jax_pltpu.force_tpu_interpret_mode():
                return fn(*args)

        return interpreted


def matmul_workload(side, m, k, n):
    x, y = _rand(0, (m, k)), _rand(1, (k, n))
    bm, bn, bk = JAX_EXAMPLE_BLOCKS if m >= 512 else (min(m, 128), 128, 128)
    cands = {
        "ours": functools.partial(ours_matmul.matmul, **side.ours()),
        f"ours {bm}/{bn}/{bk}": functools.partial(
            ours_matmul.matmul, block_shape=(bm, bn), block_k=bk, **side.ours()
        ),
        "XLA": jax.jit(jnp.dot),
    }
    try:
        from jax.experimental.pallas.ops.tpu import matmul as jax_matmul

        cands[f"JAX {bm}/{bn}/{bk}"] = side.jax_matmul(
            functools.partial(jax_matmul.matmul, block_shape=(bm, bn), block_k=bk)
        )
    except ImportError as e:
        print(f"JAX's matmul op does not import: {e}")
    return (x, y), cands, 2.0 * m * k * n


def skinny_workload(side, m, k, n, picks):
    """A decode projection (few rows against a large weight): ours with its own blocks and with
    the blocks ``pltpu.estimate`` ranked best for the v5e (``picks``: (bm, bn, bk) each), XLA,
    JAX's example kernel with blocks of the rows by 512 by 1024."""
    (x, y), cands, flops = matmul_workload(side, m, k, n)
    for bm, bn, bk in picks:
        cands[f"ours {bm}/{bn}/{bk}"] = functools.partial(
            ours_matmul.matmul, block_shape=(bm, bn), block_k=bk, **side.ours()
        )
    return (x, y), cands, flops


def gmm_workload(side, groups, m, k, n, *, even, out_dtype=jnp.bfloat16):
    lhs, rhs, sizes = _rand(0, (m, k)), _rand(1, (groups, k, n)), _group_sizes(groups, m, even)
    small = m < 4096
    jax_default, jax_tuned = ((128, 128, 128), (128, 128, 128) if small else JAX_TUNED_TILING)
    cands = {
        "ours": functools.partial(ours_gmm.gmm, preferred_element_type=out_dtype, **side.ours()),
        "XLA": jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=out_dtype)),
    }
    try:
        jax_gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
        for tiling in dict.fromkeys([jax_default, jax_tuned]):
            cands["JAX " + "/".join(map(str, tiling))] = functools.partial(
                jax_gmm.gmm, preferred_element_type=out_dtype, tiling=tiling, **side.jax_megablox()
            )
    except ImportError as e:
        print(f"JAX's megablox does not import: {e}")
    return (lhs, rhs, sizes), cands, 2.0 * m * k * n


def tgmm_workload(side, groups, m, k, n, *, even):
    """d rhs of gmm: lhs^T [k, m] and d out [m, n] per group -> [groups, k, n]."""
    lhs_t, grad, sizes = _rand(0, (k, m)), _rand(1, (m, n)), _group_sizes(groups, m, even)
    small = m < 4096
    jax_default, jax_tuned = ((128, 128, 128), (128, 128, 128) if small else JAX_TUNED_TILING)

    def xla(lhs_t, grad, sizes):
        rhs0 = jnp.zeros((groups, k, n), jnp.bfloat16)
        _, pullback = jax.vjp(lambda r: jax.lax.ragged_dot(lhs_t.T, r, sizes), rhs0)
        return pullback(grad)[0]

    lhs = jax.jit(jnp.transpose)(lhs_t)

    def ours_rows_first(lhs_t, grad, sizes):
        # The custom VJP's form: the forward's lhs [m, k] as it lies, contracted over its rows.
        return ours_gmm.transposed_gmm(
            lhs,
            grad,
            sizes,
            jnp.bfloat16,
            None,
            None,
            None,
            None,
            side.ours().get("interpret", False),
            lhs_rows_first=True,
        )

    cands = {
        "ours": functools.partial(ours_gmm.tgmm, preferred_element_type=jnp.bfloat16, **side.ours()),
        "ours lhs [m, k]": jax.jit(ours_rows_first),
        "XLA": jax.jit(xla),
    }
    try:
        jax_gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
        for tiling in dict.fromkeys([jax_default, jax_tuned]):
            cands["JAX " + "/".join(map(str, tiling))] = functools.partial(
                jax_gmm.tgmm, preferred_element_type=jnp.bfloat16, tiling=tiling, **side.jax_megablox()
            )
    except ImportError as e:
        print(f"JAX's megablox does not import: {e}")
    return (lhs_t, grad, sizes), cands, 2.0 * m * k * n


def gmm_grad_workload(side, groups, m, k, n, *, even):
    """Forward and backward of the differentiable gmm (d lhs, d rhs), bf16 throughout."""
    lhs, rhs, sizes = _rand(0, (m, k)), _rand(1, (groups, k, n)), _group_sizes(groups, m, even)
    tuned = (128, 128, 128) if m < 4096 else JAX_TUNED_TILING

    def grad_of(gmm_fn):
        def loss(lhs, rhs, sizes):
            return jnp.sum(gmm_fn(lhs, rhs, sizes).astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    ours_ops = importlib.import_module("pallas_tpu.ops.megablox.ops")
    interpret = side.ours().get("interpret", False)
    cands = {
        "ours": grad_of(
            lambda a, b, c: ours_ops.gmm(a, b, c, jnp.bfloat16, None, None, None, False, interpret)
        ),
        "XLA": grad_of(lambda a, b, c: jax.lax.ragged_dot(a, b, c, preferred_element_type=jnp.bfloat16)),
    }
    try:
        jax_ops = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.ops")
        for tiling in dict.fromkeys([(128, 128, 128), tuned]):
            cands["JAX " + "/".join(map(str, tiling))] = grad_of(
                functools.partial(
                    lambda a, b, c, t: jax_ops.gmm(a, b, c, jnp.bfloat16, t, None, None, False, side.smoke),
                    t=tiling,
                )
            )
    except ImportError as e:
        print(f"JAX's megablox does not import: {e}")
    return (lhs, rhs, sizes), cands, 3 * 2.0 * m * k * n


# --candidates: the kernel variants benchmarks/tpu_gmm_schedule.py ranks best,
# beside the defaults, JAX's op and XLA, at the two shapes whose targets were missed.
# Each: (label, blocks or tiling or None for the op's own, {(module, attribute): value}
# set while the op is traced).
_MM = "pallas_tpu.ops.matmul._kernel"
_GMM = "pallas_tpu.ops.megablox.gmm"
MATMUL_CANDIDATES = [
    ("ours first=zero (as measured 2026-12-06)", None, {(_MM, "FIRST_STEP"): "zero"}),
    ("ours 1024/512/4096", (1024, 512, 4096), {}),
    ("ours 512/1024/4096", (512, 1024, 4096), {}),
    ("ours 1024/1024/2048", (1024, 1024, 2048), {}),
]
GMM_CANDIDATES = [
    ("ours dense table", None, {(_GMM, "GMM_TABLE"): "dense"}),
    ("ours 512/2048/1024 dense table", (512, 2048, 1024), {(_GMM, "GMM_TABLE"): "dense"}),
    ("ours 1024/2048/1024", (1024, 2048, 1024), {}),
    ("ours 1024/2048/1024 dense table", (1024, 2048, 1024), {(_GMM, "GMM_TABLE"): "dense"}),
]


def _switched(fn, switches, **static):
    """``fn`` (a jitted op's Python function) jitted afresh with module attributes set while
    it is traced (a fresh trace: the op's own jit cache holds the default's)."""

    def traced(*args):
        saved = {}
        try:
            for (mod, attr), value in switches.items():
                module = importlib.import_module(mod)
                saved[(module, attr)] = getattr(module, attr)
                if attr == "GMM_TABLE" and value == "dense":
                    value = importlib.import_module("pallas_tpu.ops.megablox._schedule").gmm_schedule_dense
                setattr(module, attr, value)
            return fn(*args, **static)
        finally:
            for (module, attr), value in saved.items():
                setattr(module, attr, value)

    return jax.jit(traced)


def candidate_workloads(side, smoke):
    """The --candidates rows: matmul 4096^3 and gmm G8 8192x2048x2048 even (bf16 out), each
    with ours (default), the candidates, JAX's op and XLA; and gmm's visit table alone."""
    m, groups, gm, gk, gn = (256, 4, 512, 256, 256) if smoke else (4096, 8, 8192, 2048, 2048)

    def matmul_cands():
        args, cands, flops = matmul_workload(side, m, m, m)
        cands = {k: v for k, v in cands.items() if k in ("ours", "XLA") or k.startswith("JAX")}
        for label, blocks, switches in MATMUL_CANDIDATES:
            static = dict(side.ours())
            if blocks is not None:
                if smoke:
                    blocks = (128, 128, 128)
                static.update(block_shape=blocks[:2], block_k=blocks[2])
            cands[label] = _switched(ours_matmul.matmul.__wrapped__, switches, **static)
        return args, cands, flops

    def gmm_cands():
        args, cands, flops = gmm_workload(side, groups, gm, gk, gn, even=True)
        for label, tiling, switches in GMM_CANDIDATES:
            static = dict(preferred_element_type=jnp.bfloat16, **side.ours())
            if tiling is not None:
                static["tiling"] = (128, 128, 128) if smoke else tiling
            cands[label] = _switched(ours_gmm.gmm.__wrapped__, switches, **static)
        return args, cands, flops

    def table_cands():
        sched = importlib.import_module("pallas_tpu.ops.megablox._schedule")
        tm = ours_gmm.choose_tiling(gm, gk, gn, groups, jnp.bfloat16, jnp.bfloat16)[0]
        sizes = _group_sizes(groups, gm, even=True)
        offset = jnp.zeros((), jnp.int32)
        cands = {
            name: jax.jit(functools.partial(fn, m=gm, tm=tm, num_local=groups))
            for name, fn in (("search table", sched.gmm_schedule), ("dense table", sched.gmm_schedule_dense))
        }
        return (sizes, offset), cands, 1.0

    return {
        f"cand matmul {m}^3": matmul_cands,
        f"cand gmm G{groups} {gm}x{gk}x{gn} even": gmm_cands,
        f"cand gmm visit table G{groups} {gm} rows": table_cands,
    }


def workloads(side, smoke):
    if smoke:
        return {
            "matmul 256^3": lambda: matmul_workload(side, 256, 256, 256),
            "matmul skinny 64x512x512": lambda: skinny_workload(side, 64, 512, 512, [(64, 512, 256)]),
            "gmm G4 512x256x256 uneven": lambda: gmm_workload(side, 4, 512, 256, 256, even=False),
            "tgmm G4 512x256x256 uneven": lambda: tgmm_workload(side, 4, 512, 256, 256, even=False),
            "gmm fwd+bwd G4 512x256x256 uneven": lambda: gmm_grad_workload(
                side, 4, 512, 256, 256, even=False
            ),
        }
    return {
        "matmul 8192^3": lambda: matmul_workload(side, 8192, 8192, 8192),
        "matmul 4096^3": lambda: matmul_workload(side, 4096, 4096, 4096),
        # Skinny shapes; "ours" takes whole rows of y as its panels (choose_blocks' skinny rule:
        # (256, 8192, 256) here, bm/bn/bk); the extra blocks are the next of pltpu.estimate's
        # ranking for the v5e and the square rule's choice before the skinny rule.
        "matmul skinny 256x8192x8192": lambda: skinny_workload(
            side, 256, 8192, 8192, [(256, 4096, 512), (256, 1024, 2048)]
        ),
        "matmul skinny 64x4096x4096": lambda: skinny_workload(side, 64, 4096, 4096, [(64, 4096, 512)]),
        "matmul skinny 128x8192x28672": lambda: skinny_workload(
            side, 128, 8192, 28672, [(128, 4096, 512), (128, 1024, 2048)]
        ),
        "gmm G8 8192x2048x2048 even": lambda: gmm_workload(side, 8, 8192, 2048, 2048, even=True),
        "gmm G8 8192x2048x2048 uneven": lambda: gmm_workload(side, 8, 8192, 2048, 2048, even=False),
        "gmm G8 8192x2048x2048 even f32 out": lambda: gmm_workload(
            side, 8, 8192, 2048, 2048, even=True, out_dtype=jnp.float32
        ),
        "gmm G32 16384x4096x4096 uneven": lambda: gmm_workload(side, 32, 16384, 4096, 4096, even=False),
        "tgmm G8 8192x2048x2048 even": lambda: tgmm_workload(side, 8, 8192, 2048, 2048, even=True),
        "gmm fwd+bwd G8 8192x2048x2048 uneven": lambda: gmm_grad_workload(
            side, 8, 8192, 2048, 2048, even=False
        ),
    }


def _rel_err(out, ref):
    """max |out - ref| / max |ref| over the outputs (pytrees of the same structure)."""
    errs = [
        float(jnp.max(jnp.abs(jnp.asarray(o, jnp.float32) - jnp.asarray(r, jnp.float32))))
        / (float(jnp.max(jnp.abs(jnp.asarray(r, jnp.float32)))) + 1e-30)
        for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref))
    ]
    return max(errs)


def _sync(x):
    return jax.block_until_ready(x)


def time_all(cands, args, rounds, smoke):
    """{name: seconds} for the candidates that ran, {name: error} for those that did not."""
    runnable, failed = {}, {}
    for name, fn in cands.items():
        try:
            _sync(fn(*args))
            runnable[name] = (functools.partial(fn, *args), _sync)
        except Exception as e:  # a candidate that does not compile here does not hide the others
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if smoke:
        return {name: 1.0 for name in runnable}, failed
    return _timing.measure(runnable, rounds=rounds, min_round_s=0.05), failed


def report(name, cands, args, flops, rounds, smoke, rows):
    times, failed = time_all(cands, args, rounds, smoke)
    ref = cands["XLA"](*args) if "XLA" in times else None
    jax_names = [c for c in times if c.startswith("JAX")]
    best_jax = min((times[c] for c in jax_names), default=None)
    for impl in cands:
        if impl in failed:
            print(f"  {name:36s} {impl:22s} FAILED {failed[impl]}")
            rows.append(dict(workload=name, impl=impl, error=failed[impl]))
            continue
        t = times[impl]
        tflops = flops / t / 1e12
        err = _rel_err(cands[impl](*args), ref) if ref is not None and impl != "XLA" else 0.0
        row = dict(
            workload=name, impl=impl, ms=round(t * 1e3, 4), tflops=round(tflops, 2),
            peak=round(tflops / PEAK_V5E, 3), flops=flops,
            vs_xla=round(times["XLA"] / t, 3) if "XLA" in times else "",
            vs_jax_best=round(best_jax / t, 3) if best_jax else "",
            err=f"{err:.2g}",
        )  # fmt: skip
        rows.append(row)
        print(
            f"| {name} | {impl} | {row['ms']:.3f} | {tflops:.1f} | {row['peak']:.0%} | {row['vs_xla']} "
            f"| {row['vs_jax_best']} | {row['err']} |",
            flush=True,
        )


def sweep(side, smoke, rounds, only):
    """Ours over block choices; the fastest per shape (``only``: substrings of the shapes'
    names, "matmul 8192", "gmm G32", "tgmm", ...)."""

    def wanted(label):
        return not only or any(s in label for s in only)

    print("\n## sweep: ours over blocks\n")
    print("| shape | blocks | ms | TFLOP/s | peak |")
    print("|---|---|---|---|---|")
    shapes = [(256, 256, 256)] if smoke else [(8192, 8192, 8192), (4096, 4096, 4096)]
    best = {}
    for m, k, n in shapes:
        if not wanted(f"matmul {m}x{k}x{n}"):
            continue
        x, y = _rand(0, (m, k)), _rand(1, (k, n))
        blocks = [(128, 128, 128)] if smoke else MATMUL_SWEEP
        cands = {
            f"{bm}/{bn}/{bk}": functools.partial(
                ours_matmul.matmul, block_shape=(bm, bn), block_k=bk, **side.ours()
            )
            for bm, bn, bk in blocks
        }
        times, failed = time_all(cands, (x, y), rounds, smoke)
        _sweep_rows(f"matmul {m}x{k}x{n}", times, failed, 2.0 * m * k * n, best)
    gmm_shapes = [(4, 512, 256, 256)] if smoke else [(8, 8192, 2048, 2048), (32, 16384, 4096, 4096)]
    for groups, m, k, n in gmm_shapes:
        if not wanted(f"gmm G{groups} {m}x{k}x{n} uneven"):
            continue
        lhs, rhs, sizes = (
            _rand(0, (m, k)),
            _rand(1, (groups, k, n)),
            _group_sizes(groups, m, even=False),
        )
        tilings = [(128, 128, 128)] if smoke else GMM_SWEEP[k]
        cands = {
            "/".join(map(str, t)): functools.partial(
                ours_gmm.gmm, preferred_element_type=jnp.bfloat16, tiling=t, **side.ours()
            )
            for t in tilings
        }
        cands["chosen " + "/".join(map(str, _chosen_tiling(groups, m, k, n)))] = functools.partial(
            ours_gmm.gmm, preferred_element_type=jnp.bfloat16, **side.ours()
        )
        times, failed = time_all(cands, (lhs, rhs, sizes), rounds, smoke)
        _sweep_rows(f"gmm G{groups} {m}x{k}x{n} uneven", times, failed, 2.0 * m * k * n, best)
    tgmm_shapes = [(4, 512, 256, 256)] if smoke else [(8, 8192, 2048, 2048)]
    for groups, m, k, n in tgmm_shapes:
        if not wanted(f"tgmm G{groups} {m}x{k}x{n}"):
            continue
        lhs_t, grad, sizes = _rand(0, (k, m)), _rand(1, (m, n)), _group_sizes(groups, m, even=True)
        tilings = [(128, 128, 128)] if smoke else TGMM_SWEEP
        cands = {
            "/".join(map(str, t)): functools.partial(
                ours_gmm.tgmm, preferred_element_type=jnp.bfloat16, tiling=t, **side.ours()
            )
            for t in tilings
        }
        times, failed = time_all(cands, (lhs_t, grad, sizes), rounds, smoke)
        _sweep_rows(f"tgmm G{groups} {m}x{k}x{n}", times, failed, 2.0 * m * k * n, best)
    print("\nfastest:")
    for shape, (blocks, tflops) in best.items():
        print(f"  {shape}: {blocks} ({tflops:.1f} TFLOP/s)")


def _chosen_tiling(groups, m, k, n):
    return ours_gmm.choose_tiling(m, k, n, groups, jnp.bfloat16, jnp.bfloat16)


def _sweep_rows(shape, times, failed, flops, best):
    for blocks, t in sorted(times.items(), key=lambda kv: kv[1]):
        tflops = flops / t / 1e12
        print(f"| {shape} | {blocks} | {t * 1e3:.3f} | {tflops:.1f} | {tflops / PEAK_V5E:.0%} |", flush=True)
        if shape not in best or tflops > best[shape][1]:
            best[shape] = (blocks, tflops)
    for blocks, err in failed.items():
        print(f"| {shape} | {blocks} | FAILED {err} | | |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the workload names to run")
    ap.add_argument("--sweep", action="store_true", help="also time ours over block choices")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (--only filters its shapes)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (off a TPU)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--candidates", action="store_true",
        help="only the candidate kernel variants (matmul 4096^3, gmm G8 even; --rounds 5 is enough)",
    )  # fmt: skip
    a = ap.parse_args()
    if jax.default_backend() != "tpu" and not a.smoke:
        print("no TPU here: run on a TPU, or pass --smoke to check the script in interpret mode")
        return 2
    side = Side(a.smoke)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    if not a.sweep_only:
        print("\n| workload | impl | ms | TFLOP/s | peak | vs XLA | vs JAX best | err vs XLA |")
        print("|---|---|---|---|---|---|---|---|")
    rows = []
    failed = 0
    chosen = candidate_workloads(side, a.smoke) if a.candidates else workloads(side, a.smoke)
    for name, make in chosen.items():
        if a.sweep_only or (a.only and not any(s in name for s in a.only)):
            continue
        try:
            args, cands, flops = make()
            report(name, cands, args, flops, a.rounds, a.smoke, rows)
        except Exception as e:  # one failing workload does not hide the others
            if a.smoke:
                raise
            failed += 1
            print(f"| {name} | FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]} |", flush=True)
    if not a.smoke and not a.sweep_only:
        fields = [
            "workload",
            "impl",
            "ms",
            "tflops",
            "peak",
            "flops",
            "vs_xla",
            "vs_jax_best",
            "err",
            "error",
        ]
        panels = [_timing.Panel("ours, JAX's and XLA's", x="flops", y="tflops", ylabel="TFLOP/s")]
        _timing.write_results(
            "tpu_ops_matmul_candidates" if a.candidates else "tpu_ops_matmul",
            [dict({f: "" for f in fields}, **r) for r in rows],
            fields,
            panels,
        )
    if a.sweep or a.sweep_only:
        sweep(side, a.smoke, min(a.rounds, 5), a.only if a.sweep_only else None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
