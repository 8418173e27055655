"""Accuracy of ``pallas_tpu.ops``' attention beside JAX's op of the same name, against float32.

Each row runs one attention op, ours and JAX's (``jax.experimental.pallas.ops.tpu``), on the same
fresh random inputs and compares each output (the forward's ``out`` and, for the differentiable
ops, ``dq``, ``dk``, ``dv``) with a plain ``jnp`` reference computed in float32 at
``precision="highest"`` from the same (rounded) inputs. The error is the maximum absolute difference
over the reference's maximum absolute value. A row is ``ok`` when ours is at most 1.1x JAX's error or
within 1e-4 of it.

Logits come at two scales: ``sharp`` (scale 1: unscaled random-normal queries and keys of head dim
128, logits of standard deviation ~11, a softmax close to one-hot) and ``soft`` (``D**-0.5``,
logits of standard deviation ~1). A kernel that rounds its queries again after scaling them shows
at the sharp scale only.

    python benchmarks/tpu_ops_accuracy.py                 # a TPU: the kernels compiled and run there
    python benchmarks/tpu_ops_accuracy.py                 # a CPU: both sides in TPU interpret mode
    python benchmarks/tpu_ops_accuracy.py --only flash --length 512

Exits 1 when a row is not ``ok``. Writes results/tpu_ops_accuracy.csv (copied to $OUT when set).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tpu as pltpu

F32, BF16 = jnp.float32, jnp.bfloat16
ON_TPU = jax.default_backend() == "tpu"


def rand(seed, shape, dtype):
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def softmax_attention(q, k, v, keep, scale, soft_cap=None, bias=None):
    """f32 ``softmax(cap((q k^T + bias) * scale), keep) v`` over ``[..., q, d]`` / ``[..., k, d]``;
    rows that keep no key give zeros."""
    q, k, v = (x.astype(F32) for x in (q, k, v))
    s = jnp.einsum("...qd,...kd->...qk", q, k, precision="highest")
    if bias is not None:
        s = s + bias.astype(F32)
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("...qk,...kd->...qd", p, v, precision="highest")


@dataclass
class Case:
    op: str  # the family, for --only
    name: str
    run: Callable[..., tuple[dict, dict, dict]]  # (ours, JAX's, reference): output name -> array


def with_vjp(f, q, k, v, do):
    """``out`` and the VJP's ``dq``, ``dk``, ``dv`` of ``f(q, k, v)`` at cotangent ``do``."""
    out, vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp(do.astype(out.dtype))
    return dict(out=out, dq=dq, dk=dk, dv=dv)


@contextlib.contextmanager
def jax_side():
    """JAX's op: on a CPU in JAX's TPU interpret mode (its io_callbacks refuse checks in a custom_vjp)."""
    if ON_TPU:
        yield
        return
    from jax.experimental.pallas import tpu as jax_pltpu

    with jax.enable_checks(False), jax_pltpu.force_tpu_interpret_mode(jax_pltpu.InterpretParams()):
        yield


@contextlib.contextmanager
def our_side():
    if ON_TPU:
        yield
        return
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        yield


def both(run_with, jax_on_ours=False):
    """``run_with(module_kind)`` for ours and JAX's, each in its own mode (``jax_on_ours``: JAX's
    module ported onto our Pallas, in our TPU interpret mode on a CPU)."""
    with our_side():
        ours = jax.tree.map(np.asarray, run_with("ours"))
    side = contextlib.ExitStack()
    if jax_on_ours:  # JAX's kernel body in our interpret mode (without checks, as JAX's side runs)
        side.enter_context(jax.enable_checks(False))
        side.enter_context(our_side())
    else:
        side.enter_context(jax_side())
    with side:
        theirs = jax.tree.map(np.asarray, run_with("jax"))
    return ours, theirs


# ---------------------------------------------------------------------------------------------
# flash_attention


def flash_case(args, *, causal, scale, dtype, bias=False, segments=False):
    b, h, lq, d = 1, args.heads, args.length, 128
    q, k, v, do = (rand(i, (b, h, lq, d), dtype) for i in range(4))
    ab = rand(5, (b, h, lq, lq), F32).astype(dtype) if bias else None
    ids = jnp.sort(jax.random.randint(jax.random.key(6), (b, lq), 0, 3), axis=1).astype(jnp.int32)
    keep = jnp.ones((lq, lq), bool)
    if causal:
        keep = jnp.tril(keep)
    keep = jnp.broadcast_to(keep, (b, h, lq, lq))
    if segments:
        keep = keep & (ids[:, None, :, None] == ids[:, None, None, :])

    def run_with(kind):
        if kind == "ours":
            from pallas_tpu.ops import flash_attention as m
        else:
            from jax.experimental.pallas.ops.tpu import flash_attention as m
        seg = m.SegmentIds(ids, ids) if segments else None
        # JAX's default blocks are 128s; ours chooses its own. Both at their defaults.
        f = jax.jit(lambda q, k, v: m.flash_attention(q, k, v, ab, seg, causal=causal, sm_scale=scale))
        return with_vjp(f, q, k, v, do)

    ours, theirs = both(run_with)

    def ref(q, k, v):
        return softmax_attention(q, k, v, keep, scale, bias=ab)

    want = with_vjp(ref, q.astype(F32), k.astype(F32), v.astype(F32), do.astype(F32))
    return ours, theirs, want


