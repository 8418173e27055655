"""First call of ``pallas_tpu.ops`` beside JAX's op of the same name, phase by phase.

    python benchmarks/tpu_first_call_ops.py [--quick] [--only NAME ...] [--repeat N] [--count]

Each (op, side) runs in a fresh Python process (no jit, lowering or Mosaic cache shared; JAX's
persistent compilation cache off), alternating ours and JAX's, ``--repeat`` times. A process
builds the op's arguments, then times, in wall and process-CPU seconds:

* trace: ``jax.jit(f).trace(*args)`` (Python: the op's wrapper, the kernels' jaxprs);
* lower: ``.lower()`` (StableHLO, each ``pallas_call`` lowered to a Mosaic module);
* compile: ``.compile()`` (XLA's TPU compiler and, per kernel, Mosaic's pipeline to LLO);
* run (on a TPU only): the compiled call on the chip, to ``block_until_ready``.

On a machine without a TPU the compile is for libtpu's compile-only TPU v5e device
(``compile_check.tpu_devices("v5e")``; libtpu must be installed), traced under an abstract mesh
of that device (``tests/ways/compiled.py``'s ``chip_mesh``: JAX's ops ask it for the
generation). On a TPU the arguments are on the chip and the total is the first call there.

The table gives each phase's median over the repeats (wall, with CPU beside it) of ours and
JAX's and their ratio; ``--count`` adds the kernels' Mosaic ops (each ``tpu_custom_call``'s
module decoded from the lowered program: kernels, ops in all, the largest kernel's ops), the
size of the straight-line code Mosaic compiles. Shapes (bf16): attention B2 H16 L4096 D128;
splash GQA 32 query heads over 8 KV heads at L8192; paged decode B32, 32/8 heads, pages of 32
keys, contexts up to 8k; ragged paged attention on a vLLM-like step (4 prefill chunks of 256
queries beside 124 decodes over contexts up to 8k, pages of 32); matmul 4096^3; gmm G8
8192x2048x2048. ``--quick``: small shapes, to check the script.

Runs on JAX 0.10.2 (a TPU host) and 0.11.2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PHASES = ("trace", "lower", "compile", "run")


# ---------------------------------------------------------------------------------------------
# The ops: each case returns (function, argument ShapeDtypeStructs or arrays) for a side.


def _modules(side):
    if side == "ours":
        from pallas_tpu import ops

        return ops
    from jax.experimental.pallas.ops import tpu as ops

    return ops


def _sds(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype)


def _attention_shape(quick):
    return (1, 2, 512, 128) if quick else (2, 16, 4096, 128)


def flash_case(side, quick, *, causal, backward):
    import jax
    import jax.numpy as jnp

    m = __import__(f"{_modules(side).__name__}.flash_attention", fromlist=["flash_attention"])
    shape = _attention_shape(quick)
    fwd = functools.partial(m.flash_attention, causal=causal, sm_scale=shape[-1] ** -0.5)
    f = fwd
    if backward:
        f = jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    return f, [_sds(shape, jnp.bfloat16)] * 3


def splash_case(side, quick, *, heads, kv_heads, length, backward):
    import jax
    import jax.numpy as jnp

    m = __import__(f"{_modules(side).__name__}.splash_attention", fromlist=["splash_attention"])
    batch = 1 if heads != kv_heads else 2
    if quick:
        heads, kv_heads, length, batch = max(2, heads // 8), max(1, kv_heads // 8), 512, 1
    mask = m.MultiHeadMask([m.CausalMask((length, length))] * heads)
    kernel = jax.vmap(m.make_splash_mha_single_device(mask))
    f = kernel
    if backward:
        f = jax.grad(lambda q, k, v: kernel(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    d = 128
    q = _sds((batch, heads, length, d), jnp.bfloat16)
    kv = _sds((batch, kv_heads, length, d), jnp.bfloat16)
    return f, [q, kv, kv]


def paged_case(side, quick):
    import jax.numpy as jnp

    m = __import__(f"{_modules(side).__name__}.paged_attention", fromlist=["paged_attention"])
    batch, heads, kv_heads, d, page, context = (
        (4, 8, 2, 128, 32, 1024) if quick else (32, 32, 8, 128, 32, 8192)
    )
    per_seq = context // page
    kw = {}
    if side == "jax":  # JAX's op has no default compute block: 512 keys
        kw = dict(pages_per_compute_block=min(per_seq, 512 // page))
    f = functools.partial(m.paged_attention, **kw)
    args = [
        _sds((batch, heads, d), jnp.bfloat16),
        _sds((kv_heads, batch * per_seq, page, d), jnp.bfloat16),
        _sds((kv_heads, batch * per_seq, page, d), jnp.bfloat16),
        _sds((batch,), jnp.int32),
        _sds((batch, per_seq), jnp.int32),
    ]
    return f, args


def ragged_case(side, quick):
    import jax.numpy as jnp

    m = __import__(f"{_modules(side).__name__}.ragged_paged_attention", fromlist=["ragged_paged_attention"])
    heads, kv_heads, d, page = (8, 2, 128, 32) if quick else (32, 8, 128, 32)
    seqs, tokens, context = (4, 64, 1024) if quick else (128, 2048, 8192)
    per_seq = context // page
    total = seqs * per_seq // 2 + 8  # the vLLM-like mix's pages (about half the largest context each)
    kw = dict(sm_scale=d**-0.5)
    if side == "jax":  # blocks given: JAX's op asks the device (a CPU here) for its tuned ones otherwise
        kw.update(num_kv_pages_per_block=512 // page, num_queries_per_block=32, vmem_limit_bytes=64 << 20)
    f = functools.partial(m.ragged_paged_attention, **kw)
    args = [
        _sds((tokens, heads, d), jnp.bfloat16),
        _sds((total, page, 2 * kv_heads, d), jnp.bfloat16),
        _sds((seqs,), jnp.int32),
        _sds((seqs, per_seq), jnp.int32),
        _sds((seqs + 1,), jnp.int32),
        _sds((1,), jnp.int32),
    ]
    return f, args


def ragged_values(args, quick):
    """The ragged case's tables on a TPU: 4 prefill chunks of 256 queries (contexts 256 to 4096)
    beside decodes over 512 to 8192 keys, pages scattered by a permutation."""
    import numpy as np

    tokens, seqs, per_seq = args[0].shape[0], args[2].shape[0], args[3].shape[1]
    page, total = args[1].shape[1], args[1].shape[0]
    rng = np.random.default_rng(0)
    if quick:
        mix = [(16, 400), (1, 200), (1, 90), (3, 300)]
    else:
        mix = [(256, n) for n in (256, 1024, 2048, 4096)]
        mix += [(1, int(n)) for n in rng.integers(512, 8193, size=seqs - 4)]
    pages = np.zeros((seqs, per_seq), np.int32)
    perm, used = rng.permutation(total), 0
    for s, (_, kv) in enumerate(mix):
        n = -(-kv // page)
        n_avail = min(n, total - used)
        pages[s, :n_avail] = perm[used : used + n_avail]
        used += n_avail
    kv_lens = np.array([min(kv, -(-kv // page) * page) for _, kv in mix], np.int32)
    cu = np.concatenate([[0], np.cumsum([q for q, _ in mix])]).astype(np.int32)
    assert cu[-1] <= tokens
    return [kv_lens, pages, cu, np.array([seqs], np.int32)]


def matmul_case(side, quick):
    import jax.numpy as jnp

    m = __import__(f"{_modules(side).__name__}.matmul", fromlist=["matmul"])
    n = 512 if quick else 4096
    blocks = (256, 256, 256) if quick else (512, 512, 1024)
    f = functools.partial(m.matmul, block_shape=blocks[:2], block_k=blocks[2])
    return f, [_sds((n, n), jnp.bfloat16)] * 2


def gmm_case(side, quick):
    import jax.numpy as jnp

    m = __import__(f"{_modules(side).__name__}.megablox", fromlist=["gmm"])
    g, mm, k, n = (4, 512, 256, 256) if quick else (8, 8192, 2048, 2048)
    tiling = (128, 128, 128) if quick else (512, 1024, 1024)
    f = functools.partial(m.gmm, preferred_element_type=jnp.bfloat16, tiling=tiling)
    return f, [_sds((mm, k), jnp.bfloat16), _sds((g, k, n), jnp.bfloat16), _sds((g,), jnp.int32)]


CASES = {
    "flash fwd": functools.partial(flash_case, causal=False, backward=False),
    "flash fwd causal": functools.partial(flash_case, causal=True, backward=False),
    "flash fwd+bwd causal": functools.partial(flash_case, causal=True, backward=True),
    "splash fwd causal": functools.partial(splash_case, heads=16, kv_heads=16, length=4096, backward=False),
    "splash fwd+bwd causal": functools.partial(
        splash_case, heads=16, kv_heads=16, length=4096, backward=True
    ),
    "splash GQA L8192 causal": functools.partial(
        splash_case, heads=32, kv_heads=8, length=8192, backward=False
    ),
    "paged decode": paged_case,
    "ragged paged": ragged_case,
    "matmul": matmul_case,
    "gmm": gmm_case,
}


# ---------------------------------------------------------------------------------------------
# One (case, side) in this process.


def _concrete(name, args, quick):
    """Arguments on the chip (a TPU run): random bf16 values, valid page tables and lengths."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    out = []
    for i, a in enumerate(args):
        if jnp.issubdtype(a.dtype, jnp.floating):
            out.append(jax.random.normal(jax.random.key(i), a.shape, jnp.float32).astype(a.dtype))
        else:
            out.append(None)
    if name == "paged decode":
        batch, per_seq = args[4].shape
        page = args[1].shape[2]
        out[3] = jnp.asarray(np.linspace(page, per_seq * page, batch).astype(np.int32))
        out[4] = jnp.asarray(np.random.default_rng(0).permutation(batch * per_seq).reshape(batch, per_seq))
    elif name == "ragged paged":
        out[2:] = map(jnp.asarray, ragged_values(args, quick))
    elif name == "gmm":
        g, mm = args[2].shape[0], args[0].shape[0]
        sizes = np.full(g, mm // g, np.int32)
        sizes[-1] += mm - sizes.sum()
        out[2] = jnp.asarray(sizes)
    return [jax.device_put(x) for x in out]


def _count_mosaic_ops(lowered) -> dict:
    """Kernels and Mosaic ops of every ``tpu_custom_call`` in the lowered program."""
    import base64

    from jaxlib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    bodies = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call":
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            if target == "tpu_custom_call":
                config = op.attributes["backend_config"]
                raw = ir.StringAttr(config).value_bytes if isinstance(config, ir.Attribute) else config
                bodies.append(json.loads(raw)["custom_call_config"]["body"])
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner)

    visit(module.operation)
    from jax.interpreters import mlir
    from jaxlib.mosaic.python import tpu

    counts = []
    ctx = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    for body in bodies:
        with ctx:
            kernel = ir.Module.parse(base64.b64decode(body))
        n = [0]

        def walk(op, n=n):
            n[0] += 1
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        walk(inner.operation)

        walk(kernel.operation)
        counts.append(n[0] - 1)  # not the builtin.module
    distinct = len(set(bodies))
    return {
        "kernels": len(bodies),
        "distinct": distinct,
        "ops": sum(counts),
        "max_ops": max(counts, default=0),
    }


