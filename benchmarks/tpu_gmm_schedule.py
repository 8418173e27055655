"""Offline time estimates of the matmul and gmm kernels on a TPU v5e, from libtpu's schedule.

The first model, kept for its validation numbers: ``pltpu.estimate`` (benchmarks/tpu_estimate.py)
runs every kernel's bundles through a cycle model instead of the branch weights below, and
shares this script's bundle parser (``pallas_tpu._src.mosaic.bundles``).

No TPU is needed: the kernel is compiled for a compile-only v5e by libtpu (as
``pltpu.compile_check`` does) with ``--xla_jf_dump_to``, and the kernel's final bundles
(the VLIW instruction words libtpu scheduled) are read:

* the grid loop (the outermost loop of the kernel) and, inside it, the forward branches
  (``sbr.rel``: a ``pl.when``, the pipeline's guards) with what each skips;
* the path one typical grid step runs: the branches weighted by how often a step takes
  them (``Kernel.span_weight``: the k loop's zeroing and write-out once per ``tiles_k``
  steps, a shared tile's chunk path never for even groups, ...);
* per step: bundles (B), MXU pushes (``vmatmul``) of the busiest MXU, their MXU cycles
  (M: a packed bf16 vreg of 16 rows through the 128x128 array, one row a cycle), the
  bundles before the first push (head H) and after the last (tail T).

A step is estimated at ``H + max(pushes' span in bundles, M) + T`` cycles (the MXU can
not start before its operands are loaded, nor the step end before its results are
stored; in between the slower of issue and MXU sets the pace), and at least the HBM
time of the blocks it moves; the call at ``steps x step`` plus the pipeline's unhidden
prologue (the first step's input blocks) and epilogue (the last output block) at
~819 GB/s, and ``STEP_OVERHEAD_US`` per grid step (the DMA waits and semaphores, a
constant fitted on the chip's numbers: ``--validate``). Clock: 1.5 GHz (197 TFLOP/s
= 4 MXUs x 128 x 128 x 2 x 1.5e9).

    python benchmarks/tpu_gmm_schedule.py --validate          # the estimate vs measured
    python benchmarks/tpu_gmm_schedule.py --candidates        # the ranked candidates
    python benchmarks/tpu_gmm_schedule.py matmul 4096 4096 4096 --blocks 1024,1024,2048
    python benchmarks/tpu_gmm_schedule.py gmm 8192 2048 2048 --groups 8 --tiling 512,1024,2048
    python benchmarks/tpu_gmm_schedule.py --validate --keep DIR  # keep the bundle dumps

Run with the venv holding libtpu (/work/venv312 or /work/venv311).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_DUMP = tempfile.mkdtemp(prefix="gmm_schedule_")
# libtpu reads its flags once, when it starts: set them before jax loads it.
os.environ["LIBTPU_INIT_ARGS"] = (
    os.environ.get("LIBTPU_INIT_ARGS", "")
    + f" --xla_jf_dump_to={_DUMP} --xla_jf_dump_llo_pass_label_regex=final_bundles"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
sys.path[:0] = [str(ROOT / "packages" / "pallas-core" / "src"), str(ROOT / "packages" / "pallas-tpu" / "src")]

import importlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tpu._src.mosaic import bundles as bundles_lib  # noqa: E402
from pallas_tpu._src.mosaic import compile_check as cc  # noqa: E402

CLOCK_HZ = 1.5e9
HBM_BYTES_PER_S = 819e9
PEAK_TFLOPS = 197.0
CYCLES_PER_PUSH = {"bf16": 16, "f32": 8, "s8": 32}  # rows of one vreg of lhs, one row a cycle
# Per grid step beyond the bundles (the pipeline's DMA waits and semaphore traffic, the
# loop's branch): fitted on the chip's numbers (--validate); 0 leaves the raw schedule.
STEP_OVERHEAD_US = 0.0
CODE_LIMIT = 48_000  # bundles: above ~56k libtpu splits a v5e kernel into overlays


# ------------------------------------------------------------------ the dump


@dataclasses.dataclass
class Bundle:
    addr: int
    depth: int  # loop nesting ('>' marks)
    ops: list[str]
    text: str


def parse_bundles(text: str) -> tuple[list[Bundle], dict[int, int]]:
    """The bundles of a ``final_bundles`` dump (op names) and ``{region: its first bundle's
    address}``, read by the package's parser (``pallas_tpu._src.mosaic.bundles``, which
    ``pltpu.estimate`` runs)."""
    parsed, regions = bundles_lib.parse(text)
    out = [Bundle(b.addr, b.depth, [op.name for op in b.ops], b.text) for b in parsed]
    return out, {num: parsed[i].addr for num, i in regions.items()}


@dataclasses.dataclass
class Span:
    """What a forward branch at ``at`` skips: bundles ``(at, to)``."""

    at: int
    to: int
    children: list[Span] = dataclasses.field(default_factory=list)
    pushes: int = 0  # vmatmul ops inside
    loops: bool = False  # holds a loop
    dma: bool = False
    stores_only: bool = False  # vector stores, no vector loads (a zero fill)
    weight: float = 1.0


def _is_push(op):
    return op.startswith("vmatmul")


def _spans(bundles: list[Bundle], regions: dict[int, int], lo: int, hi: int) -> list[Span]:
    """The forward branches inside bundles ``[lo, hi]`` as a tree (by nesting)."""
    flat = []
    for b in bundles:
        if not lo <= b.addr <= hi:
            continue
        m = re.search(r"sbr\.rel\s*\(([^)]*)\)\s*target = \$region(\d+)", b.text)
        if m and int(m.group(2)) in regions and regions[int(m.group(2))] > b.addr:
            flat.append(Span(b.addr, regions[int(m.group(2))]))
    flat.sort(key=lambda s: (s.at, -s.to))
    roots: list[Span] = []
    stack: list[Span] = []
    for s in flat:
        while stack and not (stack[-1].at <= s.at and s.to <= stack[-1].to):
            stack.pop()
        (stack[-1].children if stack else roots).append(s)
        stack.append(s)
    by_addr = {b.addr: b for b in bundles}

    def fill(s: Span):
        inside = [by_addr[a] for a in range(s.at + 1, s.to) if a in by_addr]
        ops = [o for b in inside for o in b.ops]
        s.pushes = sum(map(_is_push, ops))
        s.loops = any(b.depth > bundles_depth(s.at) for b in inside)
        s.dma = any(o.startswith("dma") for o in ops)
        s.stores_only = any(o == "vst" for o in ops) and not any(o == "vld" for o in ops)
        for c in s.children:
            fill(c)

    def bundles_depth(a):
        return by_addr[a].depth if a in by_addr else 0

    for r in roots:
        fill(r)
    return roots


@dataclasses.dataclass
class Step:
    bundles: float  # B: the weighted bundles of a typical step
    head: float  # H: before its first MXU push
    tail: float  # T: after its last
    span: float  # bundles from its first push to its last
    pushes: float  # of the busiest MXU
    mxu_cycles: float
    kernel_bundles: int
    cycles: float  # H + max(span, M) + T

    @property
    def ratio(self):
        """MXU cycles over bundles: above 1 the MXU, not issue, sets the pace."""
        return self.mxu_cycles / max(self.bundles, 1)


def analyse(text: str, weigh) -> Step:
    """A typical grid step of the kernel in ``text``; ``weigh(span, siblings)`` says how
    often a step takes a branch (its return value is the weight)."""
    bundles, regions = parse_bundles(text)
    looped = [b for b in bundles if b.depth >= 1]
    if not looped:
        raise ValueError("no grid loop in the kernel's bundles")
    lo, hi = looped[0].addr, max(b.addr for b in looped)
    roots = _spans(bundles, regions, lo, hi)
    total_pushes = sum(1 for b in bundles if lo <= b.addr <= hi for o in b.ops if _is_push(o))

    def assign(spans, outer):
        for s in spans:
            s.weight = outer * weigh(s, spans, total_pushes)
            assign(s.children, s.weight)

    assign(roots, 1.0)
    weight = {}

    def paint(spans):
        for s in spans:
            for a in range(s.at + 1, s.to):
                weight[a] = s.weight
            paint(s.children)

    paint(roots)
    acc = 0.0
    first = last = None
    per_mxu: dict[str, float] = {}
    cycles_per = 16
    for b in bundles:
        if not lo <= b.addr <= hi:
            continue
        w = weight.get(b.addr, 1.0)
        if w == 0:
            continue
        # A loop inside the step (a shared tile's chunks) runs an unknown number of times:
        # counted once, weighted as its branch.
        acc += w
        pushes = [o for o in b.ops if _is_push(o)]
        if pushes:
            if first is None:
                first = acc - w
            last = acc
            for o in pushes:
                unit = o.rsplit(".", 1)[-1]
                per_mxu[unit] = per_mxu.get(unit, 0.0) + w
                dtype = o.split(".")[1]
                cycles_per = CYCLES_PER_PUSH.get(dtype, 16)
    pushes = max(per_mxu.values(), default=0.0)
    mxu = pushes * cycles_per
    head = first or 0.0
    tail = acc - (last or acc)
    span = (last or 0.0) - head
    return Step(acc, head, tail, span, pushes, mxu, len(bundles), head + max(span, mxu) + tail)


# ------------------------------------------------------------------ the kernels


@dataclasses.dataclass
class Kernel:
    """One kernel to compile and estimate."""

    name: str
    fn: object
    args: tuple
    flops: float
    steps: int  # grid steps that compute
    idle_steps: int  # grid steps that compute nothing (gmm's padding visits)
    tiles_k: int
    prologue_bytes: int  # the first step's input blocks
    epilogue_bytes: int  # the last output block
    step_bytes: float  # HBM bytes a computing step moves, on average
    weigh: object = None
    measured_ms: float | None = None
    xla_ops: int = 0  # the program's XLA ops beside the kernel (read from the compile)
    error: str = ""
    switches: dict = dataclasses.field(default_factory=dict)  # {(module, attribute): value} while compiling

    def span_weight(self, s: Span, siblings, total_pushes) -> float:
        if self.weigh is not None:
            return self.weigh(self, s, siblings, total_pushes)
        return default_weight(self, s, siblings, total_pushes)


def default_weight(k: Kernel, s: Span, siblings, total_pushes) -> float:
    if s.pushes:
        main = max(siblings, key=lambda t: t.pushes)
        if s is main and s.pushes >= total_pushes / 2:
            return 1.0  # the pipeline's guard, or the whole tile's product
        if s is main and not s.loops:
            return 1.0
        return 0.0  # a shared tile's chunk path (even groups: never)
    if s.loops:
        return 0.0  # a shared tile's merge
    if s.dma:
        return 1.0
    return 1.0 / k.tiles_k if k.tiles_k > 1 else 0.0


def gmm_weight(k: Kernel, s: Span, siblings, total_pushes) -> float:
    """gmm's branches: the untouched tile's fill (the first store-only branch) never; the
    accumulator's zeroing and write-out once per k pass."""
    if not s.pushes and not s.loops and not s.dma and s.stores_only:
        plain = [t for t in siblings if not t.pushes and not t.loops and not t.dma and t.stores_only]
        if plain and s is plain[0]:
            return 0.0
    return default_weight(k, s, siblings, total_pushes)