# ---------------------------------------------------------------------------------------------
# splash attention (MHA and GQA), scale folded into q by the caller (splash has no sm_scale)


def splash_case(args, *, mask_kind, scale, dtype, kv_heads=None, soft_cap=None, segments=False):
    h, lq, d = args.heads, args.length, 128
    q = rand(0, (h, lq, d), F32)
    kh = h if kv_heads is None else kv_heads
    k, v = rand(1, (kh, lq, d), dtype), rand(2, (kh, lq, d), dtype)
    q = (q * scale).astype(dtype)  # the caller scales q (rounded once, as any caller would)
    do = rand(3, (h, lq, d), dtype)
    ids = jnp.sort(jax.random.randint(jax.random.key(6), (lq,), 0, 3)).astype(jnp.int32)
    rows, cols = np.arange(lq)[:, None], np.arange(lq)[None, :]
    dense = {
        "causal": cols <= rows,
        "full": np.ones((lq, lq), bool),
        "local": (cols <= rows) & (cols > rows - 128),
    }[mask_kind]
    keep = jnp.asarray(dense)
    if segments:
        keep = keep & (ids[:, None] == ids[None, :])

    def run_with(kind):
        if kind == "ours":
            from pallas_tpu.ops import splash_attention as m
        else:
            from jax.experimental.pallas.ops.tpu import splash_attention as m
        one = {
            "causal": lambda: m.CausalMask((lq, lq)),
            "full": lambda: m.FullMask((lq, lq)),
            "local": lambda: m.LocalMask((lq, lq), (127, 0), offset=0),
        }[mask_kind]()
        mask = m.MultiHeadMask([one] * h)
        blocks = m.BlockSizes(
            block_q=min(512, lq),
            block_kv=min(512, lq),
            block_kv_compute=min(512, lq),
            block_q_dkv=min(512, lq),
            block_kv_dkv=min(512, lq),
            block_kv_dkv_compute=min(512, lq),
            block_q_dq=min(512, lq),
            block_kv_dq=min(512, lq),
        )
        make = m.make_splash_mha_single_device if kv_heads is None else m.make_splash_mqa_single_device
        if kv_heads is None:
            kernel = make(mask, block_sizes=blocks, attn_logits_soft_cap=soft_cap)
            kk, vv = k, v
        else:  # one KV head shared by every q head
            kernel = make(mask, block_sizes=blocks, attn_logits_soft_cap=soft_cap)
            kk, vv = k[0], v[0]
        seg = m.SegmentIds(ids, ids) if segments else None
        f = jax.jit(lambda q, k, v: kernel(q, k, v, segment_ids=seg))
        return with_vjp(f, q, kk, vv, do)

    ours, theirs = both(run_with)

    def ref(q, k, v):
        if kv_heads is not None:
            k, v = jnp.broadcast_to(k, (h, *k.shape)), jnp.broadcast_to(v, (h, *v.shape))
        return softmax_attention(q, k, v, keep, 1.0, soft_cap)

    kk, vv = (k, v) if kv_heads is None else (k[0], v[0])
    want = with_vjp(ref, q.astype(F32), kk.astype(F32), vv.astype(F32), do.astype(F32))
    return ours, theirs, want


# ---------------------------------------------------------------------------------------------
# paged attention (decode), ragged paged attention (mixed prefill and decode)