def compile_check_dump():
    """Where libtpu dumps Mosaic's passes in this process (``--llo``), else None."""
    from pallas_tpu._src.mosaic import compile_check

    return compile_check._dump_dir()


def run_one(name, side, quick, count, profile):
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    sys.path.insert(0, str(ROOT / "tests"))  # tests/ways
    on_tpu = jax.default_backend() == "tpu"
    f, args = CASES[name](side, quick)
    if on_tpu:
        import contextlib

        args = _concrete(name, args, quick)
        mesh = contextlib.nullcontext()
    else:
        from ways.compiled import chip_mesh

        from pallas_tpu._src.mosaic import compile_check

        args = list(compile_check._placed(tuple(args), "v5e"))
        mesh = chip_mesh("v5e")
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    times, cpus = {}, {}
    with mesh:
        t, c = time.perf_counter(), time.process_time()

        def mark(phase):
            nonlocal t, c
            t2, c2 = time.perf_counter(), time.process_time()
            times[phase], cpus[phase] = t2 - t, c2 - c
            t, c = time.perf_counter(), time.process_time()

        if prof is not None:
            prof.enable()
        traced = jax.jit(f).trace(*args)
        mark("trace")
        lowered = traced.lower()
        mark("lower")
        if prof is not None:
            prof.disable()
        t, c = time.perf_counter(), time.process_time()
        compiled = lowered.compile()
        mark("compile")
        if on_tpu:
            jax.block_until_ready(compiled(*args))
            mark("run")
    device = args[0].sharding.device_set if not on_tpu else jax.devices()
    row = {"wall": times, "cpu": cpus, "jax": jax.__version__, "on_tpu": on_tpu}
    row["device"] = next(iter(device)).device_kind
    if count:
        row["count"] = _count_mosaic_ops(lowered)
    dump = compile_check_dump()
    if dump:
        from pallas_tpu._src.mosaic import compile_check

        row["llo"] = [n for n, _ in compile_check._llo_counts(compile_check._llo_files(dump))]
    if prof is not None:
        import pstats

        out = os.environ.get("FIRST_CALL_PROFILE") or f"/tmp/first_call_{side}.prof"
        prof.dump_stats(out)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(50)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    return row


