"""``pallas_tpu.ops.random`` (Threefry-2x32 and Philox-4x32-10 kernels) against JAX's
ops and XLA's generators, on a TPU.

    python benchmarks/tpu_ops_random.py [--only NAME ...] [--rounds N] [--smoke]

Rows (uint32 bits unless said, keys made on the chip):

* threefry bits 8192x8192, a 1-d 2**26, narrow rows (2**20, 100), an attention-probability
  dropout mask B4 H16 L2048 (4-d): ours (``plthreefry_random_bits``), JAX's op
  (``ops.tpu.random.threefry``), XLA's ``jax.random.bits`` (threefry, the default);
* philox bits 8192x8192 and the dropout mask: ours (``philox_4x32_count``), JAX's op, and
  XLA's ``rbg`` generator (``RngBitGenerator``, the TPU's own Philox) as the reference;
* uniform f32 8192x8192 through ``jax.random`` with our threefry implementation's keys
  against the default keys (the sampler's float work is XLA's in both);
* threefry split of 2**20 keys: ours (``threefry_split``) against ``jax.random.split``.

Each time is the median of ``--rounds`` rounds (``_timing.measure``: back-to-back calls
of at least 50 ms per round, candidates alternating) after a warm-up call. GB/s count the
bytes written (4 per 32-bit value, 8 per key); the fraction of peak is of the v5e's 819
GB/s of HBM (a generator is bound by its hashing on the vector unit, not by HBM: the
fraction says how close it comes). Ratios are ours over XLA's and over JAX's op. Each
output is compared bit for bit with the reference (XLA's threefry; JAX's op for philox,
whose bits are its own): "equal" or the fraction of elements that differ (JAX's op
counts 3-d and higher shapes with the wrong strides). Writes results/tpu_ops_random.csv
(and .png). ``--smoke`` runs tiny shapes in interpret mode on a CPU (checks the script,
not speed).
"""

from __future__ import annotations

import argparse
import math
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
from pallas_tpu.ops.random import philox, threefry  # noqa: E402

PEAK_HBM_V5E = 819.0  # GB/s


