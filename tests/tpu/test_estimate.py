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