# ---------------------------------------------------------------------------------------------
# The table.


def _child(name, side, args):
    cmd = [sys.executable, __file__, "--child", name, "--side", side]
    cmd += ["--quick"] * args.quick + ["--count"] * args.count
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    if args.llo:  # libtpu reads its flags once, when it starts: the child's environment
        import tempfile

        dump = tempfile.mkdtemp(prefix="first_call_llo_")
        env["LIBTPU_INIT_ARGS"] = f"{env.get('LIBTPU_INIT_ARGS', '')} --xla_mosaic_dump_to={dump}".strip()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1][:200] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(rows, key, phase):
    vals = [r[key][phase] for r in rows if phase in r[key]]
    return statistics.median(vals) if vals else None


def _fmt(rows, phase):
    w, c = _median(rows, "wall", phase), _median(rows, "cpu", phase)
    return "-" if w is None else f"{w:5.2f} ({c:5.2f})"


def report(name, results):
    ours, theirs = results["ours"], results["jax"]
    ok = {s: [r for r in rs if "error" not in r] for s, rs in results.items()}
    for side, rs in results.items():
        for r in rs:
            if "error" in r:
                print(f"  {name}: {side} failed: {r['error']}")
    if not ok["ours"] or not ok["jax"]:
        return
    for rs in ok.values():
        for r in rs:
            r["wall"]["total"] = sum(r["wall"].values())
            r["cpu"]["total"] = sum(r["cpu"].values())
    phases = [p for p in (*PHASES, "total") if _median(ok["ours"], "wall", p) is not None]
    del ours, theirs
    cells = []
    for p in phases:
        o, j = _median(ok["ours"], "wall", p), _median(ok["jax"], "wall", p)
        oc, jc = _median(ok["ours"], "cpu", p), _median(ok["jax"], "cpu", p)
        ratio = f"{o / j:5.1f}x" if j > 0 else "  -  "
        cratio = f"{oc / jc:5.1f}x" if jc > 0 else "  -  "
        cells.append(f"{p:8s} ours {_fmt(ok['ours'], p)}  JAX {_fmt(ok['jax'], p)}  {ratio} ({cratio} CPU)")
    print(f"{name}  [{len(ok['ours'])}/{len(ok['jax'])} runs]")
    for cell in cells:
        print(f"    {cell}")
    if "llo" in ok["ours"][0]:
        for side in ("ours", "jax"):
            llo = ok[side][0]["llo"]
            print(
                f"    {side:4s} LLO ops (Mosaic's output, per kernel): {sum(llo)} = {' + '.join(map(str, llo))}"
            )
    if "count" in ok["ours"][0]:
        for side in ("ours", "jax"):
            n = ok[side][0]["count"]
            print(
                f"    {side:4s} Mosaic: {n['kernels']} kernels ({n['distinct']} distinct), "
                f"{n['ops']} ops, largest {n['max_ops']}"
            )
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--only", action="append", help="cases whose name contains this (repeatable)")
    ap.add_argument("--repeat", type=int, default=2, help="fresh processes per side (alternating)")
    ap.add_argument("--count", action="store_true", help="count the kernels' Mosaic ops")
    ap.add_argument(
        "--llo",
        action="store_true",
        help="count the LLO ops Mosaic emits per kernel (libtpu dumps its passes: times are not comparable)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("ours", "jax"), help="run one side of --child here")
    ap.add_argument("--profile", action="store_true", help="with --child: cProfile of trace and lower")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.side, args.quick, args.count, args.profile)))
        return
    # This process leaves the TPU alone (libtpu lets one process hold it): each child says
    # where it ran.
    print(
        f"# {'quick shapes' if args.quick else 'benchmark shapes'}; seconds wall (process CPU), median of the runs"
    )
    first = True
    for name in CASES:
        if args.only and not any(s in name for s in args.only):
            continue
        results = {"ours": [], "jax": []}
        for _ in range(args.repeat):
            for side in ("ours", "jax"):
                results[side].append(_child(name, side, args))
        if first and "jax" in results["ours"][0]:
            r = results["ours"][0]
            where = "first call on the chip" if r["on_tpu"] else "compile-only TPU v5e (libtpu)"
            print(f"# jax {r['jax']}, {r['device']}: {where}; ratio ours / JAX")
            first = False
        report(name, results)


if __name__ == "__main__":
    main()