class Side:
    """How to call ours and JAX's ops: on a TPU as they are; with ``--smoke`` in the
    interpret modes (ours: TPU interpret mode; JAX's: its own)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke

    def ours(self, fn):
        if not self.smoke:
            return jax.jit(fn)

        def interpreted(*args):
            with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
                return jax.jit(fn)(*args)

        return interpreted

    def jax_op(self, fn):
        if not self.smoke:
            return jax.jit(fn)
        from jax.experimental.pallas import tpu as jax_pltpu

        def interpreted(*args):
            with jax_pltpu.force_tpu_interpret_mode():
                return jax.jit(fn)(*args)

        return interpreted


def _jax_random_ops():
    try:
        from jax.experimental.pallas.ops.tpu.random import philox as jax_philox
        from jax.experimental.pallas.ops.tpu.random import threefry as jax_threefry
    except ImportError as e:
        print(f"JAX's random ops do not import: {e}")
        return None, None
    return jax_threefry, jax_philox


def _key():
    return jax.random.key_data(jax.random.key(1234))


def threefry_bits(side, shape):
    jax_threefry, _ = _jax_random_ops()
    cands = {
        "ours": side.ours(lambda k: threefry.plthreefry_random_bits(k, 32, shape)),
        "XLA": jax.jit(lambda k: jax.random.bits(jax.random.wrap_key_data(k), shape, jnp.uint32)),
    }
    if jax_threefry is not None:
        cands["JAX"] = side.jax_op(lambda k: jax_threefry.plthreefry_random_bits(k, 32, shape))
    return (_key(),), cands, 4 * math.prod(shape), "XLA"


def philox_bits(side, shape):
    _, jax_philox = _jax_random_ops()
    cands = {
        "ours": side.ours(lambda k: philox.philox_4x32_count(k, shape)),
        "XLA rbg": jax.jit(lambda k: jax.random.bits(jax.random.key(k[0], impl="rbg"), shape, jnp.uint32)),
    }
    reference = "ours"
    if jax_philox is not None:
        cands["JAX"] = side.jax_op(lambda k: jax_philox.philox_4x32_count(k, shape))
        reference = "JAX" if len(shape) <= 2 else "ours"
    return (_key(),), cands, 4 * math.prod(shape), reference


def uniform(side, shape):
    def sample(impl):
        return lambda k: jax.random.uniform(jax.random.wrap_key_data(k, impl=impl), shape, jnp.float32)

    cands = {
        "ours": side.ours(sample(threefry.plthreefry_prng_impl)),
        "XLA": jax.jit(sample("threefry2x32")),
    }
    return (_key(),), cands, 4 * math.prod(shape), "XLA"


def split(side, count):
    cands = {
        "ours": side.ours(lambda k: threefry.threefry_split(k, (count,))),
        "XLA": jax.jit(lambda k: jax.random.key_data(jax.random.split(jax.random.wrap_key_data(k), count))),
    }
    return (_key(),), cands, 8 * count, "XLA"


def workloads(side, smoke):
    if smoke:
        return {
            "threefry bits 64x256": lambda: threefry_bits(side, (64, 256)),
            "threefry bits 1-d 3000": lambda: threefry_bits(side, (3000,)),
            "threefry dropout mask 2x2x16x128": lambda: threefry_bits(side, (2, 2, 16, 128)),
            "philox bits 64x256": lambda: philox_bits(side, (64, 256)),
            "uniform f32 64x256": lambda: uniform(side, (64, 256)),
            "threefry split 1000": lambda: split(side, 1000),
        }
    mask = (4, 16, 2048, 2048)
    return {
        "threefry bits 8192x8192": lambda: threefry_bits(side, (8192, 8192)),
        "threefry bits 1-d 2^26": lambda: threefry_bits(side, (1 << 26,)),
        "threefry bits (2^20, 100)": lambda: threefry_bits(side, (1 << 20, 100)),
        "threefry dropout mask B4 H16 L2048": lambda: threefry_bits(side, mask),
        "philox bits 8192x8192": lambda: philox_bits(side, (8192, 8192)),
        "philox dropout mask B4 H16 L2048": lambda: philox_bits(side, mask),
        "uniform f32 8192x8192": lambda: uniform(side, (8192, 8192)),
        "threefry split 2^20": lambda: split(side, 1 << 20),
    }


def _agreement(out, ref) -> str:
    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape != ref.shape:
        return f"shape {out.shape} != {ref.shape}"
    differ = float(np.mean(out != ref))
    return "equal" if differ == 0 else f"{differ:.2%} differ"


def time_all(cands, args, rounds, smoke):
    runnable, failed = {}, {}
    for name, fn in cands.items():
        try:
            jax.block_until_ready(fn(*args))
            runnable[name] = (lambda fn=fn: fn(*args), jax.block_until_ready)
        except Exception as e:  # a candidate that does not compile here does not hide the others
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if smoke:
        return {name: 1.0 for name in runnable}, failed
    return _timing.measure(runnable, rounds=rounds, min_round_s=0.05), failed


def report(name, cands, args, nbytes, reference, rounds, smoke, rows):
    times, failed = time_all(cands, args, rounds, smoke)
    ref = cands[reference](*args) if reference in times else None
    xla = next((c for c in times if c.startswith("XLA")), None)
    for impl in cands:
        if impl in failed:
            print(f"| {name} | {impl} | FAILED {failed[impl]} |", flush=True)
            rows.append(dict(workload=name, impl=impl, error=failed[impl]))
            continue
        t = times[impl]
        gbs = nbytes / t / 1e9
        agreement = (
            "reference"
            if impl == reference
            else (_agreement(cands[impl](*args), ref) if ref is not None else "")
        )
        row = dict(
            workload=name, impl=impl, ms=round(t * 1e3, 4), gbs=round(gbs, 1), bytes=nbytes,
            peak=round(gbs / PEAK_HBM_V5E, 3),
            vs_xla=round(times[xla] / t, 3) if xla else "",
            vs_jax=round(times["JAX"] / t, 3) if "JAX" in times else "",
            bits=agreement,
        )  # fmt: skip
        rows.append(row)
        print(
            f"| {name} | {impl} | {row['ms']:.3f} | {gbs:.1f} | {row['peak']:.0%} | {row['vs_xla']} "
            f"| {row['vs_jax']} | {agreement} |",
            flush=True,
        )
        if (
            smoke
            and impl != reference
            and agreement not in ("equal", "")
            and not (impl == "JAX" or "rbg" in impl)
        ):
            raise AssertionError(f"{name}: {impl}'s bits differ from {reference}'s: {agreement}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the workload names to run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (off a TPU)")
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    if jax.default_backend() != "tpu" and not a.smoke:
        print("no TPU here: run on a TPU, or pass --smoke to check the script in interpret mode")
        return 2
    side = Side(a.smoke)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("\n| workload | impl | ms | GB/s | of HBM peak | vs XLA | vs JAX | bits |")
    print("|---|---|---|---|---|---|---|---|")
    rows, failed = [], 0
    for name, make in workloads(side, a.smoke).items():
        if a.only and not any(s in name for s in a.only):
            continue
        try:
            args, cands, nbytes, reference = make()
            report(name, cands, args, nbytes, reference, a.rounds, a.smoke, rows)
        except Exception as e:  # one failing workload does not hide the others
            if a.smoke:
                raise
            failed += 1
            print(f"| {name} | FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]} |", flush=True)
    if not a.smoke:
        fields = ["workload", "impl", "ms", "gbs", "peak", "bytes", "vs_xla", "vs_jax", "bits", "error"]
        panels = [_timing.Panel("ours, JAX's and XLA's", x="bytes", y="gbs", ylabel="GB/s written")]
        _timing.write_results(
            "tpu_ops_random", [dict({f: "" for f in fields}, **r) for r in rows], fields, panels
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
