"""ejkernel's Pallas kernels, on JAX's Pallas and on ours, compared kernel by kernel.

    python tests/downstream/run_ejkernel.py               # every kernel with a case below
    python tests/downstream/run_ejkernel.py flash_attention gated_delta_rule

ejkernel (PyPI, installed with ``--no-deps``: it pins jax 0.10) ships no tests. This
script is its test driver: each side runs in a fresh process (``--side jax`` or
``--side ours``, the latter with ejkernel's Pallas imports rewritten at import time by
``pallas_rewrite.py``) that

1. imports every module of ``ejkernel.kernels._pallas`` (and ``ejkernel.callib._pallas_call``)
   and records which load and, for those that do not, the exception's first line; on ours
   a module that cannot run unchanged loads as a stub (``pallas_rewrite.install(refused=)``)
   so that the rest of ejkernel still imports;
2. calls each kernel's public entry point (``ejkernel.kernels._pallas.{tpu,gpu}.<name>``)
   on small fresh random inputs (the same seed on both sides): TPU kernels in TPU
   interpret mode, Pallas Triton kernels with ``interpret=True`` (``tokamax_plugin``'s
   switches); the JAX side also calls ejkernel's XLA implementation of the same
   algorithm (its kernel registry's ``Platform.XLA`` entry, same arguments) as the
   ``jnp`` reference.

With ``--way compiled`` each side, after the interpreted call, traces the case again
for v5e and for v6e (``jax.eval_shape`` with the chip's device kind in context: kernels
that read the TPU generation refuse a CPU) and lowers every TPU ``pallas_call`` traced
(its own lowering: JAX's or ours) and compiles it with libtpu's Mosaic for that chip
(``tpu_compiled.py``); a kernel JAX's lowering gets through Mosaic and
ours does not fails the run unless ``known_differences.toml`` (``[[compiled]]``,
patterns of ``ejkernel::<kernel case>::<pallas_call name>``) gives a reason.

The parent compares: per kernel, runs on JAX, runs on ours, max abs diff ours vs JAX's
and each vs the XLA reference; ``ejkernel.tsv`` and ``imports.tsv`` in ``--out``. The exit
status is 1 when a kernel runs on JAX's Pallas and not on ours, or ours differs from
JAX's by more than the kernel's tolerance.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
EJKERNEL_VERSION = "0.0.80.3"  # the release the README's counts were measured on

# ---------------------------------------------------------------------------
# Cases: name -> (backend, build(rng) -> (args, kwargs), tolerance ours vs JAX's).
# Small shapes that still fill the TPU kernels' (8, 128) tiles.


def _normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _attention(rng, b=1, s=128, h=2, d=128, kvh=None):
    kvh = kvh or h
    return _normal(rng, b, s, h, d), _normal(rng, b, s, kvh, d), _normal(rng, b, s, kvh, d)


def _flash_attention(rng):
    return _attention(rng), dict(causal=True)


def _blocksparse_attention(rng):
    q, k, v = (x.transpose(0, 2, 1, 3) for x in _attention(rng))
    return (q, k, v), dict(causal=True)


def _ring_attention(rng):
    # Without a mesh axis ejkernel runs its XLA path: the sequence is sharded over the four
    # CPU devices (``SHARDED``) and the ring is the named axis.
    return _attention(rng, s=512), dict(causal=True, axis_name="sp")


def _gated_delta_rule(rng, b=1, s=1, h=2, d=128):
    # One decode step from a recurrent state: ejkernel routes longer sequences to its XLA
    # implementation, only the single-step decode is a Pallas kernel.
    q, k, v = _attention(rng, b, s, h, d)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    beta = 1 / (1 + np.exp(-_normal(rng, b, s, h)))
    decay = -np.abs(_normal(rng, b, s, h)) * 0.1
    state = _normal(rng, b, h, d, d) * 0.1
    return (q, k, v, beta.astype(np.float32)), dict(decay=decay.astype(np.float32), initial_state=state)


def _fused_cross_entropy(rng, n=16, vocab=512):
    return (_normal(rng, n, vocab), rng.integers(0, vocab, (n,)).astype(np.int32)), {}


def _fused_kl_divergence(rng, n=16, vocab=512):
    return (_normal(rng, n, vocab), _normal(rng, n, vocab)), {}


def _grouped_matmul(rng, m=256, k=128, n=128, groups=4):
    sizes = np.array([64, 32, 96, 64], np.int32)
    return (_normal(rng, m, k), _normal(rng, groups, k, n), sizes), {}


def _page_attention(rng, seqs=2, h=2, d=128, pages=8, page_size=16, per_seq=4):
    q = _normal(rng, seqs, h, d)
    kc, vc = _normal(rng, h, pages, page_size, d), _normal(rng, h, pages, page_size, d)
    lens = np.array([40, 64], np.int32)
    tables = rng.permutation(pages).astype(np.int32).reshape(seqs, per_seq)
    return (q, kc, vc, lens, tables), {}


def _prefill_page_attention(rng, chunk=32, h=1, d=128, pages=8, page_size=16):
    # One KV head: ejkernel's kernel starts the first page copies only at grid step h == 0, so
    # with two or more heads the second head waits on copies nobody started (a deadlock: JAX's
    # interpret mode hangs, ours reports the wait).
    q = _normal(rng, chunk, h, d)
    kc, vc = _normal(rng, h, pages, page_size, d), _normal(rng, h, pages, page_size, d)
    return (q, kc, vc, np.array([64], np.int32), rng.permutation(pages).astype(np.int32)), {}


def _ragged_decode_attention(rng, b=2, s=256, h=4, kvh=2, d=128):
    q = _normal(rng, b, h, d)
    k, v = _normal(rng, b, s, kvh, d), _normal(rng, b, s, kvh, d)
    return (q, k, v, np.array([0, 32], np.int32), np.array([200, 256], np.int32)), {}


def _ragged_decode_attention_gpu(rng):
    from ejkernel.ops import FwdParams  # its block sizes: without them the Triton path has none

    args, kwargs = _ragged_decode_attention(rng)
    params = FwdParams(blocksize_heads=16, kv_blocksize=64, num_key_splits=4, num_warps=4, num_stages=1)
    return args, dict(kwargs, fwd_params=params)


def _mla(rng, b=1, s=128, h=2, nope=128, rope=64, rank=128, vd=128):
    q = _normal(rng, b, s, h, nope + rope) * 0.1
    kv = _normal(rng, b, s, rank) * 0.1
    w_kc, w_vc = _normal(rng, rank, h, nope) * 0.1, _normal(rng, rank, h, vd) * 0.1
    return (q, kv, w_kc, w_vc), dict(b_k=_normal(rng, b, s, rope) * 0.1, causal=True)


CASES = {
    "flash_attention": ("tpu", _flash_attention, 1e-4),
    "blocksparse_attention": ("tpu", _blocksparse_attention, 1e-4),
    "ring_attention": ("tpu", _ring_attention, 1e-4),
    "gated_delta_rule": ("tpu", _gated_delta_rule, 1e-4),
    "fused_cross_entropy": ("tpu", _fused_cross_entropy, 1e-4),
    "fused_kl_divergence": ("tpu", _fused_kl_divergence, 1e-4),
    "grouped_matmul": ("tpu", _grouped_matmul, 1e-3),
    "grouped_matmulv2": ("tpu", _grouped_matmul, 1e-3),
    "grouped_matmulv3": ("tpu", _grouped_matmul, 1e-3),
    "page_attention": ("tpu", _page_attention, 1e-4),
    "prefill_page_attention": ("tpu", _prefill_page_attention, 1e-4),
    "ragged_decode_attention": ("tpu", _ragged_decode_attention, 1e-4),
    "flash_mla": ("tpu", _mla, 1e-4),
    "ragged_decode_attention[gpu]": ("gpu", _ragged_decode_attention_gpu, 1e-4),
}
# Cases run under jax.shard_map over the four CPU devices: name -> (axis, positional
# arguments sharded along their dimension 1, the sequence).
SHARDED = {"ring_attention": ("sp", 3)}

# Pallas kernels with no case here, and why (listed in the report).
NO_CASE = {
    "all_gather_matmul": "needs a device mesh axis (shard_map) and remote DMAs",
    "reduce_scatter_matmul": "needs a device mesh axis (shard_map) and remote DMAs",
    "deepseek_attn": "no case written yet (MLA with a lightning indexer)",
    "quantized_matmul": (
        "on a CPU ejkernel takes its dense XLA fallback (no pallas_call); with allow_dense_fallback=False"
        " its packed TPU path refuses the tiling (tried: 16x256 @ 4-bit 256x128, groups of 64)"
    ),
    "multi_latent_ragged_page_attention": "no case written yet (ragged paged KV cache)",
    "multi_latent_ragged_page_attention_v2": "no case written yet (ragged paged KV cache)",
    "ragged_gated_delta_rule": "no case written yet (ragged recurrent state)",
    "ragged_page_attention_v2": (
        "refuses before tracing a kernel: 'TPU version must be 4 or higher' (it reads the device,"
        " not the context's device kind), on both sides"
    ),
    "ragged_page_attention_v3": "no case written yet (ragged paged KV cache)",
    "scaled_dot_product_attention[gpu]": "not a Pallas kernel: calls jax.nn.dot_product_attention(cudnn)",
}


# ---------------------------------------------------------------------------
# One side (a fresh process).


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _import_all(refused: dict[str, str]) -> dict[str, str]:
    """Every Pallas module of ejkernel: ``ok``, ``refused: ...`` (ours: a stub) or the error."""
    results = {}
    try:
        pkg = importlib.import_module("ejkernel.kernels._pallas")
    except Exception as e:  # noqa: BLE001
        return {"ejkernel.kernels._pallas": _first_line(e)}
    names = ["ejkernel.callib._pallas_call"]
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    for name in names:
        try:
            importlib.import_module(name)
            results[name] = "ok"
        except Exception as e:  # noqa: BLE001
            results[name] = _first_line(e)
    for name, why in refused.items():
        results[name] = "refused: " + why.partition("rewrite: ")[2].strip("[]\x27")[:250]
    return results


def _leaves(out) -> list[np.ndarray]:
    import jax

    return [np.asarray(x, np.float32) for x in jax.tree.leaves(out)]


def _call(fn, args, kwargs, sharded=None):
    import jax
    import jax.numpy as jnp

    # ejkernel's beartype checks want jax Arrays, not numpy ones.
    args, kwargs = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, (args, kwargs))
    if sharded is not None:
        from jax.sharding import PartitionSpec as P

        axis, n = sharded
        mesh = jax.make_mesh((len(jax.devices()),), (axis,))
        spec = P(None, axis)
        body = jax.shard_map(
            lambda *a: fn(*a, **kwargs),
            mesh=mesh,
            in_specs=(spec,) * n + (P(),) * (len(args) - n),  # the same as ``specs``
            out_specs=spec,
            check_vma=False,
        )
        specs = (spec,) * n + (P(),) * (len(args) - n)
        args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, p)) for a, p in zip(args, specs)]
        out = jax.jit(body)(*args)
        jax.block_until_ready(out)
        return _leaves(out)
    out = fn(*args, **kwargs)
    jax.block_until_ready(out)
    return _leaves(out)


def run_side(side: str, name: str | None, out: Path, way: str = "interpret") -> None:
    """In a fresh process: the import listing (``name`` None) or one kernel's call,
    written to ``out/side/``."""
    sys.path.insert(0, str(HERE))
    refused: dict[str, str] = {}
    if side == "ours":
        import pallas_rewrite

        pallas_rewrite.install("ejkernel", refused=refused)
    import tokamax_plugin

    (tokamax_plugin._interpret_ours if side == "ours" else tokamax_plugin._interpret_jax)()
    if way == "compiled":
        import tpu_compiled

        tpu_compiled.record(side)
    where = out / side
    where.mkdir(parents=True, exist_ok=True)
    if name is None:
        (where / "imports.json").write_text(json.dumps(_import_all(refused), indent=1))
        return

    from ejkernel.kernels import _pallas
    from ejkernel.kernels._registry import kernel_registry

    backend, build, _ = CASES[name]
    algo = name.partition("[")[0]
    args, kwargs = build(np.random.default_rng(0))
    rec = {"status": "failed", "message": "", "seconds": 0.0}
    arrays = {}
    start = time.monotonic()
    try:
        fn = getattr(getattr(_pallas, backend), algo)
        for i, x in enumerate(_call(fn, args, kwargs, SHARDED.get(name))):
            arrays[f"pallas/{i}"] = x
        rec["status"] = "ran"
    except Exception as e:  # noqa: BLE001
        rec["message"] = _first_line(e)
        rec["where"] = _where(e)
    rec["seconds"] = round(time.monotonic() - start, 1)
    rec["kernels"] = tokamax_plugin._CALLS[0]  # pallas_call / pl.kernel calls the case made
    if way == "compiled" and backend == "tpu":
        # Traced again per chip with the chip's kind in context (kernels that read the TPU
        # generation refuse a CPU), each kernel lowered and compiled for that chip.
        import jax
        import jax.numpy as jnp

        a, k = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, (args, kwargs))
        fn = getattr(getattr(_pallas, backend), algo)
        if name in SHARDED:  # the kernels its interpreted run traced inside the shard_map
            rec["compiled"] = tpu_compiled.compile_recorded(side)
        else:
            rec["compiled"] = tpu_compiled.trace_and_compile(side, fn, a, k)
    if side == "jax":  # the XLA reference does not depend on whose Pallas is loaded
        try:
            ref = kernel_registry.get(algo, platform="xla")
            for i, x in enumerate(_call(ref, args, kwargs, SHARDED.get(name))):
                arrays[f"xla/{i}"] = x
            rec["xla"] = "ran"
        except Exception as e:  # noqa: BLE001
            rec["xla"] = _first_line(e)
    np.savez(where / f"{name}.npz", **arrays)
    (where / f"{name}.json").write_text(json.dumps(rec))


def _where(e: BaseException) -> str:
    """The innermost frame in our packages, or else ejkernel's: ``file:line``."""
    frames = traceback.extract_tb(e.__traceback__)
    for marks in (("/pallas", "/pallas_tpu", "/pallas_gpu"), ("/ejkernel/",)):
        hits = [f for f in frames if any(m in f.filename for m in marks) and "/jax/" not in f.filename]
        if hits:
            f = hits[-1]
            return f"{f.filename.rpartition('site-packages/')[2] or f.filename}:{f.lineno}"
    return ""


