"""First call of a large TPU kernel in interpret mode: ours against JAX's, on the CPU.

A kernel built on `emit_pipeline` with pytree BlockSpecs and a
`custom_vjp` backward took 29-73 s on its first call in our TPU interpret mode (13 s
converting to MLIR, 40 s in one XLA compile) where JAX's interpret mode took 5-13 s.

The kernel here is of that kind: a gated MLP, `y = (silu(x @ Wg) * (x @ Wu)) @ Wd`, whose
forward and two backward kernels (dx; dWg, dWu, dWd) each run an `emit_pipeline` over HBM
Refs inside a `pallas_call`, with the gate and up weights passed as one pytree
(`{"gate": ..., "up": ...}`) of BlockSpecs and refs, accumulating in VMEM scratch. The
loss's value and gradient (`jax.value_and_grad`, jitted) are timed on the first call (trace,
lower, compile, run) and checked against plain `jnp`. Each side runs in a fresh process, so
neither profits from the other's caches. JAX's `emit_pipeline` asks the device for its TPU
generation; its side runs inside `jax.sharding.use_abstract_mesh` naming a TPU v5e.

`--kernel reads` times instead one kernel of 40 VMEM reads at indices computed from SMEM: one
straight run of 40 bounds checks, whose conditions carry the index arithmetic.

Run: python benchmarks/tpu_first_call.py [--side ours|jax] [--profile] [--kernel mlp|reads]

Measured on the 2-core development VM (shared: wall times swing between runs, CPU seconds
less), jax 0.11.2, 2026-12-04, three runs of each side alternating, machine quiet (load 2):

    before (a8b91e7):        ours 9.2-32 s wall, 13.6 s CPU, 37291 lines of StableHLO (loaded)
    before (fc1b79a^):       ours 4.7-5.5 s wall, 6.9-7.7 s CPU (XLA compile 3.8-4.2 s), 9548 lines;
                             XLA's program: 655 fusions, 240 distinct kernels
    afd1049:                 ours 2.6-3.1 s wall, 3.6-4.3 s CPU (XLA compile 1.8-2.2 s), 8194 lines;
                             464 fusions, 108 distinct kernels
    now: the same within noise (loaded VM, load 5-6, alternating with afd1049's: 4.1-4.2 vs
                             3.9-4.2 s CPU, JAX's 2.3-3.0); 8601 lines, 108 distinct kernels
    JAX:                          1.9-2.5 s wall, 2.2-2.9 s CPU (XLA compile 0.7-0.9 s), 4527 lines;
                             235 fusions, 50 distinct kernels
    -> ours/JAX 1.3x wall, 1.6x CPU (was 2.6x)

On 2026-12-04/05 (same VM, load about 2, five runs of each side alternating; "compile CPU" is the
process's CPU time in XLA's compile): on_wait DMA shadows and marks are flat cells and a DMA between
two contiguous runs (a slot `buf.at[slot]`, rows `x.at[pl.ds(i, n)]`) copies, shadows and lands a
1-d run, so buffers of one size and different shapes share kernels (1fbb128, c98f827); a wait's
count of landed elements is a float32 dot with ones, not a reduction XLA splits into a tree of
reduce-window kernels per size (cbb2851):

    before (ea680f5):        ours 2.1-3.1 s wall, 2.8-3.6 s CPU (compile CPU 2.2-2.8 s), 8601 lines, 108 kernels
    after (b4779fa):         ours 1.9-2.9 s wall, 2.5-2.9 s CPU (compile CPU 1.8-2.2 s), 7908 lines, 96 kernels
    JAX:                          1.5-2.0 s wall, 1.8-2.0 s CPU (compile CPU 0.8-0.9 s), 4527 lines, 50 kernels
    -> ours/JAX 1.2-1.5x wall, 1.3-1.5x CPU; reads kernel unchanged (2775 lines, ours 0.8-1.0 s CPU,
       JAX 1.1-1.2 s); tpu_interpret_speed steady state: emit_pipeline_add 8.4-9.0 -> 7.2-7.5 ms,
       double_buffer_dma 0.8-1.1 -> 0.9-1.1 ms, matmul unchanged (no DMAs)

Tried and left out: flattening a DMA whose source is a block narrower than its array (not one
run; c98f827, undone in b4779fa): 2 kernels fewer, but XLA then computes each element's row and
column by a division in the copy loop (emit_pipeline_add 7.3 -> 13.0 ms steady state). Folding the
checks with their bounds, byte counts and values as data (one optimization barrier per fold,
padded to a power of two of checks): XLA forwards the constants through the barrier and merges
equal ones, so the folds still differ (15 -> 12 fold kernels, 94 -> 93 in all, more lines). An
optimization barrier on every traced Ref index (so that the index arithmetic is one kernel, not
repeated in each consumer): 96 -> 99 kernels.

Tracing and lowering take as long as JAX's (0.7-1.2 s). XLA's CPU compiler spends most of its time
per distinct fusion kernel (an MLIR pipeline and an LLVM module each; identical fusions are
compiled once), not per op: what is left are the interpreted kernels' DMA bookkeeping (on_wait
shadows and marks of DMA destinations, per buffer shape) and checks, inline in the program, where
JAX's interpret mode makes host callbacks. Count them with
`XLA_FLAGS=--xla_dump_to=DIR` (the `obj-file` entries of the program are its distinct kernels).

Where XLA's compile goes (2026-12-04, perf and `TF_CPP_VMODULE=ir_compiler=1,cpu_compiler=1`):
of ours, about 40% is LLVM's code generation and 25% XLA's MLIR pipeline of each distinct fusion
kernel (25-35 ms a kernel, whatever its size, 108 kernels), 15-20% HLO passes (0.7-0.9 s; JAX's
0.3 s: ops), the rest thunk emission. The one kernel that grew faster than its ops was the fold
of many checks into the error record (a select chain over 9-word rows, every condition computed
per word): the 40 checks at the end of the dW kernel were 340 ms of LLVM. A fold of more than 8
checks now picks the record's words by the number of the first failed check (two small kernels).
That leaves this MLP's compile as it was (8 alternating runs, compile only: 2.77 vs 2.82 s CPU,
within noise; 8601 lines) but makes the reads kernel 2x cheaper (same VM, loaded, 3 runs a side,
alternating):

    reads, before (3ea3f89^): ours 1.8-2.3 s wall, 1.8-2.2 s CPU (XLA compile 1.6-2.1 s), 2655 lines
    reads, now:               ours 0.9-1.0 s wall, 0.9-1.0 s CPU (XLA compile 0.7-0.9 s), 2775 lines
    reads, JAX:                    1.1-1.5 s wall, 1.1-1.4 s CPU (XLA compile 0.7-1.0 s), 2091 lines

What is left of the MLP's gap is kernel count (96 against 50; XLA spends about 15 ms of CPU on
each distinct kernel): the check folds (12-15 kernels, one per distinct run of checks: their
bounds and the index arithmetic feeding them are fused in), scalar index arithmetic repeated in
each consumer (about 36 scalar kernels against JAX's 25), DMA data movement from blocks that are
not one run (a copy kernel per source shape) and writebacks into HBM arrays of each shape, kernel
reads and writes of a slot (per buffer shape; refs.py does not use flat runs); constants baked
into kernels (bounds, byte counts) split kernels that would otherwise be one, but making them data
moved XLA's fusion decisions (tried: semaphore byte counts and bounds behind optimization
barriers, flat landing counts, opaque shadow initial values, check operands as data).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

M, D, F = 256, 256, 512  # tokens, model width, hidden width
BM, BF = 128, 128  # blocks of tokens and of the hidden width


def build(pl, pltpu, interpret):
    hbm = pl.BlockSpec(memory_space=pl.ANY)

    def call(kernel, out_shape, scratch):
        # in_specs must mirror the inputs' pytree exactly (JAX's Pallas refuses a leaf spec for the
        # weights' dict too), so the specs are made from the arguments.
        def run(*args):
            return pl.pallas_call(
                kernel,
                out_shape=out_shape,
                in_specs=jax.tree.map(lambda _: hbm, list(args)),
                out_specs=jax.tree.map(lambda _: hbm, out_shape),
                scratch_shapes=scratch,
                interpret=interpret,
            )(*args)

        return run

    x_spec = pl.BlockSpec((BM, D), lambda m, f: (m, 0))
    w_spec = {
        "gate": pl.BlockSpec((D, BF), lambda m, f: (0, f)),
        "up": pl.BlockSpec((D, BF), lambda m, f: (0, f)),
    }
    wd_spec = pl.BlockSpec((BF, D), lambda m, f: (f, 0))
    grid = (M // BM, F // BF)

    def hidden(x, w):
        g = jnp.dot(x, w["gate"], preferred_element_type=jnp.float32)
        u = jnp.dot(x, w["up"], preferred_element_type=jnp.float32)
        s = jax.nn.sigmoid(g)
        return g, u, s, g * s * u

    def fwd_kernel(x_hbm, w_hbm, wd_hbm, o_hbm, acc):
        def body(x_ref, w_ref, wd_ref, o_ref):
            @pl.when(pl.program_id(1) == 0)
            def _():
                acc[...] = jnp.zeros_like(acc)

            w = {k: r[...] for k, r in w_ref.items()}
            *_, h = hidden(x_ref[...], w)
            acc[...] += jnp.dot(h, wd_ref[...], preferred_element_type=jnp.float32)

            @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
            def _():
                o_ref[...] = acc[...].astype(o_ref.dtype)

        pltpu.emit_pipeline(body, grid=grid, in_specs=[x_spec, w_spec, wd_spec], out_specs=x_spec)(
            x_hbm, w_hbm, wd_hbm, o_hbm
        )

    def dx_kernel(x_hbm, w_hbm, wd_hbm, dy_hbm, dx_hbm, acc):
        def body(x_ref, w_ref, wd_ref, dy_ref, dx_ref):
            @pl.when(pl.program_id(1) == 0)
            def _():
                acc[...] = jnp.zeros_like(acc)

            w = {k: r[...] for k, r in w_ref.items()}
            g, u, s, _ = hidden(x_ref[...], w)
            dh = jax.lax.dot_general(dy_ref[...], wd_ref[...], (((1,), (1,)), ((), ())))
            du = dh * g * s
            dg = dh * u * s * (1.0 + g * (1.0 - s))
            acc[...] += jax.lax.dot_general(dg, w["gate"], (((1,), (1,)), ((), ()))) + jax.lax.dot_general(
                du, w["up"], (((1,), (1,)), ((), ()))
            )

            @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
            def _():
                dx_ref[...] = acc[...].astype(dx_ref.dtype)

        pltpu.emit_pipeline(body, grid=grid, in_specs=[x_spec, w_spec, wd_spec, x_spec], out_specs=x_spec)(
            x_hbm, w_hbm, wd_hbm, dy_hbm, dx_hbm
        )

    # The weight gradients: the grid runs over (f, m), accumulating over the tokens.
    xt_spec = pl.BlockSpec((BM, D), lambda f, m: (m, 0))
    wt_spec = {
        "gate": pl.BlockSpec((D, BF), lambda f, m: (0, f)),
        "up": pl.BlockSpec((D, BF), lambda f, m: (0, f)),
    }
    wdt_spec = pl.BlockSpec((BF, D), lambda f, m: (f, 0))

    def dw_kernel(x_hbm, w_hbm, wd_hbm, dy_hbm, dw_hbm, dwd_hbm, acc_g, acc_u, acc_d):
        def body(x_ref, w_ref, wd_ref, dy_ref, dw_ref, dwd_ref):
            @pl.when(pl.program_id(1) == 0)
            def _():
                acc_g[...] = jnp.zeros_like(acc_g)
                acc_u[...] = jnp.zeros_like(acc_u)
                acc_d[...] = jnp.zeros_like(acc_d)

            x, dy = x_ref[...], dy_ref[...]
            w = {k: r[...] for k, r in w_ref.items()}
            g, u, s, h = hidden(x, w)
            dh = jax.lax.dot_general(dy, wd_ref[...], (((1,), (1,)), ((), ())))
            du = dh * g * s
            dg = dh * u * s * (1.0 + g * (1.0 - s))
            tn = (((0,), (0,)), ((), ()))
            acc_g[...] += jax.lax.dot_general(x, dg, tn)
            acc_u[...] += jax.lax.dot_general(x, du, tn)
            acc_d[...] += jax.lax.dot_general(h, dy, tn)

            @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
            def _():
                dw_ref["gate"][...] = acc_g[...]
                dw_ref["up"][...] = acc_u[...]
                dwd_ref[...] = acc_d[...]

        pltpu.emit_pipeline(
            body,
            grid=(F // BF, M // BM),
            in_specs=[xt_spec, wt_spec, wdt_spec, xt_spec],
            out_specs=[wt_spec, wdt_spec],
        )(x_hbm, w_hbm, wd_hbm, dy_hbm, dw_hbm, dwd_hbm)

    f32 = jnp.float32

    @jax.custom_vjp
    def mlp(x, w, wd):
        return call(fwd_kernel, jax.ShapeDtypeStruct((M, D), f32), [pltpu.VMEM((BM, D), f32)])(x, w, wd)

    def mlp_fwd(x, w, wd):
        return mlp(x, w, wd), (x, w, wd)

    def mlp_bwd(res, dy):
        x, w, wd = res
        dx = call(dx_kernel, jax.ShapeDtypeStruct((M, D), f32), [pltpu.VMEM((BM, D), f32)])(x, w, wd, dy)
        dw_shape = ({k: jax.ShapeDtypeStruct((D, F), f32) for k in w}, jax.ShapeDtypeStruct((F, D), f32))
        scratch = [pltpu.VMEM((D, BF), f32), pltpu.VMEM((D, BF), f32), pltpu.VMEM((BF, D), f32)]
        dw, dwd = call(dw_kernel, dw_shape, scratch)(x, w, wd, dy)
        return dx, dw, dwd

    mlp.defvjp(mlp_fwd, mlp_bwd)
    return mlp


READS = 40  # the reads kernel: VMEM reads at computed, bounds-checked indices


def build_reads(pl, pltpu, interpret):
    """A kernel of READS reads of a VMEM Ref at indices computed from SMEM: one straight run of
    READS bounds checks, each condition computed from the index arithmetic."""

    def kernel(s_ref, x_ref, o_ref):
        acc = jnp.zeros((8, 128), jnp.float32)
        for i in range(READS):
            acc = acc + x_ref[pl.ds((s_ref[i] * 3 + i) % 5 + s_ref[(i * 7) % READS] // 3, 8), :]
        o_ref[...] = acc

    return lambda s, x: pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        interpret=interpret,
    )(s, x)


def reads_reference(s, x):
    s = np.asarray(s)
    return sum(x[(s[i] * 3 + i) % 5 + s[(i * 7) % READS] // 3 :][:8] for i in range(READS))


def reference(x, w, wd):
    g, u = x @ w["gate"], x @ w["up"]
    return (jax.nn.silu(g) * u) @ wd


def loss_of(mlp):
    return lambda x, w, wd: jnp.sum(jnp.sin(mlp(x, w, wd)))


def inputs():
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (M, D), jnp.float32)
    w = {n: jax.random.normal(kk, (D, F), jnp.float32) / 16 for n, kk in zip(("gate", "up"), k[1:3])}
    wd = jax.random.normal(k[3], (F, D), jnp.float32) / 16
    return x, w, wd


def simulated_tpu():
    if jax.default_backend() == "tpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="TPU v5e", num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def run_side(side: str, profile: bool, kernel: str = "mlp") -> dict:
    if side == "ours":
        import pallas as pl
        import pallas_tpu as pltpu

        ctx = contextlib.nullcontext()
    else:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import tpu as pltpu

        ctx = simulated_tpu()
    if kernel == "reads":
        fn = jax.jit(build_reads(pl, pltpu, pltpu.InterpretParams()))
        args = (
            jax.random.randint(jax.random.key(1), (READS,), 0, 9),
            jax.random.normal(jax.random.key(2), (16, 128)),
        )
    else:
        fn = jax.jit(
            jax.value_and_grad(loss_of(build(pl, pltpu, pltpu.InterpretParams())), argnums=(0, 1, 2))
        )
        args = inputs()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t, c = time.perf_counter(), time.process_time()
    with ctx:
        lowered = fn.lower(*args)
        t_lower = time.perf_counter() - t
        compiled = lowered.compile()
        t_compile = time.perf_counter() - t - t_lower
        out = jax.block_until_ready(compiled(*args))
    first, cpu = time.perf_counter() - t, time.process_time() - c
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    if kernel == "reads":
        np.testing.assert_allclose(out, reads_reference(*args), rtol=1e-5, atol=1e-5)
    else:
        ref = jax.value_and_grad(loss_of(reference), argnums=(0, 1, 2))(*args)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    hlo_ops = lowered.as_text().count("\n")
    return {"first": first, "cpu": cpu, "lower": t_lower, "compile": t_compile, "hlo_lines": hlo_ops}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--side", choices=["ours", "jax"], help="run one side here (the default runs both, each fresh)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile of the first call, on stderr")
    ap.add_argument(
        "--kernel",
        choices=["mlp", "reads"],
        default="mlp",
        help=f"mlp: the gated MLP (default); reads: one kernel of {READS} reads at computed indices",
    )
    args = ap.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args.profile, args.kernel)))
        return
    rows = {}
    for side in ("ours", "jax"):
        cmd = [sys.executable, __file__, "--side", side, "--kernel", args.kernel]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode:
            sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
        rows[side] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.kernel == "reads":
        print(f"{READS} VMEM reads at computed indices, first call")
    else:
        print(f"gated MLP, value_and_grad, first call (M={M}, D={D}, F={F}; blocks {BM}x{BF})")
    for side, r in rows.items():
        print(
            f"  {side:5s} {r['first']:7.2f} s, {r['cpu']:6.2f} s of CPU (trace+lower {r['lower']:6.2f} s, "
            f"XLA compile {r['compile']:6.2f} s, {r['hlo_lines']} lines of StableHLO)"
        )
    ours, theirs = rows["ours"], rows["jax"]
    print(
        f"ours / JAX: {ours['first'] / theirs['first']:.2f}x wall, {ours['cpu'] / theirs['cpu']:.2f}x CPU "
        "(on a loaded machine the CPU ratio is the steadier one)"
    )


if __name__ == "__main__":
    main()
