"""pallas_gpu ("ours") vs JAX's own Pallas (Triton backend) vs hand-written Triton (torch launch)
vs XLA on the GPU, at the sizes of the H200's reference figures (benchmarks/README.md), with the device copy bandwidth measured in the same run.

Every Pallas kernel is written once (`build_*(im, ...)`) and built with each Pallas module.
Tuned sections time each config quickly and keep each side's best. Final figures: medians of
5 interleaved rounds, each round N back-to-back calls (>= 50 ms) ended by one sync.

    python benchmarks/gpu_pallas.py                      # everything (GPU)
    python benchmarks/gpu_pallas.py --only matmul --only attention
    python benchmarks/gpu_pallas.py --small              # tiny sizes, interpret mode, CPU ok
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import _examples
import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from _timing import measure
from jax import lax

import pallas as pl
import pallas_gpu as plgpu

F32 = jnp.float32
MASK = -0.7 * float(jnp.finfo(F32).max)
LOG2E = math.log2(math.e)


class Impl:  # one Pallas: its module, its CompilerParams class and its interpret argument
    def __init__(self, name, plm, cp, interpret):
        self.name, self.pl, self.cp, self.interpret = name, plm, cp, interpret

    def call(self, kernel, out, grid, in_specs, out_specs, w, s):
        cp = self.cp(num_warps=w, num_stages=s)
        return jax.jit(self.pl.pallas_call(kernel, out, grid=grid, in_specs=in_specs, out_specs=out_specs,
                                           compiler_params=cp, interpret=self.interpret))  # fmt: skip


# ---------------------------------------------------------------- kernels (one source, two Pallas)
def build_add(im, n, cfg):
    block, w = cfg

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    spec = im.pl.BlockSpec((block,), lambda i: (i,))
    return im.call(kernel, jax.ShapeDtypeStruct((n,), F32), (n // block,), [spec, spec], spec, w, 1)


def build_softmax(im, shape, w):
    def kernel(x_ref, o_ref):
        x = x_ref[...]
        e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        o_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)

    spec = im.pl.BlockSpec((1, shape[1]), lambda i: (i, 0))
    return im.call(kernel, jax.ShapeDtypeStruct(shape, F32), (shape[0],), [spec], spec, w, 1)


def build_layer_norm(im, shape, w, eps=1e-5):
    def kernel(x_ref, w_ref, b_ref, o_ref):
        xc = x_ref[...] - jnp.mean(x_ref[...], axis=1, keepdims=True)
        var = jnp.mean(xc * xc, axis=1, keepdims=True)
        o_ref[...] = xc * lax.rsqrt(var + eps) * w_ref[...] + b_ref[...]

    row = im.pl.BlockSpec((1, shape[1]), lambda i: (i, 0))
    vec = im.pl.BlockSpec((shape[1],), lambda i: (0,))
    return im.call(kernel, jax.ShapeDtypeStruct(shape, F32), (shape[0],), [row, vec, vec], row, w, 1)


def build_matmul(im, d, cfg, group=8, **switches):
    """examples/matmul.py's ``matmul_grouped`` (the k loop in the kernel, a 1-D grid in grouped
    tile order, as the Triton kernel), with ``im``'s Pallas. ``switches``: more
    ``CompilerParams`` fields (ours: ``use_tma``, ``warp_specialize``), the kernel unchanged."""
    bm, bn, bk, w, s = cfg
    ex = _examples.load("matmul", _examples.which(im.pl))
    calls = _examples.Calls(interpret=im.interpret, compiler_params_cls=im.cp)
    if switches:
        calls = _examples.Calls(
            interpret=im.interpret, compiler_params=im.cp(num_warps=w, num_stages=s, **switches)
        )
    return jax.jit(functools.partial(ex.matmul_grouped, bm=bm, bn=bn, bk=bk, backend=calls, group=group,
                                     out_dtype=jnp.bfloat16, num_warps=w, num_stages=s))  # fmt: skip


def build_attention(im, shape, cfg, causal):
    """Flash attention forward on [batch, seq, heads, dim]; one program per (b, h, q block), q
    blocks of one head adjacent (K/V reuse in L2), heaviest causal blocks first. Causal: the
    blocks left of the diagonal run unmasked, only the diagonal blocks are masked."""
    B, S, H, D = shape
    bq, bk, w, s = cfg
    nq, scale = S // bq, D**-0.5 * LOG2E

    def ids(p):
        bh = lax.div(p, nq)
        return lax.div(bh, H), nq - 1 - lax.rem(p, nq), lax.rem(bh, H)

    def kernel(q_ref, k_ref, v_ref, o_ref):
        qi = nq - 1 - lax.rem(im.pl.program_id(0), nq)
        q = q_ref[...]

        def body(j, carry, masked):
            m, l, acc = carry
            k0 = im.pl.multiple_of(j * bk, bk)
            k, v = k_ref[im.pl.ds(k0, bk), :], v_ref[im.pl.ds(k0, bk), :]
            x = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
            if masked:
                rows = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
                cols = k0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
                x = jnp.where(rows >= cols, x, MASK)
            m_new = jnp.maximum(m, jnp.max(x, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(x - m_new[:, None])
            acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
            return m_new, l * alpha + jnp.sum(p, axis=1), acc

        carry = (jnp.full((bq,), -jnp.inf, F32), jnp.zeros((bq,), F32), jnp.zeros((bq, D), F32))
        if causal:
            lo = qi * (bq // bk)
            carry = lax.fori_loop(0, lo, functools.partial(body, masked=False), carry)
            carry = lax.fori_loop(lo, lo + bq // bk, functools.partial(body, masked=True), carry)
        else:
            carry = lax.fori_loop(0, S // bk, functools.partial(body, masked=False), carry)
        _, l, acc = carry
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)

    q_spec = im.pl.BlockSpec((None, bq, None, D), lambda p: (ids(p)[0], ids(p)[1], ids(p)[2], 0))
    kv_spec = im.pl.BlockSpec((None, S, None, D), lambda p: (ids(p)[0], 0, ids(p)[2], 0))
    out = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return im.call(kernel, out, (B * H * nq,), [q_spec, kv_spec, kv_spec], q_spec, w, s)


@triton.jit
def layer_norm_triton(x_ptr, w_ptr, b_ptr, o_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * n
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    xc = tl.where(mask, x - tl.sum(x, 0) / n, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, 0) / n + eps)
    y = xc * rstd * tl.load(w_ptr + cols, mask=mask) + tl.load(b_ptr + cols, mask=mask)
    tl.store(o_ptr + row + cols, y, mask=mask)


# ---------------------------------------------------------------- checking and timing
class Ctx:
    def __init__(self, small):
        self.small, self.torch, self.summary, self.fails = small, None, [], []
        self.impls = [Impl("ours", pl, plgpu.CompilerParams, plgpu.InterpretParams() if small else False)]
        try:
            from jax.experimental import pallas as jpl
            from jax.experimental.pallas import triton as jplt

            self.impls.append(Impl("JAX Pallas", jpl, jplt.CompilerParams, bool(small)))
        except Exception as e:  # noqa: BLE001
            print(f"JAX Pallas unavailable: {e!r}")
        try:
            if not small:
                import torch
                import triton_add  # the hand-written Triton kernels of examples/
                import triton_flash_attention
                import triton_matmul
                import triton_softmax

                self.torch = torch
                self.ex = {
                    m.__name__: m for m in (triton_add, triton_flash_attention, triton_matmul, triton_softmax)
                }
        except Exception as e:  # noqa: BLE001
            print(f"torch (or examples/triton_*.py) unavailable, no Triton (torch) column: {e!r}")

    def tt(self, x):  # jax array -> torch tensor (zero copy)
        return self.torch.from_dlpack(x)

    def check(self, label, out, ref, rtol, atol):
        if self.torch is not None and isinstance(out, self.torch.Tensor):
            self.torch.cuda.synchronize()
            o, r = out.float(), self.tt(ref).float()
            d = (o - r).abs()
            ok, err = bool((d <= atol + rtol * r.abs()).all()), float(d.max())
        else:
            o, r = out.astype(F32), ref.astype(F32)
            d = jnp.abs(o - r)
            ok, err = bool(jnp.all(d <= atol + rtol * jnp.abs(r))), float(jnp.max(d))
        self.fails += [] if ok else [label]
        status = "PASS" if ok else "FAIL"
        print(f"  check {label:44s} {status}  max_abs_err={err:.2e} (rtol {rtol:g}, atol {atol:g})")
        return ok

    def cand(self, groups, col, cfg, make, ref, tol, sub=lambda o: o):
        """make() -> (output, runner); checks the output and adds the runner when it passes."""
        try:
            out, runner = make()
            if self.check(f"{col} {cfg}", sub(out), ref, *tol):
                groups.setdefault(col, {})[cfg] = runner
        except Exception as e:  # noqa: BLE001
            self.fails.append(f"{col} {cfg}")
            print(f"  check {col} {cfg}: ERROR {type(e).__name__}: {str(e)[:400]}")

    def jax_cand(self, groups, col, cfg, build, args, ref, tol, sub=lambda o: o):
        def make():
            f = build()
            return f(*args), ((lambda: f(*args)), jax.block_until_ready)

        self.cand(groups, col, cfg, make, ref, tol, sub)

    def torch_cand(self, groups, col, cfg, launch, out, ref, tol, sub=lambda o: o):
        def make():
            launch()
            return out, (launch, lambda _: self.torch.cuda.synchronize())

        self.cand(groups, col, cfg, make, ref, tol, sub)


def compare(ctx, title, groups, work, unit, copy=None, targets=()):
    """groups: {column: {config label: runner}}. Tunes columns with several configs (2 quick
    rounds), then times each column's best, plus the copy, in 9 interleaved rounds of >= 0.1 s."""
    if not ctx.timed:
        return
    best = {}
    for col, cands in groups.items():
        if len(cands) <= 1:
            best.update({col: next(iter(cands.items()))} if cands else {})
            continue
        t = measure(cands, rounds=2, min_round_s=0.03)
        print(f"  tune {col:14s} " + " | ".join(f"{k} {work / v / 1e12:.2f}" for k, v in t.items()), unit)
        best[col] = (min(t, key=t.get), cands[min(t, key=t.get)])
    final = {col: r for col, (_, r) in best.items()}
    if copy is not None:
        final["copy"] = copy[1]
    t = measure(final, rounds=9, min_round_s=0.1)
    fig = {col: work / t[col] / 1e12 for col in best}
    if copy is not None:
        fig["copy"] = copy[0] / t["copy"] / 1e12
    print(f"[{title}] " + " | ".join(f"{c} {v:.2f} {unit}" + (f" ({best[c][0]})" if best.get(c, ("",))[0] else "")
                                    for c, v in fig.items()))  # fmt: skip
    ours, tg = fig.get("ours"), dict(targets)
    ratios = [(r, ours / fig[r], tg.get(r)) for r in REFS if ours and r in fig]
    print("  " + "  ".join(_fmt_ratio(*x) for x in ratios), flush=True)
    for col in (c for c in fig if c.startswith("ours+")):  # our variants: against the same references
        print("  " + "  ".join(f"{col}/{r} = {fig[col] / fig[r]:.3f}x" for r in REFS if r in fig), flush=True)
    ctx.summary.append({"title": title, **fig, "ratios": ratios})


