"""``pltpu.estimate`` and ``python -m pallas_tpu.estimate``: a TPU kernel's time from libtpu's
final bundles, on compile-only devices (no TPU). The report's fields are checked against
counts computed here by hand: a matmul's MXU cycles from its blocks, a copy's HBM bytes and
its DMA bound, the grid's steps. Skipped where libtpu is not installed.

The estimates run in one fresh Python (``_run``): there ``estimate`` compiles in-process with
libtpu's dump on, where a process whose libtpu already started (the other TPU tests) would
compile each function again in a child."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pallas as pl
import pallas_tpu as pltpu
from pallas_tpu._src import estimate as est
from pallas_tpu._src.mosaic import bundles, compile_check

pytestmark = pytest.mark.skipif(
    not compile_check.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]"'
)

HERE = os.path.dirname(os.path.abspath(__file__))
# A matmul of (M, K) @ (K, N) in blocks of (BM, BK) @ (BK, BN), bf16 in, f32 accumulated.
M, K, N, BM, BK, BN = 512, 512, 512, 256, 256, 256
MXU_TOLERANCE = 0.02  # the estimate's MXU cycles per step against the count by hand


def matmul(x, y):
    def kernel(x_ref, y_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
        grid=(x.shape[0] // BM, y.shape[1] // BN, x.shape[1] // BK),
        in_specs=[
            pl.BlockSpec((BM, BK), lambda i, j, k: (i, k)),
            pl.BlockSpec((BK, BN), lambda i, j, k: (k, j)),
        ],
        out_specs=pl.BlockSpec((BM, BN), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((BM, BN), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(x, y)


COPY_SHAPE, COPY_BLOCK = (2048, 1024), (512, 512)


def copy(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    spec = pl.BlockSpec(COPY_BLOCK, lambda i, j: (i, j))
    grid = (x.shape[0] // COPY_BLOCK[0], x.shape[1] // COPY_BLOCK[1])
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid, in_specs=[spec], out_specs=spec
    )(x)


def mxu_cycles_by_hand(chip: str) -> float:
    """The busiest MXU's cycles in one step: the step's MACs (BM x BK x BN) over the MXUs,
    each taking a row of width^2 MACs in 1 / rows_per_cycle cycles."""
    c = est.CHIPS[chip]
    return BM * BK * BN / (c.mxu_width**2 * c.mxu_rows_per_cycle * c.mxus)


LOOP_BLOCK = (8, 128)


def prefetch_loop(n, x):
    """A kernel whose loop runs ``n[0]`` times (a scalar-prefetch operand): each iteration
    adds the input block into the output block."""

    def kernel(n_ref, x_ref, o_ref):
        o_ref[...] = jnp.zeros_like(o_ref)

        def body(i, carry):
            o_ref[...] += x_ref[...]
            return carry

        jax.lax.fori_loop(0, n_ref[0], body, 0)

    spec = pl.BlockSpec(LOOP_BLOCK, lambda i, n_ref: (0, 0))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[spec], out_specs=spec
        ),
    )(n, x)


_SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
from pallas_tpu._src import estimate as est
est.enable_dumps()
import jax, jax.numpy as jnp
import test_estimate as t
out = {{}}
mm_args = (jax.ShapeDtypeStruct((t.M, t.K), jnp.bfloat16), jax.ShapeDtypeStruct((t.K, t.N), jnp.bfloat16))
for chip in est.CHIPS:
    out["matmul " + chip] = est.estimate(t.matmul, *mm_args, chip=chip).to_dict()
report = est.estimate(t.copy, jax.ShapeDtypeStruct(t.COPY_SHAPE, jnp.float32), chip="v5e")
out["copy"] = report.to_dict()
out["copy str"] = str(report)
x = jax.ShapeDtypeStruct(t.LOOP_BLOCK, jnp.float32)
for n in (3, 6, 9):
    out["loop " + str(n)] = est.estimate(t.prefetch_loop, jnp.array([n], jnp.int32), x).to_dict()
out["loop ?"] = est.estimate(t.prefetch_loop, jax.ShapeDtypeStruct((1,), jnp.int32), x).to_dict()
try:
    report.plot({png!r})
    out["plot"] = "ok"
except est.EstimateError as e:
    out["plot"] = str(e)
print("JSON" + json.dumps(out))
"""


