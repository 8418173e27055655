"""TPU interpret-mode speed: our `pallas_tpu` against JAX's `jax.experimental.pallas.tpu`, on the CPU.

Three TPU-style kernels, each written once as `build_<kernel>(pl, pltpu)` and built twice: with
our modules (`import pallas as pl`, `import pallas_tpu as pltpu`) and with JAX's
(`jax.experimental.pallas` and its `tpu` module, imported here only as the reference to beat).
Both sides run with `interpret=pltpu.InterpretParams()` (TPU interpret mode: VMEM, DMAs and
semaphores simulated on the CPU), are jitted, and are checked against a plain `jnp` reference.
The first call (trace + compile + run) is timed on its own; the steady-state figure is the
median of a few later calls.

JAX's `emit_pipeline` asks for the TPU generation (to round DMA slices to the memory tiling),
which fails on a CPU ("Unsupported TPU device kind: cpu"). JAX's own way out is to name the
TPU being simulated with `jax.sharding.use_abstract_mesh`; JAX's side of every kernel that
needs it runs inside such a context (a TPU v5e, which has 8 x 128 f32 tiles).

Target (pallas-tpu issue): ours at least 10x faster than JAX's in steady state.

Run: python benchmarks/tpu_interpret_speed.py [--quick] [--only NAME] [--repeats N]
     [--jax-repeats N] [--plain-interpret] [--strict]
"""

import argparse
import contextlib
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable

import _examples
import jax
import jax.numpy as jnp
import numpy as np

# --- kernels: each `build_*` takes the `pl` and `pltpu` modules and returns a function of arrays


def build_matmul(pl, pltpu, *, bm, bn, bk, interpret=None):
    """examples/tpu_matmul.py's kernel (grid (m, n, k), f32 accumulator in VMEM scratch, k
    "arbitrary"), with this ``pl`` and ``pltpu``."""
    ex = _examples.load("tpu_matmul", _examples.which(pl))
    interpret = pltpu.InterpretParams() if interpret is None else interpret
    return functools.partial(ex.matmul, bm=bm, bn=bn, bk=bk, call_kwargs={"interpret": interpret})