REFS = ("JAX Pallas", "JAX-P our src", "Triton (torch)", "XLA", "copy")


def _fmt_ratio(ref, v, target):
    s = f"ours/{ref} = {v:.3f}x"
    return s + (f" (target >= {target:.2f}: {'MET' if v >= target else 'MISSED'})" if target else "")


# ---------------------------------------------------------------- sections
def copy_runner(nbytes):
    x = jnp.ones((nbytes // 4,), F32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * nbytes, ((lambda: f(x)), jax.block_until_ready)


def sec_copy(ctx):
    if not ctx.timed:
        return
    groups = {"XLA a+1": {"": copy_runner(1 << 30)[1]}}
    if ctx.torch:
        tx = ctx.torch.empty((1 << 30) // 4, device="cuda")
        groups["torch clone"] = {"": (lambda: tx.clone(), lambda _: ctx.torch.cuda.synchronize())}
    compare(ctx, "device copy 1 GiB (read+write)", groups, 2 << 30, "TB/s")


def sec_add(ctx):
    n = 2**14 if ctx.small else 2**28
    x, y = (jax.random.normal(jax.random.key(i), (n,), F32) for i in (0, 1))
    ref, groups, tol = x + y, {}, (0, 0)
    if ctx.torch:
        tx, ty, to = ctx.tt(x), ctx.tt(y), ctx.torch.empty(n, device="cuda")
    for b, w in [(1024, 4), (2048, 4), (4096, 8)]:
        for im in ctx.impls:
            ctx.jax_cand(groups, im.name, f"{b}/{w}w", lambda: build_add(im, n, (b, w)), (x, y), ref, tol)
        if ctx.torch:
            kernel = ctx.ex["triton_add"].add_kernel[(n // b,)]
            launch = functools.partial(kernel, tx, ty, n, to, BLOCK_SIZE=b, num_warps=w)
            ctx.torch_cand(groups, "Triton (torch)", f"{b}/{w}w", launch, to, ref, tol)
    ctx.jax_cand(groups, "XLA", "", lambda: jax.jit(jnp.add), (x, y), ref, tol)
    copy = copy_runner(1 << (22 if ctx.small else 30))
    compare(ctx, f"add f32 2^{n.bit_length() - 1}", groups, 3 * 4 * n, "TB/s", copy,
            [("JAX Pallas", 1.0), ("copy", 0.95)])  # fmt: skip


def sec_rows(ctx, which):
    shape = (64, 256) if ctx.small else (16384, 8192)
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(2), shape, F32)
    wt = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), shape[1:], F32)
    bs = 0.1 * jax.random.normal(jax.random.key(4), shape[1:], F32)
    if which == "softmax":
        args, build, tol = (x,), build_softmax, (1e-4, 1e-6)
        xla = jax.jit(lambda a: jax.nn.softmax(a, axis=1))
    else:
        args, build, tol = (x, wt, bs), build_layer_norm, (1e-4, 1e-4)
        xla = jax.jit(lambda a, w, b: (a - jnp.mean(a, axis=1, keepdims=True))
                      * lax.rsqrt(jnp.var(a, axis=1, keepdims=True) + 1e-5) * w + b)  # fmt: skip
    ref, groups = xla(*args), {}
    if ctx.torch:
        targs, to = [ctx.tt(a) for a in args], ctx.torch.empty(shape, device="cuda")
    for w in (4, 8, 16):
        for im in ctx.impls:
            ctx.jax_cand(groups, im.name, f"{w}w", lambda: build(im, shape, w), args, ref, tol)
        if ctx.torch:
            if which == "softmax":
                k, a = ctx.ex["triton_softmax"].softmax_kernel, (targs[0], shape[1], to)
                kw = {"BLOCK_SIZE": shape[1]}
            else:
                k, a, kw = layer_norm_triton, (*targs, to, shape[1], 1e-5), {"BLOCK": shape[1]}
            launch = functools.partial(k[(shape[0],)], *a, **kw, num_warps=w)
            ctx.torch_cand(groups, "Triton (torch)", f"{w}w", launch, to, ref, tol)
    ctx.jax_cand(groups, "XLA", "", lambda: xla, args, ref, tol)
    copy = copy_runner(1 << (22 if ctx.small else 30))
    compare(ctx, f"{which} f32 {shape[0]}x{shape[1]}", groups, 2 * 4 * x.size, "TB/s", copy,
            [("JAX Pallas", 1.0), ("copy", 0.95)])  # fmt: skip


MM_CFGS = [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 128, 32, 4, 4)]


def sec_matmul(ctx):
    d = 512 if ctx.small else 8192
    a = jax.random.normal(jax.random.key(5), (d, d), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(6), (d, d), jnp.bfloat16)
    ref, groups, tol = jnp.dot(a, b, preferred_element_type=F32), {}, (1e-2, 1.0)
    if ctx.torch:
        ta, tb, tc = ctx.tt(a), ctx.tt(b), ctx.torch.empty_like(ctx.tt(a))
    for cfg in MM_CFGS:
        bm, bn, bk, w, s = cfg
        label = f"{bm}x{bn}x{bk}/{w}w/{s}s"
        for im in ctx.impls:
            ctx.jax_cand(groups, im.name, label, lambda: build_matmul(im, d, cfg), (a, b), ref, tol)
        # The same user kernel with a Hopper switch of plgpu.CompilerParams (a user's
        # own kernel gets Hopper's features too).
        # (warp_specialize=True is refused below sm_100 on Triton 3.6: it miscompiled on the H200.)
        ours = ctx.impls[0]
        ctx.jax_cand(
            groups, "ours+tma", label, lambda: build_matmul(ours, d, cfg, use_tma=True), (a, b), ref, tol
        )
        if ctx.torch:  # the autotuned kernel's own @triton.jit function, at this config
            kernel = ctx.ex["triton_matmul"].matmul_kernel.fn[(d // bm * (d // bn),)]
            launch = functools.partial(kernel, ta, tb, tc, d, d, d, d, 1, d, 1, d, 1, BLOCK_M=bm, BLOCK_N=bn,
                                       BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s)  # fmt: skip
            ctx.torch_cand(groups, "Triton (torch)", label, launch, tc, ref, tol)
    ctx.jax_cand(groups, "XLA", "", lambda: jax.jit(jnp.dot), (a, b), ref, tol)
    compare(ctx, f"matmul bf16 {d}^3", groups, 2 * d**3, "TFLOP/s", None,
            [("JAX Pallas", 1.0), ("Triton (torch)", 0.98)])  # fmt: skip


ATT_CFGS = [
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
]  # (block_q, block_k, warps, stages); 2nd = mha default


def sec_attention(ctx):
    shape = (2, 256, 2, 64) if ctx.small else (4, 4096, 32, 128)  # [batch, seq, heads, dim]
    B, S, H, D = shape
    q, k, v = (jax.random.normal(jax.random.key(7 + i), shape, jnp.bfloat16) for i in range(3))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as jatt
    except Exception as e:  # noqa: BLE001
        jatt = print(f"JAX Pallas mha unavailable: {e!r}")
    sub = lambda o: o[-1, :, :: H - 1]  # checked: last batch, first and last head
    tol, hi = (2e-2, 2e-2), lax.Precision.HIGHEST
    for causal in (False, True):
        print(f"  causal={causal}")
        qs, ks, vs = (sub(t).astype(F32) for t in (q, k, v))
        x = jnp.einsum("qhd,khd->hqk", qs, ks, precision=hi) * D**-0.5
        x = jnp.where(jnp.tril(jnp.ones((S, S), bool)), x, -jnp.inf) if causal else x
        ref, groups = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(x, axis=-1), vs, precision=hi), {}
        for cfg in ATT_CFGS:
            label = "{}x{}/{}w/{}s".format(*cfg)
            ctx.jax_cand(groups, "ours", label, lambda: build_attention(ctx.impls[0], shape, cfg, causal),
                         (q, k, v), ref, tol, sub)  # fmt: skip
            if jatt is not None:
                mha = lambda: jax.jit(functools.partial(jatt.mha, segment_ids=None, sm_scale=D**-0.5,
                    causal=causal, block_sizes=jatt.BlockSizes(block_q=cfg[0], block_k=cfg[1]), num_warps=cfg[2],
                    num_stages=cfg[3], interpret=ctx.small))  # fmt: skip
                ctx.jax_cand(groups, "JAX Pallas", label, mha, (q, k, v), ref, tol, sub)
        if len(ctx.impls) > 1:  # our kernel source through JAX Pallas (first config): compiler vs algorithm
            build = lambda: build_attention(ctx.impls[1], shape, ATT_CFGS[0], causal)
            label = "{}x{}/{}w/{}s".format(*ATT_CFGS[0])
            ctx.jax_cand(groups, "JAX-P our src", label, build, (q, k, v), ref, tol, sub)
        if ctx.torch:  # its layout is [batch, heads, seq, dim]
            tq, tk, tv = (ctx.tt(jnp.transpose(t, (0, 2, 1, 3))) for t in (q, k, v))
            to, kernel = ctx.torch.empty_like(tq), ctx.ex["triton_flash_attention"].attention_fwd_kernel
            launch = functools.partial(kernel[(S // 128, B * H)], tq, tk, tv, to, D**-0.5, S, HEAD_DIM=D,
                BLOCK_M=128, BLOCK_N=64, CAUSAL=causal, num_warps=8, num_stages=3)  # fmt: skip
            ctx.torch_cand(groups, "Triton (torch)", "128x64/8w/3s", launch, to, ref, tol,
                           lambda o: sub(o.permute(0, 2, 1, 3)))  # fmt: skip
        xla = lambda: jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal))
        ctx.jax_cand(groups, "XLA", "", xla, (q, k, v), ref, tol, sub)
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        compare(ctx, f"attention fwd bf16 B{B} H{H} S{S} D{D} causal={causal}", groups, flops, "TFLOP/s",
                None, [("JAX Pallas", 1.0)])  # fmt: skip


SECTIONS = {"copy": sec_copy, "add": sec_add, "softmax": functools.partial(sec_rows, which="softmax"),
            "layer_norm": functools.partial(sec_rows, which="layer_norm"), "matmul": sec_matmul,
            "attention": sec_attention}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes, interpret mode, no timing/torch")
    ap.add_argument("--time", action="store_true", help="with --small: time anyway (tests this script)")
    ap.add_argument("--only", action="append", choices=sorted(SECTIONS), help="run only these sections")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, triton {triton.__version__}, device {jax.devices()[0]}", flush=True)
    ctx, failed = Ctx(args.small), []
    ctx.timed = not args.small or args.time
    for name in args.only or SECTIONS:
        print(f"\n== {name} ({time.strftime('%H:%M:%S')})", flush=True)
        try:
            SECTIONS[name](ctx)
        except Exception:  # noqa: BLE001
            failed.append(name)
            traceback.print_exc()
            print(f"section {name}: ERROR (above)", flush=True)
    if ctx.summary:
        print("\nSummary (figures in TB/s or TFLOP/s; ratios are ours / reference)")
        for row in ctx.summary:
            cols = [c for c in row if c not in ("title", "ratios")]
            print(f"  {row['title']:44s} " + "  ".join(f"{c} {row[c]:.2f}" for c in cols))
            print(f"  {'':44s} " + "  ".join(_fmt_ratio(*x) for x in row["ratios"]))
    print(f"\nsections with errors: {failed or 'none'}; failed checks: {ctx.fails or 'none'}")
    sys.exit(1 if failed or ctx.fails else 0)


if __name__ == "__main__":
    main()