def _run(code: str, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args] if not code else [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=HERE)  # fmt: skip


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    png = str(tmp_path_factory.mktemp("estimate") / "copy.png")
    proc = _run(_SCRIPT.format(here=HERE, png=png))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JSON"))
    out = json.loads(line[4:])
    out["png"] = png
    return out


@pytest.mark.parametrize("chip", list(est.CHIPS))
def test_every_chip_compiles_and_estimates(reports, chip):
    k = reports["matmul " + chip]["kernels"][0]
    assert "pallas_call 'kernel'" in k["kernel"] and k["chip"] == chip
    grid = (M // BM, N // BN, K // BK)
    assert k["grid"] == list(grid) and k["steps"] == math.prod(grid)
    assert k["time_us"] > 0 and k["step_us"] > 0 and k["time_us"] >= k["step_us"]
    assert k["flops"] >= 2 * M * K * N  # the MXU's passes (padding counts whole)
    assert 0 < k["vmem_bytes"] <= k["vmem_capacity"] == est.CHIPS[chip].vmem_bytes
    assert k["overlays"] in (1, None) and k["bundles"] > 0
    assert reports["matmul " + chip]["total_us"] >= k["time_us"]


@pytest.mark.parametrize("chip", list(est.CHIPS))
def test_matmul_mxu_cycles_follow_from_its_blocks(reports, chip):
    k = reports["matmul " + chip]["kernels"][0]
    want = mxu_cycles_by_hand(chip)
    assert k["mxu_cycles_per_step"] == pytest.approx(want, rel=MXU_TOLERANCE), (
        chip,
        k["mxu_cycles_per_step"],
        want,
    )


def test_copy_is_dma_bound(reports):
    k = reports["copy"]["kernels"][0]
    assert k["bound"] == "DMA / HBM" and k["utilization"]["DMA / HBM"] > 0.9
    nbytes = math.prod(COPY_SHAPE) * 4
    assert k["hbm_bytes"] == 2 * nbytes  # each block read once and written once
    assert k["steps"] == (COPY_SHAPE[0] // COPY_BLOCK[0]) * (COPY_SHAPE[1] // COPY_BLOCK[1])
    assert k["mxu_cycles_per_step"] == 0
    # At least the time the chip's HBM bandwidth needs (fitted efficiency: a bit more).
    assert k["time_us"] * 1e-6 >= 2 * nbytes / est.CHIPS["v5e"].hbm_bytes_per_s
    assert k["prologue_us"] > 0  # the first block arrives before the first step
    text = reports["copy str"]
    for field in (
        "time per step",
        "bound by",
        "VMEM",
        "SMEM",
        "unhidden prologue",
        "unhidden epilogue",
        "DMA / HBM",
    ):
        assert field in text


def test_a_scalar_prefetch_loop_runs_its_known_count(reports):
    """Given as an array, the loop's count is read by the simulated scalar unit: every
    iteration takes the same cycles, so the kernel's time grows by three iterations' each
    time the count does (3 -> 6 -> 9), and no branch is on an unknown value. Given as a shape
    it is unknown: the loop's branch is counted as unknown."""
    runs = {n: reports[f"loop {n}"]["kernels"][0] for n in (3, 6, 9)}
    for k in runs.values():
        assert k["prefetch_known"] == 1 and k["unknown_branches"] == 0
    cycles = {n: k["time_us"] * 1e-6 * est.CHIPS["v5e"].clock_hz for n, k in runs.items()}
    per_3 = cycles[6] - cycles[3]  # three iterations' cycles
    assert per_3 >= 3 and cycles[9] - cycles[6] == pytest.approx(per_3, abs=1e-6)
    unknown = reports["loop ?"]["kernels"][0]
    assert unknown["prefetch_known"] == 0 and unknown["unknown_branches"] > 0


def test_plot_or_a_clear_error(reports):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib" in reports["plot"] and "pip install" in reports["plot"]
    else:
        assert reports["plot"] == "ok"
        with open(reports["png"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_command_line(tmp_path):
    out = tmp_path / "r.json"
    proc = _run("", "-m", "pallas_tpu.estimate", f"{__file__}:copy", "f32[1024,1024]", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bound by" in proc.stdout and "DMA / HBM" in proc.stdout
    data = json.loads(out.read_text())
    assert data["chip"] == "v5e" and data["kernels"][0]["steps"] == 2 * 2


def test_after_jax_started_its_backends():
    # A process that ran JAX first (``jax.devices()``, any array) has loaded libtpu, which read
    # its flags then, without the dump's: the estimate compiles in a child that has them, and
    # reports the kernel (it once reported no kernel and 0 us).
    code = (
        f"import sys; sys.path.insert(0, {HERE!r})\n"
        "import jax, jax.numpy as jnp\n"
        "jnp.zeros(3).block_until_ready()\n"
        "from pallas_tpu._src import estimate as est\n"
        "import test_estimate as t\n"
        "r = est.estimate(t.copy, jax.ShapeDtypeStruct(t.COPY_SHAPE, jnp.float32))\n"
        "print('KERNELS', len(r.kernels), r.kernels[0].steps, r.total_us > 0)\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "KERNELS 1 8 True" in proc.stdout  # (2048 / 512) x (1024 / 512) steps


def test_command_line_errors():
    proc = _run("", "-m", "pallas_tpu.estimate", f"{__file__}:copy", "f32[8,oops]")
    assert proc.returncode == 2 and "DTYPE[SHAPE]" in proc.stderr


def test_unknown_chip():
    with pytest.raises(pltpu.EstimateError, match="unknown TPU chip 'v9'.*v4, v5e, v5p, v6e"):
        pltpu.estimate(copy, jax.ShapeDtypeStruct((512, 512), jnp.float32), chip="v9")


def test_a_function_holding_no_kernel():
    with pytest.raises(pltpu.EstimateError, match="holds no TPU kernel"):
        pltpu.estimate(lambda x: jnp.sin(x) * 2, jax.ShapeDtypeStruct((8, 128), jnp.float32))


def test_a_kernel_that_is_not_a_tpu_kernel():
    plgpu = pytest.importorskip("pallas_gpu")

    def gpu_kernel(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1

        return pl.pallas_call(kernel, out_shape=x, compiler_params=plgpu.CompilerParams(num_warps=4))(x)

    with pytest.raises(pltpu.EstimateError, match="does not lower for TPU v5e.*TPU kernels"):
        pltpu.estimate(gpu_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32))


# --- the bundle simulator on a hand-written program ------------------------------------------------

_PROGRAM = """
     0   :  { %s1_s0 = smov 0  ;;  %2 = vsyncpa [#allocation1], 0 } /* Start region 1 */
   0x1 LB: > { %s3_s1 = sadd.s32 1, %s1_s0  ;;  %4 = dma.hbm_to_vmem [thread:$0]  %s9_s9, 64, %s9_s9, [#allocation1] } /* Start region 2 */
   0x2   : > { %5 = dma.done.wait [#allocation1], 64  ;;  %p6_p0 = scmp.ge.s32.totalorder %s3_s1, 3 /* loop exit test */ }
   0x3   : > { %7 = vsyncadd [#allocation1], 4294967232  ;;  %v1_v0 = vld [vmem:[%s9_s9] sm:$0xff] }
   0x4   : > { %8 = vmatmul.bf16.gmra.mxu0 %v1_v0  ;;  %s1_s0 = smov %s3_s1 }
   0x5   : > { %v2_v1 = vpop.f32.mrf.mxu0  ;;  %9 = sbr.rel (!%p6_p0) target = $region2 }
   0x6   : > { %v3_v2 = vpop.f32.mrf.mxu0 }
   0x7   :  {} /* End region 2 */
"""


def test_simulator_runs_a_hand_written_loop():
    blist, regions = bundles.parse(_PROGRAM)
    assert [b.addr for b in blist] == list(range(8)) and regions[2] == 1
    machine = bundles.Machine(
        hbm_bytes_per_cycle=32.0, granule_bytes=32, delay_slots=2, mxu_rows_per_cycle=1.0
    )
    r = bundles.simulate(blist, regions, machine)
    assert len(r.iterations) == 3 and r.unknown_branches == 0  # the loop's exit test, run exactly
    it = r.iterations[1]
    assert it.stall_dma == 64 - 1  # 64 granules of 32 B at 32 B a cycle, issued a bundle before the wait
    assert (
        it.stall_mxu == 16 - 1
    )  # a bf16 vreg: 16 rows through the MXU, its two f32 vregs popped the next bundles
    assert it.mxu_passes == 1 and it.hbm_bytes == 64 * 32
    assert it.cycles == 7 + 63 + 15  # bundles 0x1..0x7 (two delay slots) and the stalls


_SELECTS = """
     0   :  { %s1_s0 = smov 5  ;;  %s2_s1 = smov 9 }
   0x1   :  { %p3_p0 = scmp.lt.s32.totalorder %s1_s0, %s2_s1 }
   0x2   :  { %s4_s2 = smov (%p3_p0, %s1_s0), 7  ;;  %s5_s3 = smov (!%p3_p0, %s1_s0), 7 }
"""


def test_negated_select():
    """``smov (%p, %s), imm`` is ``p ? imm : s``; ``smov (!%p, %s), imm`` is ``p ? s : imm``
    (a grid index carried to the next axis is such a select)."""
    blist, regions = bundles.parse(_SELECTS)
    sim = bundles._Sim(blist, regions, bundles.Machine(), 100, None)
    sim.run()
    assert sim.reg["p0"] is True and sim.reg["s2"] == 7 and sim.reg["s3"] == 5


_FROM_PREFETCH = """
     0   :  { %s1_s0 = inlined_call_operand.hbm [shape: s32[2,3], index: 0, kind: input, shape index: {}]  ;;  %s2_s1 = smov [#allocation2] }
   0x1   :  { %s3_s2 = sshll.u32 %s1_s0, 4  ;;  %s7_s6 = inlined_call_operand.<no memory space> [shape: s32[1], index: 1, kind: input, shape index: {}] }
   0x2   :  { %s4_s3 = int_to_ptr.hbm [resolvable:$true] %s3_s2 }
   0x3   :  { %5 = dma.hbm_to_smem %s4_s3, 32, %s2_s1, [#allocation1] }
   0x4   :  { %s6_s4 = sld [smem:[#allocation2 + $0x82]]  ;;  %s8_s5 = sld [smem:[#allocation2 + $0x1]] }
"""


def test_prefetch_operands_fill_scalar_memory():
    """A DMA of operand 0 into scalar memory writes its words, a 2 x 3 table in 8 x 128-word
    tiles (row r, column c at r * 128 + c); operand 1, a scalar in a register, is its value."""
    import numpy as np

    blist, regions = bundles.parse(_FROM_PREFETCH)
    table = np.arange(6, dtype=np.int32).reshape(2, 3) + 10
    sim = bundles._Sim(blist, regions, bundles.Machine(), 100, None, {0: table, 1: np.array([42], np.int32)})
    sim.run()
    assert sim.reg["s4"] == table[1, 2] == 15 and sim.reg["s5"] == table[0, 1] == 11 and sim.reg["s6"] == 42
    assert bundles.operand_of(blist, "%s4_s3") == 0
    words = bundles.smem_words(table)
    assert len(words) == 8 * 128 and words[128 + 2] == 15 and words[3] == 0


def test_extrapolation_by_whole_periods():
    """Iterations past the budget are estimated by the mean over whole periods of the grid's
    trailing axes: a causal pattern (full, diagonal, skipped, skipped) repeating per row."""
    pattern = [400, 250, 10, 10]

    def it(c):
        return bundles.IterationStats(cycles=c, bundles=c, flops=float(c), hbm_bytes=2.0 * c)

    iters = [it(50)] + [it(pattern[i % 4]) for i in range(13)]  # the prologue, then 13 steps
    mean = est._period_mean(iters, (3, 4))  # period 4: 12 of the 13 steps are 3 whole periods
    assert mean.cycles == round(sum(pattern) / 4) == 168
    assert mean.hbm_bytes == 2.0 * sum(pattern) / 4
    assert est._median_iteration(iters).cycles in pattern  # one kind of step, not the mean
    assert est._period_mean(iters[:3], (3, 4)) is None  # not one whole period simulated


def test_prefetch_values_are_evaluated_from_the_arguments():
    """The kernel's scalar-prefetch operand is computed on the CPU from the concrete argument
    (``n * 2`` under a static flag given as it is); from a ShapeDtypeStruct it is unknown."""
    from pallas_tpu._src import prefetch_values

    def f(n, x, twice=False):
        return prefetch_loop(n * 2 if twice else n, x)

    x = jax.ShapeDtypeStruct(LOOP_BLOCK, jnp.float32)
    traced = compile_check._traced_for("v5e", ((), {}))
    known = prefetch_values.prefetch_values(f, (jnp.array([3], jnp.int32), x), {"twice": True}, traced)
    assert len(known) == 1 and list(known[0]) == [0] and known[0][0].tolist() == [6]
    traced = compile_check._traced_for("v5e", ((), {}))
    unknown = prefetch_values.prefetch_values(f, (jax.ShapeDtypeStruct((1,), jnp.int32), x), {}, traced)
    assert unknown == [{}]
