"""``pltpu.estimate`` against the chip: at least 20 kernels estimated and, on a TPU, measured.

    python benchmarks/tpu_estimate.py --estimate-only            # any machine (libtpu installed)
    python benchmarks/tpu_estimate.py                            # on a TPU v5e: estimate, measured, error
    python benchmarks/tpu_estimate.py --only matmul gmm --runs 20
    python benchmarks/tpu_estimate.py --estimate-only --chip v6e # the estimates for another chip

Kernels: 7 op families of ``pallas_tpu.ops`` at 2-3 shapes each (matmul and megablox's
gmm at block choices that rank, flash and splash attention, paged attention at pages of 16
(scalar-heavy) and 128, ragged paged attention, the Threefry and Philox generators), the TPU
examples (``examples/tpu_*.py``), a DMA-bound copy and a transcendental-heavy kernel, each
sized to take over 300 us on the v5e: the lent v5e's host dispatches a call in about 120 us, so
a smaller kernel's measured time is that floor, not the kernel (the ops' example kernel, one
VMEM block, is left out for that). The integer arguments (lengths, page tables, group sizes)
go to ``estimate`` as the arrays the measurement uses, so the kernels' scalar-prefetch loops
run on them. Each row: the estimate for ``--chip`` (default the chip this runs
on, else v5e), what bounds a step, and where a TPU is present the measured time (the median of
``--runs`` rounds of back-to-back calls after a warm-up, ``_timing.measure``) and the error.
The summary line counts the rows within 10 % and, per family, whether the estimate ranks its
block choices as the chip does. A kernel that fails prints its error in its row.

``--measured FILE`` (any machine): the measured column of a table this script printed on a
TPU, matched by kernel name, against the estimates computed here; rows FILE has no time for
say so, and times under ``--floor-us`` (the host's dispatch floor) are shown but not counted.
``--measured benchmarks/results/tpu_estimate_v5e_chip.txt`` on a CPU writes what
``benchmarks/results/tpu_estimate_v5e.txt`` holds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing  # noqa: E402

from pallas_tpu._src import estimate as est  # noqa: E402

est.enable_dumps()  # before anything starts libtpu: compile in this process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas as pl  # noqa: E402

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16


@dataclasses.dataclass
class Case:
    name: str
    family: str  # block choices within a family are ranked
    fn: object
    args: tuple  # ShapeDtypeStructs (ints: concrete int32 data made by ``data``)
    data: object = None  # args -> concrete arrays for the measurement (default: random)


def _load_example(name):
    sys.path.insert(0, str(ROOT / "examples"))  # the examples import their _common
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _copy(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    spec = pl.BlockSpec((512, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(
        kernel, out_shape=S(x.shape, x.dtype), grid=(x.shape[0] // 512,), in_specs=[spec], out_specs=spec
    )(x)


def _transcendental(x):
    def kernel(x_ref, o_ref):
        y = x_ref[...]
        for _ in range(8):
            y = jnp.tanh(jnp.exp(y) * 0.5)
        o_ref[...] = y

    spec = pl.BlockSpec((256, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(
        kernel, out_shape=S(x.shape, x.dtype), grid=(x.shape[0] // 256,), in_specs=[spec], out_specs=spec
    )(x)


def cases() -> list[Case]:
    out = []
    from pallas_tpu.ops import matmul as mm

    # 2048 x 4096 x 4096 (about 370 us) where 2048^3 (100-120 us) was at the host's dispatch floor.
    for m, blocks in (
        (2048, (512, 512, 1024)),
        (2048, (1024, 1024, 1024)),
        (4096, (1024, 1024, 1024)),
        (4096, (512, 512, 1024)),
    ):
        bm, bn, bk = blocks
        name = f"matmul {m}^3" if m == 4096 else f"matmul {m}x4096x4096"
        out.append(Case(f"{name} {bm}/{bn}/{bk}", name, functools.partial(mm.matmul, block_shape=(bm, bn), block_k=bk), (S((m, 4096), BF), S((4096, 4096), BF))))  # fmt: skip
    from pallas_tpu.ops.megablox.gmm import gmm

    def sizes(args):  # even groups
        g = args[2].shape[0]
        return (*_random_args(args[:2]), jnp.full((g,), args[0].shape[0] // g, jnp.int32))

    for tiling in ((512, 2048, 2048), (512, 1024, 1024)):
        out.append(Case(f"gmm G8 8192x2048x2048 {'/'.join(map(str, tiling))}", "gmm", functools.partial(gmm, tiling=tiling, preferred_element_type=BF),
                        (S((8192, 2048), BF), S((8, 2048, 2048), BF), S((8,), jnp.int32)), data=sizes))  # fmt: skip
    from pallas_tpu.ops.flash_attention import BlockSizes, flash_attention

    for length, bq in ((2048, 512), (2048, 1024), (4096, 1024)):
        blocks = BlockSizes(block_q=bq, block_k_major=bq, block_k=bq, block_b=1)
        out.append(Case(f"flash fwd causal 2x16x{length}x128 block {bq}", f"flash {length}",
                        functools.partial(flash_attention, causal=True, block_sizes=blocks), (S((2, 16, length, 128), BF),) * 3))  # fmt: skip
    try:
        from pallas_tpu.ops.splash_attention import splash_attention_kernel as sk
        from pallas_tpu.ops.splash_attention import splash_attention_mask as sm

        for length in (2048, 4096):
            mask = sm.MultiHeadMask([sm.CausalMask((length, length))] * 8)
            kernel = sk.make_splash_mha_single_device(mask)
            out.append(
                Case(
                    f"splash causal 8x{length}x128",
                    "splash",
                    jax.vmap(kernel),
                    (S((2, 8, length, 128), BF),) * 3,
                )
            )
    except Exception as e:  # noqa: BLE001
        print(f"splash attention not set up: {e}", file=sys.stderr)
    from pallas_tpu.ops.paged_attention import paged_attention

    def paged_data(args):
        q, k, v, lengths, pages = args
        rng = np.random.default_rng(0)
        data = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (q, k, v)]
        total = k.shape[1]
        perm = rng.permutation(total).reshape(pages.shape).astype(np.int32)
        return (*data, jnp.full(lengths.shape, pages.shape[1] * k.shape[2], jnp.int32), jnp.asarray(perm))

    for page, ppcb in ((16, 64), (16, 128), (128, 8)):
        b, qh, kvh, d, ctx = 16, 32, 8, 128, 4096
        pps = ctx // page
        out.append(Case(f"paged decode page {page} x{ppcb}", f"paged {page}", functools.partial(paged_attention, pages_per_compute_block=ppcb),
                        (S((b, qh, d), BF), S((kvh, b * pps, page, d), BF), S((kvh, b * pps, page, d), BF), S((b,), jnp.int32), S((b, pps), jnp.int32)),
                        data=paged_data))  # fmt: skip
    try:
        from pallas_tpu.ops.ragged_paged_attention import ragged_paged_attention

        def ragged_data(args):
            q, kv, lens, pages, cu, n = args
            seqs, pps = pages.shape
            rng = np.random.default_rng(1)
            per = q.shape[0] // seqs
            return (jnp.asarray(rng.standard_normal(q.shape), q.dtype), jnp.asarray(rng.standard_normal(kv.shape), kv.dtype),
                    jnp.full((seqs,), pps * kv.shape[1], jnp.int32), jnp.asarray(rng.permutation(kv.shape[0])[: seqs * pps].reshape(seqs, pps).astype(np.int32)),
                    jnp.arange(seqs + 1, dtype=jnp.int32) * per, jnp.array([seqs], jnp.int32))  # fmt: skip

        for page in (16, 128):
            seqs, pps = 8, 2048 // page
            out.append(Case(f"ragged paged page {page} 8 seqs x 2048", "ragged", functools.partial(ragged_paged_attention, sm_scale=128**-0.5),
                            (S((8 * 128, 32, 128), BF), S((seqs * pps + 8, page, 16, 128), BF), S((seqs,), jnp.int32), S((seqs, pps), jnp.int32),
                             S((seqs + 1,), jnp.int32), S((1,), jnp.int32)), data=ragged_data))  # fmt: skip
    except Exception as e:  # noqa: BLE001
        print(f"ragged paged attention not set up: {e}", file=sys.stderr)
    try:
        from pallas_tpu.ops.random import philox, threefry

        key = jax.random.key_data(jax.random.key(0, impl="threefry2x32"))
        out.append(Case("threefry bits 4096x4096", "random", lambda k: threefry.threefry_2x32_count(k, (4096, 4096), (4096, 4096), (256, 4096)), (S(key.shape, key.dtype),),
                        data=lambda a: (key,)))  # fmt: skip
        out.append(Case("philox bits 4096x4096", "random", lambda k: philox.philox_4x32_count(k, (4096, 4096)), (S((2,), jnp.uint32),),
                        data=lambda a: (jnp.array([0, 1], jnp.uint32),)))  # fmt: skip
    except Exception as e:  # noqa: BLE001
        print(f"random not set up: {e}", file=sys.stderr)
    # The ops' example kernel (example_kernel.double, one block, no grid) is left out: what fits
    # in VMEM takes under 20 us, below the host's dispatch floor of the lent v5e (118-130 us).
    for name, call in (
        ("tpu_matmul", lambda m: functools.partial(m.matmul, bm=512, bn=512, bk=512, call_kwargs={})),
    ):
        try:
            mod = _load_example(name)
            out.append(
                Case(f"example {name} 2048^3", "example", call(mod), (S((2048, 2048), jnp.float32),) * 2)
            )
        except Exception as e:  # noqa: BLE001
            print(f"example {name} not set up: {e}", file=sys.stderr)
    try:
        mod = _load_example("tpu_flash_attention")
        fa = functools.partial(mod.flash_attention, block_q=512, block_k=512, causal=True, call_kwargs={})
        out.append(
            Case(
                "example tpu_flash_attention 2x8x2048x128",
                "example",
                fa,
                (S((2, 8, 2048, 128), jnp.float32),) * 3,
            )
        )
    except Exception as e:  # noqa: BLE001
        print(f"example tpu_flash_attention not set up: {e}", file=sys.stderr)
    out.append(Case("copy 8192x2048 f32 (DMA-bound)", "copy", _copy, (S((8192, 2048), jnp.float32),)))
    out.append(  # 32768 rows (about 430 us): 4096 (55 us) was below the dispatch floor
        Case("tanh(exp) x8 32768x1024 f32 (EUP)", "eup", _transcendental, (S((32768, 1024), jnp.float32),))
    )
    return out


def _random_args(args):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(a.shape) * 0.5, a.dtype) for a in args)


def estimate_args(case: Case) -> tuple:
    """The arguments ``estimate`` gets: the integer ones concrete (``case.data``'s: lengths,
    page tables, group sizes, whose values steer the kernels' scalar-prefetch loops and DMAs,
    as in the measurement), the others as shapes."""
    if case.data is None:
        return case.args
    return tuple(
        a if np.issubdtype(np.dtype(a.dtype), np.integer) and a.ndim else S(np.shape(a), a.dtype)
        for a in case.data(case.args)
    )


def measure(case: Case, runs: int) -> float:
    """The median over ``runs`` rounds of back-to-back calls (``_timing.measure``: at least
    50 ms a round, one sync at its end), in microseconds a call. One call timed alone would
    count the host's dispatch (about 0.6 ms a call on the lent v5e's host), not the kernel."""
    args = case.data(case.args) if case.data else _random_args(case.args)
    f = jax.jit(case.fn)
    return (
        _timing.measure({case.name: (lambda: f(*args), jax.block_until_ready)}, rounds=runs)[case.name] * 1e6
    )


def on_tpu() -> str | None:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform != "tpu":
        return None
    from pallas_tpu._src.language import tpu_info

    v = tpu_info.chip_version_from_device_kind(dev.device_kind)
    return v.value if v is not None else None


FLOOR_US = 130.0  # the lent v5e's host dispatch floor: back-to-back calls of a trivial kernel, 118-120 us


def read_measured(path: str) -> tuple[dict[str, float], str]:
    """The measured column of a table this script printed on a TPU (``| kernel | estimate |
    ... | measured | error |``), by kernel name, in microseconds, and the file's first comment
    line (which chip run it is). Rows with an empty measured cell are left out."""
    out: dict[str, float] = {}
    head = ""
    with open(path) as f:
        for line in f:
            if line.startswith("#") and not head:
                head = line.lstrip("# ").strip()
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("|") or len(cells) < 6 or cells[0] in ("kernel", "---"):
                continue
            m = cells[4].split()
            if m and m[-1] in ("us", "ms"):
                with contextlib.suppress(ValueError):
                    out[cells[0]] = float(m[0]) * (1000.0 if m[-1] == "ms" else 1.0)
    return out, head


def _libtpu_version() -> str:
    import importlib.metadata

    for dist in ("libtpu", "libtpu-nightly"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--estimate-only", action="store_true", help="no measurement (any machine)")
    ap.add_argument("--chip", help="the chip to estimate for (default: this TPU's, else v5e)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--only", nargs="*", help="substrings of the kernels' names")
    ap.add_argument(
        "--measured",
        metavar="FILE",
        help="compare with the measured column of FILE (a table this script printed on a TPU), "
        "matched by kernel name, instead of measuring here",
    )
    ap.add_argument(
        "--floor-us",
        type=float,
        default=FLOOR_US,
        help="measured times below this are the host's dispatch floor, not the kernel: shown, "
        "left out of the summary (default %(default)s, the lent v5e's)",
    )
    a = ap.parse_args()
    here = None if (a.estimate_only or a.measured) else on_tpu()
    chip = a.chip or here or "v5e"
    given: dict[str, float] = {}
    if a.measured:
        given, run = read_measured(a.measured)
        print(
            f"# pltpu.estimate for TPU {chip}, computed here; measured times read from {a.measured} ({run})"
        )
    else:
        print(
            f"# pltpu.estimate for TPU {chip}"
            + (f", measured on this {here}" if here else " (estimates only)")
        )
    if here:
        print(f"# jax {jax.__version__}; measured: median of {a.runs} runs after a warm-up")
    else:
        print(f"# jax {jax.__version__}, libtpu {_libtpu_version()}: the estimates")
    if here or given:
        print(f"# measured times under {a.floor_us:g} us are the host's dispatch floor: not counted below")
    print()
    print("| kernel | estimate | per step x steps | bound | measured | error |")
    print("|---|---|---|---|---|---|")
    rows = []
    for case in cases():
        if a.only and not any(o in case.name for o in a.only):
            continue
        try:
            report = est.estimate(case.fn, *estimate_args(case), chip=chip)
        except Exception as e:  # noqa: BLE001 (one kernel that fails does not stop the rest)
            print(
                f"| {case.name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | | | |",
                flush=True,
            )
            continue
        k = max(report.kernels, key=lambda k: k.time_us)
        measured = err = None
        if here:
            try:
                measured = measure(case, a.runs)
            except Exception as e:  # noqa: BLE001
                print(f"# {case.name}: not measured: {type(e).__name__}: {e}", file=sys.stderr)
        elif a.measured:
            measured = given.get(case.name)
        if measured:
            err = report.total_us / measured - 1
        floor = measured is not None and measured < a.floor_us
        rows.append((case, report.total_us, measured, None if floor else err))
        meas = f"{measured:.1f} us" if measured else ("not measured" if a.measured else "")
        error = f"{err:+.1%}" if err is not None else ""
        if floor:
            error += " (floor: not counted)"
        print(f"| {case.name} | {report.total_us:.1f} us | {k.step_us:.2f} us x {k.steps} | {k.bound} | {meas} | {error} |", flush=True)  # fmt: skip
    done = [r for r in rows if r[3] is not None]
    print(f"\n{len(rows)} kernels estimated", end="")
    floored = sum(r[2] is not None and r[3] is None for r in rows)
    unmeasured = sum(r[2] is None for r in rows)
    if done:
        within = sum(abs(r[3]) <= 0.10 for r in done)
        print(
            f"; {len(done)} measured above the floor, {within} within 10 % ({within / len(done):.0%}), max |error| {max(abs(r[3]) for r in done):.1%}",
            end="",
        )
        if floored or (unmeasured and (here or given)):
            print(f"; {floored} at the dispatch floor, {unmeasured} not measured", end="")
        ranks = []
        for fam in sorted({r[0].family for r in done}):
            mine = [r for r in done if r[0].family == fam]
            if len(mine) > 1:
                same = [r[0].name for r in sorted(mine, key=lambda r: r[1])] == [
                    r[0].name for r in sorted(mine, key=lambda r: r[2])
                ]
                ranks.append(f"{fam}: {'same' if same else 'DIFFERENT'}")
        if ranks:
            print("\nranking of block choices (estimate vs chip): " + ", ".join(ranks), end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