def build_double_buffer(pl, pltpu, *, chunk, scale=2.0, interpret=None):
    """Manual double-buffered DMA: walk `x` (in HBM) in row chunks through a 2-slot VMEM buffer.

    The output is `scale * sum_c x[c * chunk:(c + 1) * chunk]`. While chunk `c` is summed from
    slot `c % 2`, the DMA of chunk `c + 1` into the other slot is already in flight.
    """

    def kernel(x_hbm, o_ref, buf, sem):
        num_chunks = x_hbm.shape[0] // chunk

        def chunk_copy(c, slot):
            return pltpu.make_async_copy(x_hbm.at[pl.ds(c * chunk, chunk)], buf.at[slot], sem.at[slot])

        chunk_copy(0, 0).start()
        o_ref[...] = jnp.zeros_like(o_ref)

        def body(c, carry):
            slot = jax.lax.rem(c, 2)

            @pl.when(c + 1 < num_chunks)
            def _prefetch_next():
                chunk_copy(c + 1, 1 - slot).start()

            chunk_copy(c, slot).wait()
            o_ref[...] += buf[slot] * scale
            return carry

        jax.lax.fori_loop(0, num_chunks, body, 0)

    def double_buffer(x):
        cols = x.shape[1]
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((chunk, cols), x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[
                pltpu.VMEM((2, chunk, cols), x.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
            interpret=pltpu.InterpretParams() if interpret is None else interpret,
        )(x)

    return double_buffer


def build_pipeline_add(pl, pltpu, *, block, interpret=None):
    """`emit_pipeline` over HBM refs: the kernel sees whole arrays in HBM (`pl.ANY`) and runs an
    inner pipeline that streams (block)-sized tiles of x and y through VMEM and adds them."""

    def kernel(x_hbm, y_hbm, o_hbm):
        def add_block(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...] + y_ref[...]

        rows, cols = x_hbm.shape
        spec = pl.BlockSpec(block, lambda i, j: (i, j))
        pltpu.emit_pipeline(
            add_block,
            grid=(rows // block[0], cols // block[1]),
            in_specs=[spec, spec],
            out_specs=spec,
        )(x_hbm, y_hbm, o_hbm)

    def pipeline_add(x, y):
        hbm = pl.BlockSpec(memory_space=pl.ANY)
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[hbm, hbm],
            out_specs=hbm,
            interpret=pltpu.InterpretParams() if interpret is None else interpret,
        )(x, y)

    return pipeline_add


# --- the benchmark table --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    problem: str  # what is measured, for the table
    build: Callable  # build(pl, pltpu, interpret=...) -> function of the inputs
    make_inputs: Callable[[jax.Array], tuple]
    reference: Callable
    tol: float  # max abs error allowed against the jnp reference
    # JAX's side needs a TPU kind to trace on a CPU (see the module docstring).
    needs_tpu_kind: bool = False


def _normals(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return tuple(jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes))


def make_cases(quick: bool) -> list[Case]:
    n = 256 if quick else 512
    rows, chunk = (1024, 256) if quick else (4096, 256)
    shape, block = ((512, 256), (128, 128)) if quick else ((2048, 1024), (256, 256))
    return [
        Case(
            "matmul",
            f"{n}^3 f32, 128^3 blocks, grid {n // 128}^3, VMEM acc, k arbitrary",
            functools.partial(build_matmul, bm=128, bn=128, bk=128),
            lambda key: _normals(key, (n, n), (n, n)),
            functools.partial(jnp.dot, precision="highest"),
            tol=1e-5 * n,
        ),
        Case(
            "double_buffer_dma",
            f"({rows}, 128) f32 in HBM, {rows // chunk} chunks of {chunk} rows, 2-slot VMEM",
            functools.partial(build_double_buffer, chunk=chunk),
            lambda key: _normals(key, (rows, 128)),
            lambda x: 2.0 * x.reshape(-1, chunk, x.shape[1]).sum(axis=0),
            tol=1e-5 * rows / chunk,
        ),
        Case(
            "emit_pipeline_add",
            f"{shape[0]}x{shape[1]} f32 in HBM, {block[0]}x{block[1]} blocks, "
            f"inner grid {shape[0] // block[0]}x{shape[1] // block[1]}",
            functools.partial(build_pipeline_add, block=block),
            lambda key: _normals(key, shape, shape),
            jnp.add,
            tol=0.0,
            needs_tpu_kind=True,
        ),
    ]


@dataclasses.dataclass(frozen=True)
class Side:
    """One implementation: the two modules every kernel is built with."""

    name: str
    pl: object
    pltpu: object
    # JAX's TPU interpret mode can need the simulated TPU kind when tracing on a CPU.
    tpu_kind_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def simulated_tpu_context() -> contextlib.AbstractContextManager:
    """A context that tells JAX's Pallas TPU code which TPU it targets, when there is none."""
    if jax.default_backend() == "tpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="TPU v5e", num_cores=1, platform="tpu")
    # An empty mesh: only the device kind matters; a mesh axis would make shardings explicit.
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def jax_side() -> Side:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    return Side("JAX", pl, pltpu, simulated_tpu_context)


def our_side() -> Side:
    """Our modules, or raises with the reason they cannot be used."""
    import pallas as pl
    import pallas_tpu as pltpu

    # Until it is implemented, pallas_tpu imports but every public name raises.
    for name in ("InterpretParams", "CompilerParams", "VMEM", "SemaphoreType"):
        getattr(pltpu, name)
    for name in ("make_async_copy", "emit_pipeline"):
        getattr(pltpu, name)
    return Side("ours", pl, pltpu)


@dataclasses.dataclass
class Timing:
    first_ms: float = float("nan")
    steady_ms: float = float("nan")
    err: float = float("nan")
    error: str | None = None  # why it did not run

    @property
    def ran(self) -> bool:
        return self.error is None


def run_side(side: Side, case: Case, inputs, expected, repeats: int, interpret=None) -> Timing:
    """Builds the case with `side`'s modules, times the first call and `repeats` later ones."""
    context = side.tpu_kind_context if case.needs_tpu_kind else contextlib.nullcontext
    try:
        fn = jax.jit(case.build(side.pl, side.pltpu, interpret=interpret))
        # jit caches per context, so every call, not only the first, runs inside it.
        with context():
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*inputs))
            first_ms = (time.perf_counter() - start) * 1e3
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(fn(*inputs))
                times.append((time.perf_counter() - start) * 1e3)
    except Exception as e:  # noqa: BLE001 - reported in the table, the other side still runs
        if hasattr(side.pltpu, "reset_tpu_interpret_mode_state"):
            # JAX's interpreter keeps per-process state that a failed kernel leaves behind.
            side.pltpu.reset_tpu_interpret_mode_state()
        return Timing(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    err = float(np.max(np.abs(np.asarray(out, np.float64) - np.asarray(expected, np.float64))))
    return Timing(first_ms, statistics.median(times), err)


def _ms(t: Timing, field: str) -> str:
    return f"{getattr(t, field):.1f}" if t.ran else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI smoke runs")
    parser.add_argument("--repeats", type=int, default=5, help="timed warm runs of ours")
    parser.add_argument("--jax-repeats", type=int, default=3, help="timed warm runs of JAX's")
    parser.add_argument(
        "--only", action="append", choices=[c.name for c in make_cases(True)], help="repeatable"
    )
    parser.add_argument(
        "--plain-interpret",
        action="store_true",
        help="also time JAX's Pallas with plain interpret=True (no TPU simulation)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when ours is missing or misses the target"
    )
    args = parser.parse_args()
    target = 10.0

    sides = [jax_side()]
    try:
        sides.insert(0, our_side())
    except Exception as e:  # noqa: BLE001 - any failure means "ours is not usable yet"
        ours_missing = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        print(f"ours: not available ({ours_missing})")
    else:
        ours_missing = None
    print(f"jax {jax.__version__}, device {jax.devices()[0]}, {'quick' if args.quick else 'full'} sizes")

    header = ["kernel", "problem", "ours 1st ms", "ours ms", "JAX 1st ms", "JAX ms", "JAX/ours"]
    if args.plain_interpret:
        header.append("JAX interpret=True ms")
    header += ["err ours", "err JAX", "ok"]
    rows, wrong, missed = [], [], []
    for i, case in enumerate(make_cases(args.quick)):
        if args.only and case.name not in args.only:
            continue
        inputs = case.make_inputs(jax.random.key(i))
        expected = case.reference(*inputs)
        results = {}
        for side in sides:
            repeats = args.repeats if side.name == "ours" else args.jax_repeats
            results[side.name] = run_side(side, case, inputs, expected, repeats)
        if args.plain_interpret:
            results["plain"] = run_side(sides[-1], case, inputs, expected, args.jax_repeats, True)
        ours = results.get("ours", Timing(error=f"not available ({ours_missing})"))
        upstream = results["JAX"]

        problems = []
        for name, t in results.items():
            label = {"ours": "ours", "JAX": "JAX", "plain": "JAX interpret=True"}[name]
            if not t.ran:
                print(f"  {case.name}: {label} did not run ({t.error})")
                problems.append(f"{label} failed")
            elif not t.err <= case.tol:
                problems.append(f"{label} WRONG")
        if not ours.ran and ours_missing:
            problems = [p for p in problems if not p.startswith("ours")]
        if problems:
            wrong.append(case.name)
        ratio = upstream.steady_ms / ours.steady_ms if ours.ran and upstream.ran else None
        if ratio is not None and ratio < target:
            missed.append(case.name)
        row = [
            case.name,
            case.problem,
            _ms(ours, "first_ms"),
            _ms(ours, "steady_ms"),
            _ms(upstream, "first_ms"),
            _ms(upstream, "steady_ms"),
            f"{ratio:.1f}x" if ratio is not None else "-",
        ]
        if args.plain_interpret:
            row.append(_ms(results["plain"], "steady_ms"))
        row += [
            f"{ours.err:.2g}" if ours.ran else "-",
            f"{upstream.err:.2g}" if upstream.ran else "-",
            ", ".join(problems) or "ok",
        ]
        rows.append(row)
        summary = "  ".join(f"{h}={v}" for h, v in zip(header[2:], row[2:]) if v != "-")
        print(f"  {case.name}: {summary}", flush=True)

    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    print()
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(
        f"\n1st = first call (trace + compile + run); ms = median of {args.repeats} (ours) / "
        f"{args.jax_repeats} (JAX) warm calls; JAX/ours = JAX ms / ours ms (target >= "
        f"{target:g}x); err = max abs error against the jnp reference."
    )
    if ours_missing:
        print(f"ours: not available ({ours_missing})")
    if wrong:
        print(f"FAILED: {', '.join(wrong)}")
    if missed:
        print(f"speed target missed: {', '.join(missed)}")
    return 1 if wrong or (args.strict and (missed or ours_missing)) else 0


if __name__ == "__main__":
    sys.exit(main())
