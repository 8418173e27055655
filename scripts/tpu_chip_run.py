"""Runs a bundle of kernels (``tests/tpu/chip_bundle.py``) on a TPU with JAX alone (no
package of ours: the lent TPU machine's JAX 0.10.2 is older than the oldest we support).

    python scripts/tpu_chip_run.py BUNDLE [--out DIR] [--compile-only] [-k NAME]

For each exported kernel: every ``tpu_custom_call`` gets its Mosaic module again from the
bundle's text, serialized by this JAX's own Mosaic serializer, the StableHLO is serialized
for this JAX's StableHLO, and the function runs on
the chip beside JAX's own lowering of the same kernel source (run the same way); each output
is compared with JAX's and with its reference (max |out - ref| relative to max |ref|; integer
and boolean outputs must be equal). ``--compile-only`` compiles for a compile-only v5e device instead of running
(libtpu's Mosaic compiler without a chip: how this script is checked on a CPU machine).
Prints one line per kernel, writes ``tpu_chip_run.json`` into ``--out``, exits 1 when a
kernel fails or an error exceeds the bundle's tolerance.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np
from jax._src import tpu_custom_call
from jax._src.interpreters import mlir
from jax._src.lib import _jax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo


def _reserialize_mosaic(config: str, texts: dict[str, str]) -> str:
    """The backend config of a ``tpu_custom_call`` with its Mosaic body serialized
    again, by this JAX, from the module's text."""
    cfg = json.loads(config)
    body = base64.b64decode(cfg["custom_call_config"]["body"])
    key = hashlib.sha256(body).hexdigest()
    if key not in texts:
        raise KeyError(f"the bundle holds no text for the Mosaic module {key[:12]}: export it again")
    text = texts[key]
    ctx = mlir.make_ir_context()
    tpu_custom_call.tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        module = ir.Module.parse(text)
        asm = tpu_custom_call._lower_mosaic_module_to_asm(module)[0]
    cfg["custom_call_config"]["body"] = base64.b64encode(asm).decode("ascii")
    return json.dumps(cfg)


def _for_this_jax(exported, texts: dict[str, str]):
    """``exported`` with every Mosaic body and the StableHLO serialized by this JAX."""
    text = exported.mlir_module()
    ctx = mlir.make_ir_context()
    with ctx, ir.Location.unknown():
        module = ir.Module.parse(text)
    calls = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call":
            if ir.StringAttr(op.attributes["call_target_name"]).value == "tpu_custom_call":
                calls.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    # Each Mosaic module is parsed in a context of its own, outside this one's.
    configs = [
        _reserialize_mosaic(ir.StringAttr(op.attributes["backend_config"]).value, texts) for op in calls
    ]
    with ctx, ir.Location.unknown():
        for op, config in zip(calls, configs):
            op.attributes["backend_config"] = ir.StringAttr.get(config)
        version = hlo.get_version_from_compatibility_requirement(hlo.StablehloCompatibilityRequirement.NONE)
        serialized = _jax.mlir.serialize_portable_artifact(module.operation.get_asm(), version, False)
    count = len(calls)
    return dataclasses.replace(exported, mlir_module_serialized=serialized), count