# ---------------------------------------------------------------------------
# The parent: both sides, then the comparison.


def _max_diff(a: dict, b: dict, ka: str, kb: str) -> float | None:
    xs = sorted(k for k in a if k.startswith(f"{ka}/"))
    ys = sorted(k for k in b if k.startswith(f"{kb}/"))
    if not xs or len(xs) != len(ys) or any(a[x].shape != b[y].shape for x, y in zip(xs, ys)):
        return None
    diffs = [float(np.max(np.abs(a[x] - b[y]), initial=0.0)) for x, y in zip(xs, ys)]
    return float("nan") if any(np.isnan(d) for d in diffs) else max(diffs)  # NaN anywhere: NaN


def _spawn(side: str, name: str | None, out: Path, timeout: int, way: str = "interpret") -> dict:
    """One side's import listing or one kernel, in a fresh process; its record."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    stem = name or "imports"
    (out / side).mkdir(parents=True, exist_ok=True)
    report = out / side / f"{stem}.json"
    report.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--side",
        side,
        "--out",
        str(out),
        "--way",
        way,
        *([name] if name else []),
    ]
    start = time.monotonic()
    with open(out / side / f"{stem}.log", "w") as f:
        try:
            subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "message": f"no result after {timeout} s", "seconds": timeout}
    if not report.exists():
        msg = f"the process wrote no report: see {out / side / stem}.log"
        return {"status": "crashed", "message": msg, "seconds": round(time.monotonic() - start, 1)}
    return json.loads(report.read_text())


def _load_all(path: Path) -> dict:
    return dict(np.load(path)) if path.exists() else {}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("jax", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--out", default="build/downstream/ejkernel", help="where the logs and reports go")
    p.add_argument("--only", choices=("jax", "ours"), help="run one side; the other's report is reused")
    p.add_argument("--timeout", type=int, default=600, help="seconds per kernel and side")
    p.add_argument(
        "--way",
        choices=("interpret", "compiled"),
        default="interpret",
        help="compiled: also lower each TPU pallas_call traced and compile it with libtpu for v5e and v6e",
    )
    p.add_argument("kernels", nargs="*", help=f"kernel names (default: all {len(CASES)} with a case)")
    args = p.parse_args(argv)
    names = args.kernels or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"no case for {unknown}; cases: {sorted(CASES)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.side:
        run_side(args.side, args.kernels[0] if args.kernels else None, out, args.way)
        return 0

    if importlib.util.find_spec("ejkernel") is None:
        sys.exit(f"ejkernel is not installed: pip install --no-deps ejkernel=={EJKERNEL_VERSION}")
    from importlib.metadata import version

    ev = version("ejkernel")
    if ev != EJKERNEL_VERSION:
        print(f"warning: ejkernel {ev}; the README's counts are for {EJKERNEL_VERSION}")
    sides = [s for s in ("jax", "ours") if not (args.only and args.only != s)]
    imports = {}
    for side in ("jax", "ours"):
        if side in sides:
            _spawn(side, None, out, args.timeout)
        imports[side] = json.loads((out / side / "imports.json").read_text())
    with open(out / "imports.tsv", "w") as f:
        f.write("module\tjax\tours\n")
        for m in sorted(imports["jax"] | imports["ours"]):
            f.write(f"{m}\t{imports['jax'].get(m, '-')}\t{imports['ours'].get(m, '-')}\n")
    for side, res in imports.items():
        bad = {m: r for m, r in res.items() if r != "ok"}
        print(f"imports on {side}: {len(res) - len(bad)} of {len(res)} Pallas modules load")
        for m, r in sorted(bad.items()):
            print(f"  {m}: {r}")

    rep, arr = {"jax": {}, "ours": {}}, {"jax": {}, "ours": {}}
    for name in names:
        for side in ("jax", "ours"):
            if side in sides:
                rec = _spawn(side, name, out, args.timeout, args.way)
            else:
                path = out / side / f"{name}.json"
                rec = json.loads(path.read_text()) if path.exists() else {"status": "missing"}
            rep[side][name] = rec
            npz = out / side / f"{name}.npz"
            arr[side][name] = dict(np.load(npz)) if npz.exists() and rec.get("status") == "ran" else {}
            print(
                f"{side:4} {name:34} {rec['status']:8} {rec.get('seconds', 0):6} s"
                f" {rec.get('kernels', '-'):>3} kernels {rec.get('message', '')[:120]}"
            )

    failures = []
    rows = []
    for name in names:
        j, o = rep["jax"][name], rep["ours"][name]
        xla = {k: v for k, v in _load_all(out / "jax" / f"{name}.npz").items() if k.startswith("xla/")}
        d_ours = _max_diff(arr["ours"][name], arr["jax"][name], "pallas", "pallas")
        d_jax_ref = _max_diff(arr["jax"][name], xla, "pallas", "xla")
        d_ours_ref = _max_diff(arr["ours"][name], xla, "pallas", "xla")
        rows.append((name, j, o, d_ours, d_jax_ref, d_ours_ref))
        tol = CASES[name][2]
        # NaN on one side: a failure of ours unless ours matches the XLA reference and JAX's does not.
        ours_right = (
            d_ours_ref is not None and d_ours_ref <= tol and not (d_jax_ref is not None and d_jax_ref <= tol)
        )
        bad = d_ours is None or d_ours > tol or (np.isnan(d_ours) and not ours_right)
        if j.get("status") == "ran" and (o.get("status") != "ran" or bad):
            failures.append(name)
    with open(out / "ejkernel.tsv", "w") as f:
        f.write(
            "kernel\tjax\tours\tours_vs_jax\tjax_vs_xla\tours_vs_xla\tjax_s\tours_s\tjax_kernels\tours_kernels"
            "\tjax_message\tours_message\n"
        )
        for name, j, o, d1, d2, d3 in rows:
            f.write(
                f"{name}\t{j.get('status', 'missing')}\t{o.get('status', 'missing')}\t{_fmt(d1)}\t{_fmt(d2)}"
                f"\t{_fmt(d3)}\t{j.get('seconds', '')}\t{o.get('seconds', '')}\t{j.get('kernels', '')}"
                f"\t{o.get('kernels', '')}\t{j.get('message', '')}"
                f"\t{o.get('message', '')} {o.get('where', '')}\n"
            )
    print(f"\n{'kernel':34} {'JAX':6} {'ours':6} {'ours-JAX':>9} {'JAX-XLA':>9} {'ours-XLA':>9}")
    for name, j, o, d1, d2, d3 in rows:
        print(
            f"{name:34} {j.get('status', '-'):6} {o.get('status', '-'):6} {_fmt(d1):>9} {_fmt(d2):>9} {_fmt(d3):>9}"
        )
    for name, j, o, *_ in rows:
        for s, r in (("JAX", j), ("ours", o)):
            if r.get("status") != "ran":
                print(f"  {name} on {s}: {r.get('message', '')} {r.get('where', '')}")
        if j.get("xla", "ran") != "ran":
            print(f"  {name}, XLA reference: {j['xla']}")
    print(
        f"\nran on JAX: {sum(r[1].get('status') == 'ran' for r in rows)} of {len(rows)};"
        f" on ours: {sum(r[2].get('status') == 'ran' for r in rows)}"
    )
    print("no case: " + "; ".join(f"{k} ({v})" for k, v in NO_CASE.items()))
    if failures:
        print(f"\nrun on JAX's Pallas, not on ours or differing: {failures}")
    unexplained = _report_compiled(rep, names, out) if args.way == "compiled" else []
    print(f"per kernel: {out / 'ejkernel.tsv'}; per module: {out / 'imports.tsv'}")
    return 1 if failures or unexplained else 0


def _report_compiled(rep: dict, names: list[str], out: Path) -> list[str]:
    """Counts per chip and side of the TPU kernels compiled; the kernels JAX's
    lowering got through Mosaic and ours did not (``compiled.tsv``)."""
    import run_tokamax
    import tpu_compiled

    known = run_tokamax.load_known(table="compiled")
    counts: dict = {}
    unexplained = []
    with open(out / "compiled.tsv", "w") as f:
        f.write("case\tside\tkernel\tchip\toutcome\tmessage\n")
        for name in names:
            for side in ("jax", "ours"):
                for kernel, chip, outcome, msg in rep[side][name].get("compiled", []):
                    f.write(f"{name}\t{side}\t{kernel}\t{chip}\t{outcome}\t{msg}\n")
                    counts.setdefault((chip, side), dict.fromkeys(tpu_compiled.OUTCOMES, 0))[outcome] += 1
    print("\nTPU kernels lowered and compiled by libtpu (pallas_calls traced by the cases):")
    print(f"  {'chip':5} {'side':5} " + " ".join(f"{o:>20}" for o in tpu_compiled.OUTCOMES))
    for (chip, side), c in sorted(counts.items()):
        print(f"  {chip:5} {side:5} " + " ".join(f"{c[o]:>20}" for o in tpu_compiled.OUTCOMES))
    for name in names:
        ours = [list(r) for r in rep["ours"][name].get("compiled", [])]
        for kernel, chip, outcome, _ in rep["jax"][name].get("compiled", []):
            if outcome != "compiled":
                continue
            short = kernel.partition(" at ")[0]
            mine = next((r for r in ours if r[1] == chip and r[0].partition(" at ")[0] == short), None)
            if mine is not None:
                ours.remove(mine)
            if mine is None or mine[2] != "compiled":
                key = f"ejkernel::{name}::{short}"
                reason = run_tokamax.reason_for(key, known)
                untraced = [r[3] for r in ours if r[1] == chip and r[2] == "not traced"]
                why = f"{mine[2]}: {mine[3]}" if mine else f"not traced on ours: {untraced[:1]}"
                print(f"  {chip} {key}: {why[:240]}  [{reason or 'UNEXPLAINED'}]")
                if reason is None:
                    unexplained.append(key)
    print(f"  per kernel: {out / 'compiled.tsv'}")
    return unexplained


if __name__ == "__main__":
    sys.exit(main())