@dataclasses.dataclass(frozen=True)
class Model:
    """The constants beside the schedule: fitted on the chip's numbers (``--validate``)."""

    hbm_bytes_per_s: float = HBM_BYTES_PER_S  # what a kernel's DMAs reach beside its compute
    step_us: float = STEP_OVERHEAD_US  # per grid step: DMA waits, semaphores, the loop's branch
    idle_step_us: float = 0.3  # a step that computes nothing (gmm's padding visits)
    xla_op_us: float = 0.0  # per XLA op of the program beside the kernel (gmm's visit table)


FITTED = Model(640e9, 0.0, 0.3, 0.7)  # --validate: max |error| 2.8% over 8 chip numbers


def estimate(k: Kernel, step: Step, model: Model = FITTED) -> dict:
    compute_us = step.cycles / CLOCK_HZ * 1e6
    hbm_us = k.step_bytes / model.hbm_bytes_per_s * 1e6
    step_us = max(compute_us, hbm_us) + model.step_us
    edges_us = (k.prologue_bytes + k.epilogue_bytes) / model.hbm_bytes_per_s * 1e6
    total_us = k.steps * step_us + k.idle_steps * model.idle_step_us + edges_us + k.xla_ops * model.xla_op_us
    return dict(
        step_us=step_us,
        compute_us=compute_us,
        hbm_us=hbm_us,
        edges_us=edges_us,
        total_ms=total_us / 1e3,
        tflops=k.flops / (total_us * 1e-6) / 1e12,
    )


