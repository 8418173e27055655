"""``pallas_tpu.ops.paged_attention`` and ``.ragged_paged_attention`` against JAX's ops and XLA,
on a TPU.

    python benchmarks/tpu_ops_paged.py [--only NAME ...] [--rounds N] [--smoke]

Rows (bf16, arguments made on the chip with ``jax.random``, pages of a sequence scattered over
the cache by a random permutation):

* decode (``paged_attention``) B32, 32 q heads / 8 KV heads, D128, every sequence at a 32k
  context, pages of 16, 32, 64 and 128 keys (a 4 GiB cache): ours with its own blocks; JAX's
  op with compute blocks of 512 and 2048 keys (it has no default); XLA: the pages gathered
  into a dense ``[B, heads, 32k, D]`` and attended with ``jnp`` (when it fits);
* decode with int8 pages (``QuantizedTensor``), pages of 64: ours and JAX's (2048 keys);
* ragged (``ragged_paged_attention``), a vLLM-like step: 4 prefill chunks of 256 queries over
  contexts of 256 to 4096 keys beside 124 decodes over 512 to 8192 keys (about 1.1k query
  tokens in a 2048-token batch), 32/8 heads, D128, pages of 16 and 64: ours with its own
  blocks; JAX's op at its defaults and with (pages, queries) blocks of 512 keys x 32 queries and
  a 64 MiB VMEM limit. No XLA row: a dense gather of every token's context does not fit.
* v3 (``ragged_paged_attention.v3``, vLLM's call), the same mix with the decodes first
  (``distribution``), the new tokens' K/V written into the (donated) cache by the kernel: ours
  against the plain-JAX reference under ``jit`` (a scatter, then a loop over the sequences with
  the tables as constants). JAX has no op of this signature; "vs JAX best" is empty.

Each time is the median of ``--rounds`` rounds (``_timing.measure``) after a warm-up call. The
figure is GB/s of the KV cache read once (each sequence's keys and values, its length's worth;
the kernels read prefills' keys once per query block, so more), its fraction of the v5e's
~819 GB/s, and ours over JAX's best. Each output is checked against the first candidate's that
ran as a reference (XLA's, or JAX's). Writes results/tpu_ops_paged.csv (and .png). ``--smoke``
runs tiny shapes in interpret mode on a CPU (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import functools
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
from pallas_tpu.ops import ragged_paged_attention as ours_ragged  # noqa: E402
from pallas_tpu.ops.paged_attention import paged_attention as ours_paged  # noqa: E402
from pallas_tpu.ops.paged_attention import quantization_utils as ours_qu  # noqa: E402
from pallas_tpu.ops.ragged_paged_attention import v3 as ours_v3  # noqa: E402

HBM_V5E = 819e9


def _rand(key, shape, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def _jax_ops():
    from jax.experimental.pallas.ops.tpu import paged_attention as jpa
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jrpa
    from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils as jqu

    return jpa, jrpa, jqu


def _jax_interpreted(fn, smoke):
    """JAX's op as it is on a TPU; in JAX's TPU interpret mode with ``--smoke``."""
    if not smoke:
        return fn
    from jax.experimental.pallas import tpu as jax_pltpu

    def run(*args):
        with jax_pltpu.force_tpu_interpret_mode():
            return fn(*args)

    return run


def decode_workload(smoke, page_size, quantized=False):
    batch, q_heads, kv_heads, d, context = (2, 4, 2, 128, 256) if smoke else (32, 32, 8, 128, 32768)
    pages_per_seq = context // page_size
    total = batch * pages_per_seq
    q = _rand(0, (batch, q_heads, d), scale=d**-0.5)
    k, v = _rand(1, (kv_heads, total, page_size, d)), _rand(2, (kv_heads, total, page_size, d))
    lengths = jnp.full((batch,), context, jnp.int32)
    pages = jax.random.permutation(jax.random.key(3), total).reshape(batch, pages_per_seq).astype(jnp.int32)
    jpa, _, jqu = _jax_ops()
    ours_kw = dict(interpret=pltpu.InterpretParams()) if smoke else {}
    if quantized:
        k8, v8 = ours_qu.quantize_to_int8(k), ours_qu.quantize_to_int8(v)
        jk8, jv8 = jqu.QuantizedTensor(*k8), jqu.QuantizedTensor(*v8)
        args = (q, k8.weight, k8.scales, v8.weight, v8.scales, lengths, pages)
        kv_bytes = batch * kv_heads * context * 2 * (d + 4)

        def ours(q, kw, ks, vw, vs, lengths, pages):
            return ours_paged(
                q, ours_qu.QuantizedTensor(kw, ks), ours_qu.QuantizedTensor(vw, vs), lengths, pages, **ours_kw
            )

        def theirs(q, kw, ks, vw, vs, lengths, pages):
            del kw, ks, vw, vs
            return jpa.paged_attention(
                q, jk8, jv8, lengths, pages, pages_per_compute_block=min(pages_per_seq, 2048 // page_size)
            )

        cands = {"ours": jax.jit(ours), "JAX blocks 2048": _jax_interpreted(jax.jit(theirs), smoke)}
        return args, cands, kv_bytes
    args = (q, k, v, lengths, pages)
    kv_bytes = batch * kv_heads * context * 2 * d * 2

    def xla(q, k, v, lengths, pages):
        kd = k[:, pages].transpose(1, 0, 2, 3, 4).reshape(batch, kv_heads, -1, d)
        vd = v[:, pages].transpose(1, 0, 2, 3, 4).reshape(batch, kv_heads, -1, d)
        qg = q.reshape(batch, kv_heads, q_heads // kv_heads, d)
        s = jnp.einsum("bhgd,bhtd->bhgt", qg, kd, preferred_element_type=jnp.float32)
        s = jnp.where(jnp.arange(kd.shape[2]) < lengths[:, None, None, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1).astype(vd.dtype)
        return jnp.einsum("bhgt,bhtd->bhgd", p, vd).reshape(q.shape)

    cands = {"XLA": jax.jit(xla), "ours": jax.jit(functools.partial(ours_paged, **ours_kw))}
    for keys in (512, 2048):
        block = max(1, min(pages_per_seq, keys // page_size))
        fn = jax.jit(functools.partial(jpa.paged_attention, pages_per_compute_block=block))
        cands[f"JAX blocks {keys}"] = _jax_interpreted(fn, smoke)
    return args, cands, kv_bytes


def ragged_workload(smoke, page_size):
    q_heads, kv_heads, d = (4, 2, 128) if smoke else (32, 8, 128)
    rng = np.random.default_rng(0)
    if smoke:
        mix = [(16, 40), (1, 20), (1, 9), (3, 30)]
        tokens, pages_per_seq = 32, 64 // page_size
    else:
        prefills = [(256, n) for n in (256, 1024, 2048, 4096)]
        decodes = [(1, int(n)) for n in rng.integers(512, 8193, size=124)]
        mix, tokens, pages_per_seq = prefills + decodes, 2048, 8192 // page_size
    seqs = len(mix)
    total = sum(-(-kv // page_size) for _, kv in mix) + 8
    kv_lens = np.array([kv for _, kv in mix], np.int32)
    cu = np.concatenate([[0], np.cumsum([q for q, _ in mix])]).astype(np.int32)
    perm = rng.permutation(total)
    pages = np.zeros((seqs, pages_per_seq), np.int32)
    used = 0
    for s, (_, kv) in enumerate(mix):
        n = -(-kv // page_size)
        pages[s, :n] = perm[used : used + n]
        used += n
    q = _rand(10, (tokens, q_heads, d))
    kv_pages = _rand(11, (total, page_size, 2 * kv_heads, d))
    args = (
        q,
        kv_pages,
        jnp.asarray(kv_lens),
        jnp.asarray(pages),
        jnp.asarray(cu),
        jnp.array([seqs], jnp.int32),
    )
    kv_bytes = int(kv_lens.sum()) * 2 * kv_heads * d * 2
    kw = dict(sm_scale=d**-0.5)
    ours_kw = dict(interpret=pltpu.InterpretParams()) if smoke else {}
    cands = {}
    if smoke:  # the plain-JAX reference (a Python loop over the sequences) as the reference row
        cands["jnp reference"] = functools.partial(ours_ragged.ref_ragged_paged_attention, **kw)
    cands["ours"] = functools.partial(ours_ragged.ragged_paged_attention, **kw, **ours_kw)
    if not smoke:  # JAX's kernel does not run in JAX's TPU interpret mode on a CPU
        _, jrpa, _ = _jax_ops()
        cands["JAX defaults"] = functools.partial(jrpa.ragged_paged_attention, **kw)
        cands["JAX 512 keys x 32"] = functools.partial(
            jrpa.ragged_paged_attention, **kw, num_kv_pages_per_block=max(1, 512 // page_size),
            num_queries_per_block=32, vmem_limit_bytes=64 << 20,
        )  # fmt: skip
    n = int(cu[-1])

    def valid_rows(name, f):
        return f if name == "jnp reference" else jax.jit(lambda *a: f(*a)[:n])

    return args, {name: valid_rows(name, f) for name, f in cands.items()}, kv_bytes


def v3_workload(smoke, page_size):
    """vLLM's v3 call on the ragged row's mix (decodes first, ``distribution``): the new
    tokens' K/V written into the cache, then attention. Each candidate keeps the cache it got
    back and passes it (donated) to its next call, as vLLM does."""
    (q, _, kv_lens, pages, cu, num_seqs), _, kv_bytes = ragged_workload(smoke, page_size)
    q_lens = np.diff(np.asarray(cu))
    order = np.argsort(q_lens > 1, kind="stable")  # decodes first
    lens, pages = np.asarray(kv_lens)[order], np.asarray(pages)[order]
    cu = np.concatenate([[0], np.cumsum(q_lens[order])]).astype(np.int32)
    decodes, seqs = int((q_lens == 1).sum()), int(num_seqs[0])
    tokens, q_heads, d = q.shape
    kv_heads = q_heads // (4 if not smoke else 2)
    total = int(pages.max()) + 1
    cache = _rand(12, ours_v3.get_kv_cache_shape(total, page_size, kv_heads, d, jnp.bfloat16))
    k, v = _rand(13, (tokens, kv_heads, d)), _rand(14, (tokens, kv_heads, d))
    tables = (
        lens.astype(np.int32),
        pages.reshape(-1).astype(np.int32),
        cu,
        np.array([decodes, decodes, seqs], np.int32),
    )
    kw = dict(sm_scale=d**-0.5)
    n = int(cu[-1])
    ours_kw = dict(interpret=pltpu.InterpretParams()) if smoke else {}

    def kept(step):
        state = [jnp.array(cache, copy=True)]
        jitted = jax.jit(step, donate_argnums=(3,))

        def run(q, k, v):
            out, state[0] = jitted(q, k, v, state[0], *map(jnp.asarray, tables))
            return out

        return run

    def ours(q, k, v, c, *t):
        out, c = ours_v3.ragged_paged_attention(q, k, v, c, *t, **kw, **ours_kw)
        return out[:n], c

    def xla(q, k, v, c, *_):  # the plain-JAX reference, the tables closed over (concrete)
        return ours_v3.ref_ragged_paged_attention(q, k, v, c, *tables, **kw)

    cands = {"XLA reference": kept(xla), "ours": kept(ours)}
    # The cache written: the tokens' K/V moved once more than the ragged row reads.
    return (q, k, v), cands, kv_bytes + n * 2 * kv_heads * d * 2


def workloads(smoke):
    sizes = (16, 64) if smoke else (16, 32, 64, 128)
    rows = {f"decode B32 32k ps{ps}": functools.partial(decode_workload, smoke, ps) for ps in sizes}
    rows["decode B32 32k ps64 int8"] = functools.partial(decode_workload, smoke, 64, True)
    for ps in (16, 64):
        rows[f"ragged vLLM mix ps{ps}"] = functools.partial(ragged_workload, smoke, ps)
        rows[f"v3 vLLM mix + cache update ps{ps}"] = functools.partial(v3_workload, smoke, ps)
    return rows


def _sync(x):
    return jax.block_until_ready(x)


def report(name, cands, args, kv_bytes, rounds, smoke, rows):
    runnable, failed, outs = {}, {}, {}
    for impl, fn in cands.items():
        try:
            outs[impl] = _sync(fn(*args))
            runnable[impl] = (functools.partial(fn, *args), _sync)
        except Exception as e:  # a candidate that does not compile here does not hide the others
            failed[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times = (
        {i: 1.0 for i in runnable} if smoke else _timing.measure(runnable, rounds=rounds, min_round_s=0.05)
    )
    ref = next(iter(outs.values()), None)
    best_jax = min((t for i, t in times.items() if i.startswith("JAX")), default=None)
    for impl in cands:
        if impl in failed:
            print(f"| {name} | {impl} | FAILED {failed[impl]} |", flush=True)
            rows.append(dict(workload=name, impl=impl, error=failed[impl]))
            continue
        t = times[impl]
        err = float(jnp.max(jnp.abs(outs[impl].astype(jnp.float32) - ref.astype(jnp.float32))))
        gbs = kv_bytes / t / 1e9
        row = dict(
            workload=name, impl=impl, ms=round(t * 1e3, 4), gbs=round(gbs, 1), peak=round(gbs * 1e9 / HBM_V5E, 3),
            kv_bytes=kv_bytes, vs_jax_best=round(best_jax / t, 3) if best_jax else "", err=f"{err:.2g}",
        )  # fmt: skip
        rows.append(row)
        print(
            f"| {name} | {impl} | {row['ms']:.3f} | {gbs:.1f} | {row['peak']:.0%} | {row['vs_jax_best']} | {row['err']} |",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the workload names to run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (off a TPU)")
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    if jax.default_backend() != "tpu" and not a.smoke:
        print("no TPU here: run on a TPU, or pass --smoke to check the script in interpret mode")
        return 2
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("\n| workload | impl | ms | KV GB/s | of 819 GB/s | vs JAX best | max err vs first |")
    print("|---|---|---|---|---|---|---|")
    rows, failed = [], 0
    for name, make in workloads(a.smoke).items():
        if a.only and not any(s in name for s in a.only):
            continue
        try:
            args, cands, kv_bytes = make()
            report(name, cands, args, kv_bytes, a.rounds, a.smoke, rows)
        except Exception as e:  # one failing workload does not hide the others
            if a.smoke:
                raise
            failed += 1
            print(f"| {name} | FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]} |", flush=True)
    if not a.smoke:
        fields = ["workload", "impl", "ms", "gbs", "peak", "kv_bytes", "vs_jax_best", "err", "error"]
        panels = [_timing.Panel("ours, JAX's and XLA's", x="kv_bytes", y="gbs", ylabel="KV GB/s")]
        _timing.write_results(
            "tpu_ops_paged", [dict({f: "" for f in fields}, **r) for r in rows], fields, panels
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