def paged_case(args, *, scale, dtype, soft_cap=None):
    batch, heads, kv_heads, d, page, pages_per_seq = 4, 8, 2, 128, 16, args.length // 16
    total = batch * pages_per_seq
    q = (rand(0, (batch, heads, d), F32) * scale).astype(dtype)
    kp, vp = rand(1, (kv_heads, total, page, d), dtype), rand(2, (kv_heads, total, page, d), dtype)
    perm = jax.random.permutation(jax.random.key(3), total).astype(jnp.int32)
    indices = perm.reshape(batch, pages_per_seq)
    lengths = jnp.array([args.length, args.length // 2 + 3, 17, args.length - 5], jnp.int32)

    def run_with(kind):
        if kind == "ours":
            from pallas_tpu.ops import paged_attention as m
        else:
            from jax.experimental.pallas.ops.tpu import paged_attention as m
        f = jax.jit(
            lambda q: m.paged_attention(
                q, kp, vp, lengths, indices, attn_logits_soft_cap=soft_cap, pages_per_compute_block=4
            )
        )
        return dict(out=f(q))

    ours, theirs = both(run_with)
    # The reference: each sequence's keys gathered from its pages.
    k_seq = kp[:, indices].reshape(kv_heads, batch, pages_per_seq * page, d).transpose(1, 0, 2, 3)
    v_seq = vp[:, indices].reshape(kv_heads, batch, pages_per_seq * page, d).transpose(1, 0, 2, 3)
    group = heads // kv_heads
    k_seq, v_seq = jnp.repeat(k_seq, group, axis=1), jnp.repeat(v_seq, group, axis=1)
    keep = jnp.arange(pages_per_seq * page)[None, None, None, :] < lengths[:, None, None, None]
    want = softmax_attention(q[:, :, None, :], k_seq, v_seq, keep, 1.0, soft_cap)[:, :, 0]
    return ours, theirs, dict(out=want)


def jax_ragged_on_our_interpreter():
    """JAX's ragged paged attention module with its Pallas imports pointed at ours: JAX's TPU
    interpret mode cannot run JAX's kernel (a reshaped Ref), ours runs JAX's kernel body as written
    (tests/tpu/test_jax_tpu_ops.py ports the file; no line of its arithmetic changes)."""
    import importlib

    tests = Path(__file__).resolve().parent.parent / "tests"
    sys.path[:0] = [str(tests / "tpu"), str(tests)]  # the test file, and tests/ways it imports
    from test_jax_tpu_ops import PORTED, _PortedOpsFinder

    if not any(isinstance(f, _PortedOpsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PortedOpsFinder())
    return importlib.import_module(f"{PORTED}.ragged_paged_attention")


def ragged_case(args, *, scale, dtype, soft_cap=None, sliding_window=None):
    heads, kv_heads, d, page = 8, 2, 128, 16
    q_lens, kv_lens = [1, 1, 37, args.length // 2], [300, 129, 100, args.length]
    pages_per_seq = -(-max(kv_lens) // page)
    seqs = len(q_lens)
    total_pages = seqs * pages_per_seq
    tokens = sum(q_lens)
    q = rand(0, (tokens, heads, d), dtype)
    kv = rand(1, (total_pages, page, 2 * kv_heads, d), dtype)  # k and v heads interleaved
    indices = (
        jax.random.permutation(jax.random.key(3), total_pages).astype(jnp.int32).reshape(seqs, pages_per_seq)
    )
    cu = jnp.array(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kv_lens_a, num_seqs = jnp.array(kv_lens, jnp.int32), jnp.array([seqs], jnp.int32)

    def run_with(kind):  # blocks given: JAX's op asks the device for its tuned blocks otherwise
        if kind == "ours":
            from pallas_tpu.ops import ragged_paged_attention as m
        elif ON_TPU:
            from jax.experimental.pallas.ops.tpu import ragged_paged_attention as m
        else:
            m = jax_ragged_on_our_interpreter()
        f = jax.jit(
            lambda q: m.ragged_paged_attention(
                q,
                kv,
                kv_lens_a,
                indices,
                cu,
                num_seqs,
                sm_scale=scale,
                soft_cap=soft_cap,
                sliding_window=sliding_window,
                num_kv_pages_per_block=4,
                num_queries_per_block=16,
            )
        )
        return dict(out=f(q))

    ours, theirs = both(run_with, jax_on_ours=not ON_TPU)
    outs = []
    for i in range(seqs):
        pages = kv[indices[i]].reshape(pages_per_seq * page, 2 * kv_heads, d)[: kv_lens[i]]
        ks = jnp.repeat(pages[:, 0::2].transpose(1, 0, 2), heads // kv_heads, axis=0)
        vs = jnp.repeat(pages[:, 1::2].transpose(1, 0, 2), heads // kv_heads, axis=0)
        qs = q[int(cu[i]) : int(cu[i + 1])].transpose(1, 0, 2)
        pos_q = kv_lens[i] - q_lens[i] + np.arange(q_lens[i])[:, None]
        pos_k = np.arange(kv_lens[i])[None, :]
        keep = pos_k <= pos_q
        if sliding_window is not None:
            keep &= pos_k > pos_q - sliding_window
        outs.append(softmax_attention(qs, ks, vs, jnp.asarray(keep), scale, soft_cap).transpose(1, 0, 2))
    return ours, theirs, dict(out=jnp.concatenate(outs))


def cases(args) -> list[Case]:
    out: list[Case] = []
    for logits, scale in (("sharp", 1.0), ("soft", 128**-0.5)):
        for dtype in (BF16, F32):
            tag = f"{logits} {jnp.dtype(dtype).name}"
            kw = dict(scale=scale, dtype=dtype)
            out += [
                Case("flash", f"flash causal {tag}", lambda a, kw=kw: flash_case(a, causal=True, **kw)),
                Case(
                    "flash",
                    f"flash full +bias {tag}",
                    lambda a, kw=kw: flash_case(a, causal=False, bias=True, **kw),
                ),
                Case(
                    "flash",
                    f"flash causal +segments {tag}",
                    lambda a, kw=kw: flash_case(a, causal=True, segments=True, **kw),
                ),
                Case(
                    "splash",
                    f"splash causal {tag}",
                    lambda a, kw=kw: splash_case(a, mask_kind="causal", **kw),
                ),
                Case(
                    "splash",
                    f"splash full +segments {tag}",
                    lambda a, kw=kw: splash_case(a, mask_kind="full", segments=True, **kw),
                ),
                Case(
                    "splash", f"splash local {tag}", lambda a, kw=kw: splash_case(a, mask_kind="local", **kw)
                ),
                Case(
                    "splash",
                    f"splash causal soft_cap=20 {tag}",
                    lambda a, kw=kw: splash_case(a, mask_kind="causal", soft_cap=20.0, **kw),
                ),
                Case(
                    "splash",
                    f"splash mqa causal {tag}",
                    lambda a, kw=kw: splash_case(a, mask_kind="causal", kv_heads=1, **kw),
                ),
                Case("paged", f"paged {tag}", lambda a, kw=kw: paged_case(a, **kw)),
                Case(
                    "paged", f"paged soft_cap=20 {tag}", lambda a, kw=kw: paged_case(a, soft_cap=20.0, **kw)
                ),
                Case("ragged", f"ragged {tag}", lambda a, kw=kw: ragged_case(a, **kw)),
                Case(
                    "ragged",
                    f"ragged window=64 {tag}",
                    lambda a, kw=kw: ragged_case(a, sliding_window=64, **kw),
                ),
            ]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="op families: flash, splash, paged, ragged")
    parser.add_argument("--match", help="only cases whose name contains this")
    parser.add_argument("--length", type=int, default=2048 if ON_TPU else 256)
    parser.add_argument("--heads", type=int, default=4 if ON_TPU else 2)
    args = parser.parse_args()
    jax.config.update("jax_enable_checks", not ON_TPU)
    where = f"{jax.devices()[0].device_kind}, compiled" if ON_TPU else "CPU, TPU interpret mode"
    print(f"# jax {jax.__version__}, {where}, L{args.length} H{args.heads} D128")
    print(f"{'case':44s} {'out':5s} {'ours':>9s} {'JAX':>9s} {'ratio':>6s}")
    rows, bad = [], 0
    for case in cases(args):
        if args.only and case.op not in args.only or args.match and args.match not in case.name:
            continue
        try:
            ours, theirs, want = case.run(args)
        except Exception as e:  # a case neither side runs is reported, not fatal to the table
            print(f"{case.name:44s} error: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(dict(case=case.name, output="", ours="", jax="", ratio="", ok="error"))
            bad += 1
            continue
        for key in want:
            e_ours, e_jax = rel_err(ours[key], want[key]), rel_err(theirs[key], want[key])
            ok = e_ours <= 1.1 * e_jax + 1e-4
            bad += not ok
            ratio = e_ours / e_jax if e_jax else float("inf") if e_ours else 1.0
            print(f"{case.name:44s} {key:5s} {e_ours:9.2e} {e_jax:9.2e} {ratio:6.2f} {'' if ok else 'WORSE'}")
            rows.append(
                dict(
                    case=case.name,
                    output=key,
                    ours=f"{e_ours:.3e}",
                    jax=f"{e_jax:.3e}",
                    ratio=f"{ratio:.3f}",
                    ok=ok,
                )
            )
        sys.stdout.flush()
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    path = results / "tpu_ops_accuracy.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "output", "ours", "jax", "ratio", "ok"])
        writer.writeheader()
        writer.writerows(rows)
    if os.environ.get("OUT"):
        shutil.copy(path, os.environ["OUT"])
    print(f"# {bad} of {len(rows)} rows worse than JAX's (more than 1.1x its error + 1e-4)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