def _rel(a, b) -> float:
    """max |a - b| / max |b| over the elements where ``a`` and ``b`` differ (NaN equals NaN,
    an infinity itself); inf where a NaN or an infinity stands against anything else."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return 0.0
    if not (np.isfinite(a[~same]).all() and np.isfinite(b[~same]).all()):
        return float("inf")
    scale = np.max(np.abs(b[np.isfinite(b)]), initial=0.0)
    return float(np.max(np.abs(a - b)[~same]) / max(scale, 1e-30))


def _exact(ref) -> bool:
    return not np.issubdtype(np.asarray(ref).dtype, np.floating)


def _check(outs, refs, tol) -> tuple[list[float], bool]:
    errs = [_rel(o, r) for o, r in zip(outs, refs)]
    ok = len(outs) == len(refs) and all(e == 0 if _exact(r) else e <= tol for e, r in zip(errs, refs))
    return errs, ok


# Kernels whose values come from the TPU's hardware random number generator: run_mosaic
# (which made the references) models its interface, not its bits, so such a kernel is
# compared with JAX's lowering of the same source on the chip only.
HARDWARE_RANDOM = ("tpu.prng_random_bits", "tpu.stochastic_convert")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", default=".")
    ap.add_argument("--compile-only", action="store_true", help="compile for a compile-only v5e, run nothing")
    ap.add_argument("-k", default="", help="only kernels whose name contains this")
    args = ap.parse_args()
    bundle = Path(args.bundle)
    try:
        import flatbuffers  # noqa: F401 - jax.export's deserializer needs it
    except ImportError:  # the TPU machine lacks it: the bundle carries its (pure-Python) wheel
        sys.path[:0] = [str(w) for w in bundle.glob("flatbuffers-*.whl")]
    entries = sorted(bundle.glob("*.json"), key=lambda p: json.loads(p.read_text())["name"])
    device = None
    if args.compile_only:
        from jax.experimental import topologies

        device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    elif jax.default_backend() != "tpu":
        print(f"no TPU here (backend {jax.default_backend()}): use --compile-only")
        return 1
    print(f"jax {jax.__version__} on {device or jax.devices()[0]}; {len(entries)} kernels in {bundle}")

    def load(path, texts):
        exported, count = _for_this_jax(jax.export.deserialize(bytearray(path.read_bytes())), texts)
        return exported, count

    def execute(exported):
        if device is not None:
            jax.jit(exported.call, out_shardings=jax.sharding.SingleDeviceSharding(device)).lower().compile()
            return None
        return [np.asarray(x) for x in jax.tree.leaves(jax.block_until_ready(jax.jit(exported.call)()))]

    rows, failed, kept = [], 0, {}
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def save():  # after every kernel: a crash keeps what ran
        (Path(args.out) / "tpu_chip_run.json").write_text(
            json.dumps(
                {"jax": jax.__version__, "device": str(device or jax.devices()[0]), "rows": rows}, indent=1
            )
        )

    fmt = lambda xs: ",".join(f"{x:.1e}" for x in xs)  # noqa: E731
    for path in entries:
        k = json.loads(path.read_text())
        if args.k not in k["name"]:
            continue
        stem = path.name[: -len(".json")]
        row = {"kernel": k["name"]}
        theirs_path = bundle / f"{stem}.jax.exported"
        outs = jouts = None
        try:
            exported, count = load(bundle / f"{stem}.exported", k["mosaic"])
            if count != k["custom_calls"]:
                raise RuntimeError(f"{count} Mosaic kernels found, the exporter wrote {k['custom_calls']}")
            start = time.perf_counter()
            outs = execute(exported)
            row["seconds"] = round(time.perf_counter() - start, 2)
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row.update(
                ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}", tb=traceback.format_exc()[-4000:]
            )
        # JAX's lowering of the same kernel source, run the same way: a reference, never a failure.
        if theirs_path.exists():
            try:
                jouts = execute(load(theirs_path, k["mosaic"])[0])
                row["jax_outcome"] = "ran"
            except Exception as e:  # noqa: BLE001 - an outcome, reported
                row["jax_outcome"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        else:
            row["jax_outcome"] = f"not exported: {k.get('jax_refused', '?')[:200]}"
        hardware_random = any(op in text for text in k["mosaic"].values() for op in HARDWARE_RANDOM)
        if row["ok"] and outs is not None:
            try:
                npz = np.load(bundle / f"{stem}.npz")
                refs = [npz[f"arr_{i}"] for i in range(len(npz.files))]
                # Ours passes on its reference; JAX's is information (its lowering has been the one
                # that was wrong), except on hardware random bits, where JAX's is the only
                # comparison and must be equal.
                row["vs_ref"], row["ok"] = _check(outs, refs, k["tolerance"])
                if hardware_random:
                    row["hardware_random"], row["ok"] = True, True
                if jouts is not None:
                    row["vs_jax"], ok_jax = _check(
                        outs, jouts, 0 if hardware_random else k["tolerance_vs_jax"]
                    )
                    row["jax_vs_ref"] = [_rel(j, r) for j, r in zip(jouts, refs)]
                    if hardware_random:
                        row["ok"] = ok_jax
            except Exception as e:  # noqa: BLE001 - reported per kernel
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
            differs = not row["ok"] or (
                "vs_jax" in row and max(row["vs_jax"], default=0) > k["tolerance_vs_jax"]
            )
            if differs and len(kept) < 64:  # the chip's outputs of a failing kernel come back
                kept.update({f"{stem}.out{i}": o for i, o in enumerate(outs)})
                kept.update({f"{stem}.jax{i}": o for i, o in enumerate(jouts or [])})
        failed += not row["ok"]
        mark = "ok  " if row["ok"] else "FAIL"
        if "error" in row:
            print(f"FAIL {k['name']}: {row['error'][:600]}")
            print(f"     JAX's lowering of the same kernel here: {row['jax_outcome']}")
        elif "vs_ref" in row:
            beside = (
                f"; ours vs JAX's {fmt(row['vs_jax'])} (JAX's vs ref {fmt(row['jax_vs_ref'])})"
                if "vs_jax" in row
                else f" (JAX's lowering: {row['jax_outcome']})"
            )
            note = " [hardware random bits: the reference is run_mosaic's model]" if hardware_random else ""
            print(
                f"{mark} {k['name']}: {k['custom_calls']} Mosaic kernel(s), vs ref {fmt(row['vs_ref'])}{beside}{note}"
            )
        else:
            print(
                f"ok   {k['name']}: {k['custom_calls']} Mosaic kernel(s) compiled by libtpu (JAX's: {row['jax_outcome']})"
            )
        rows.append(row)
        save()
    if kept:
        np.savez_compressed(Path(args.out) / "tpu_chip_failed_outputs.npz", **kept)
    random_rows = sum(bool(r.get("hardware_random")) for r in rows)
    print(f"{len(rows) - failed} of {len(rows)} kernels ok ({random_rows} of them on hardware random bits)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