def fit(done: list) -> Model:
    """The ``Model`` that minimises the largest relative error over ``(kernel, step)``
    pairs with a measured time (a grid search: three constants, a handful of points)."""
    best = None
    for bw in range(560, 821, 20):
        for step_us in [i * 0.02 for i in range(0, 31)]:
            for op_us in [i * 0.1 for i in range(0, 16)]:
                m = Model(bw * 1e9, step_us, 0.3, op_us)
                errs = [estimate(k, s, m)["total_ms"] / k.measured_ms - 1 for k, s in done]
                score = max(abs(e) for e in errs)
                if best is None or score < best[0]:
                    best = (score, m)
    return best[1]


def _dense_table():
    return importlib.import_module("pallas_tpu.ops.megablox._schedule").gmm_schedule_dense


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def matmul_kernel(m, k, n, bm, bn, bk, *, measured=None, first=None):
    """``first``: ``matmul.FIRST_STEP`` for this compile (None: as it is)."""
    from pallas_tpu.ops import matmul as mm

    def fn(x, y):
        return mm.matmul(x, y, block_shape=(bm, bn), block_k=bk)

    steps = (m // bm) * (n // bn) * (k // bk)
    step_bytes = (bm * bk + bk * bn) * 2 + (bm * bn * 2) / (k // bk)
    return Kernel(
        f"matmul {m}x{k}x{n} {bm}/{bn}/{bk}" + (f" first={first}" if first else ""), fn, (_sds((m, k)), _sds((k, n))), 2.0 * m * k * n, steps, 0,
        k // bk, (bm * bk + bk * bn) * 2, bm * bn * 2, step_bytes, measured_ms=measured,
        switches={("pallas_tpu.ops.matmul._kernel", "FIRST_STEP"): first} if first else {},
    )  # fmt: skip


def jax_matmul_kernel(m, k, n, bm, bn, bk, *, measured=None):
    from jax.experimental.pallas.ops.tpu import matmul as jm

    kern = matmul_kernel(m, k, n, bm, bn, bk, measured=measured)
    kern.name = "JAX " + kern.name
    kern.fn = lambda x, y: jm.matmul(x, y, block_shape=(bm, bn), block_k=bk)
    return kern


def gmm_kernel(
    groups, m, k, n, tiling, *, measured=None, jax_op=False, out=jnp.bfloat16, fn=None, table=None
):
    """``table``: "dense" for ``schedule.gmm_schedule_dense``; ``first``: see matmul_kernel."""
    tm, tk, tn = tiling
    mod = importlib.import_module(
        "jax.experimental.pallas.ops.tpu.megablox.gmm" if jax_op else "pallas_tpu.ops.megablox.gmm"
    )
    if fn is None:

        def fn(lhs, rhs, sizes):
            return mod.gmm(lhs, rhs, sizes, preferred_element_type=out, tiling=tiling)

    tiles_m, tiles_k, tiles_n = m // tm, -(-k // tk), -(-n // tn)
    steps = tiles_m * tiles_k * tiles_n
    # Ours pads its visits to tiles + groups - 1 (even groups: groups - 1 idle); JAX's too.
    idle = (groups - 1) * tiles_k * tiles_n
    osz = jnp.dtype(out).itemsize
    rows_per_group = m // groups
    # rhs: a (tk, tn) block per group (once per group when tk = k, every k step otherwise).
    rhs_loads = groups * tiles_n if tiles_k == 1 else steps
    step_bytes = (m * k * 2 * tiles_n + rhs_loads * tk * tn * 2 + m * n * osz) / steps
    del rows_per_group
    return Kernel(
        f"{'JAX ' if jax_op else ''}gmm G{groups} {m}x{k}x{n} {tm}/{tk}/{tn}" + (" dense table" if table else ""),
        fn, (_sds((m, k)), _sds((groups, k, n)), _sds((groups,), jnp.int32)), 2.0 * m * k * n, steps, idle,
        tiles_k, (tm * tk + tk * tn) * 2, tm * tn * osz, step_bytes, weigh=gmm_weight, measured_ms=measured,
        switches={("pallas_tpu.ops.megablox.gmm", "GMM_TABLE"): _dense_table()} if table == "dense" else {},
    )  # fmt: skip


# ------------------------------------------------------------------ compiling


def kernel_bundles(kern: Kernel, keep: str | None = None) -> str:
    """The final bundles of ``kern``'s Pallas kernel, compiled for a compile-only v5e."""
    before = set(glob.glob(os.path.join(_DUMP, "*")))
    jax.clear_caches()  # a module switch (matmul.FIRST_STEP) changes what the jitted op traces
    saved = {(mod, attr): getattr(importlib.import_module(mod), attr) for mod, attr in kern.switches}
    try:
        for (mod, attr), value in kern.switches.items():
            setattr(importlib.import_module(mod), attr, value)
        cc.compile_for(kern.fn, kern.args, "v5e")
    finally:
        for (mod, attr), value in saved.items():
            setattr(importlib.import_module(mod), attr, value)
    new = set(glob.glob(os.path.join(_DUMP, "*"))) - before
    best = None
    for f in new:
        if not f.endswith("-final_bundles.txt") or "schedule-analysis" in f or "-TLP-" in f:
            continue
        analysis = re.sub(r"-(\d+)-final_bundles\.txt$", "-00-schedule-analysis_final_bundles.txt", f)
        if os.path.exists(analysis) and "tpu_custom_call" not in open(analysis, errors="replace").read():
            continue
        if best is None or os.path.getsize(f) > os.path.getsize(best):
            best = f
    if best is None:
        raise RuntimeError(f"{kern.name}: no kernel bundles in libtpu's dump")
    text = open(best, errors="replace").read()
    # The program's other XLA ops (gmm's visit table: cumsums, searches, gathers...).
    kern.xla_ops = 0
    for f in new:
        name = os.path.basename(f)
        if f.endswith("-schedule-analysis_final_bundles.txt") and f != best and "-TLP-" not in name:
            if "<late-" not in name and "tpu_custom_call" not in open(f, errors="replace").read():
                kern.xla_ops += 1
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(best, os.path.join(keep, re.sub(r"\W+", "_", kern.name) + ".txt"))
    for f in new:
        os.remove(f)
    return text


def schedule(kern: Kernel, keep=None) -> Step:
    return analyse(kernel_bundles(kern, keep), lambda s, sib, tot: kern.span_weight(s, sib, tot))


HEADER = (
    "| kernel | steps | kernel bundles | step B | H | T | MXU pushes | M cycles | M/B | step us "
    "| XLA ops | est ms | est TFLOP/s | measured ms | err |"
)


def row(kern: Kernel, step: Step, est: dict) -> str:
    meas = kern.measured_ms
    err = f"{est['total_ms'] / meas - 1:+.1%}" if meas else ""
    flag = " (overlays?)" if step.kernel_bundles > CODE_LIMIT else ""
    return (
        f"| {kern.name} | {kern.steps}+{kern.idle_steps} | {step.kernel_bundles}{flag} | {step.bundles:.0f} "
        f"| {step.head:.0f} | {step.tail:.0f} | {step.pushes:.0f} | {step.mxu_cycles:.0f} | {step.ratio:.3f} "
        f"| {est['step_us']:.2f} | {kern.xla_ops} | {est['total_ms']:.4f} | {est['tflops']:.1f} | {meas or ''} | {err} |"
    )


# Measured on the v5e (JAX 0.10.2, 2026-12-06; benchmarks/results/tpu_ops_matmul.csv).
MATMUL_CANDIDATES = [  # (bm, bn, bk) at 4096^3 bf16 (more of them: 2048/1024/2048 and the like overlay)
    (1024, 1024, 1024), (1024, 1024, 2048), (1024, 1024, 512), (2048, 1024, 1024), (512, 1024, 4096),
    (1024, 512, 4096),
]  # fmt: skip
GMM_CANDIDATES = [  # (tm, tk, tn) at G8 8192x2048x2048 even, bf16 out (1024/2048/2048 overlays)
    (512, 2048, 2048), (512, 2048, 1024), (1024, 2048, 1024), (256, 2048, 2048), (512, 1024, 2048),
    (1024, 1024, 1024), (512, 1024, 1024),
]  # fmt: skip


def candidate_set():
    out = [
        matmul_kernel(4096, 4096, 4096, *b, first=f, measured=0.7498 if (b, f) == ((1024,) * 3, "zero") else None)
        for b in MATMUL_CANDIDATES for f in ("zero", "select")
    ]  # fmt: skip
    for t in GMM_CANDIDATES:
        for table in (None, "dense"):
            first = ["zero", "select"] if t[1] < 2048 else [None]
            for f in first:
                kern = gmm_kernel(8, 8192, 2048, 2048, t, table=table,
                                  measured=0.3925 if (t, table) == ((512, 2048, 2048), None) else None)  # fmt: skip
                if f:
                    kern.switches[("pallas_tpu.ops.matmul._kernel", "FIRST_STEP")] = f
                    kern.name += f" first={f}"
                out.append(kern)
    return out


def validation_set():
    return [
        matmul_kernel(4096, 4096, 4096, 1024, 1024, 1024, measured=0.7498, first="zero"),
        matmul_kernel(8192, 8192, 8192, 1024, 1024, 1024, measured=5.8545, first="zero"),
        matmul_kernel(4096, 4096, 4096, 512, 512, 1024, measured=0.8729, first="zero"),
        matmul_kernel(8192, 8192, 8192, 512, 512, 1024, measured=6.8139, first="zero"),
        gmm_kernel(8, 8192, 2048, 2048, (512, 2048, 2048), measured=0.3925),
        gmm_kernel(8, 8192, 2048, 2048, (512, 2048, 2048), measured=0.3976, out=jnp.float32),
        gmm_kernel(8, 8192, 2048, 2048, (512, 1024, 1024), jax_op=True, measured=0.4219),
        gmm_kernel(8, 8192, 2048, 2048, (512, 1024, 1024), jax_op=True, measured=0.481, out=jnp.float32),
    ]


def _table(done, model, title):
    print(f"\n{title}\n")
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for kern, step in done:
        if step is None:
            print(f"| {kern.name} | FAILED {kern.error} |")
        else:
            print(row(kern, step, estimate(kern, step, model)), flush=True)


def compile_all(kernels, keep=None):
    done = []
    for kern in kernels:
        try:
            done.append((kern, schedule(kern, keep)))
        except Exception as e:  # noqa: BLE001 (one kernel that fails to compile does not stop the rest)
            kern.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            done.append((kern, None))
        print(f"compiled {kern.name}", file=sys.stderr, flush=True)
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("op", nargs="?", choices=["matmul", "gmm", "jax-gmm", "jax-matmul"])
    ap.add_argument("shape", nargs="*", type=int, help="m k n")
    ap.add_argument("--blocks", help="matmul bm,bn,bk")
    ap.add_argument("--tiling", help="gmm tm,tk,tn")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--validate", action="store_true", help="the estimate against the chip's numbers")
    ap.add_argument("--candidates", action="store_true", help="the candidate kernel variants, ranked")
    ap.add_argument("--keep", help="copy the kernels' bundle dumps here")
    ap.add_argument("--only", nargs="*", help="substrings of the candidates' names to compile")
    a = ap.parse_args()
    model = FITTED
    if a.validate:
        done = compile_all(validation_set(), a.keep)
        ok = [(k, s) for k, s in done if s is not None]
        _table(
            done, Model(HBM_BYTES_PER_S, 0.0, 0.3, 0.0), "raw schedule (819 GB/s, no per-step or per-op cost)"
        )
        model = fit(ok)
        print(f"\nfitted: {model}")
        _table(done, model, "fitted")
        errs = [estimate(k, s, model)["total_ms"] / k.measured_ms - 1 for k, s in ok]
        print(f"\nerror: max |{max(map(abs, errs)):.1%}|, mean |{sum(map(abs, errs)) / len(errs):.1%}|")
    kernels = []
    if a.op:
        m, k, n = a.shape
        if a.op in ("matmul", "jax-matmul"):
            make = matmul_kernel if a.op == "matmul" else jax_matmul_kernel
            kernels.append(make(m, k, n, *map(int, a.blocks.split(","))))
        else:
            tiling = tuple(map(int, a.tiling.split(",")))
            kernels.append(gmm_kernel(a.groups, m, k, n, tiling, jax_op=a.op == "jax-gmm"))
    if a.candidates:
        kernels += [c for c in candidate_set() if not a.only or any(o in c.name for o in a.only)]
    if kernels:
        done = compile_all(kernels, a.keep)
        ranked = sorted(
            done, key=lambda ks: (ks[0].name.split()[0:3], estimate(*ks, model)["total_ms"] if ks[1] else 1e9)
        )
        _table(ranked, model, f"estimates ({model})")
    shutil.rmtree(_DUMP, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
