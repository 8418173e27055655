"""Kernel speed on the GPU: each example kernel through jax_triton.triton_call
vs the same @triton.jit kernel at the same config launched from torch, plus XLA, in one run.

Prints one line per kernel with times, throughput and the ratio
(torch time / triton_call time; >= 0.98 is the target). Needs torch.

Method: every output is checked first. Then the candidates of a kernel are timed together in
5 interleaved rounds (the order alternates each round); a round is N back-to-back calls
(N chosen for >= 50 ms) ended by one sync; figures are the medians over rounds. The matmul is
compared config by config (same tile config on both sides) and as best-of-configs per side;
the autotuned triton_call (what users call) is shown beside with the config it chose.
"""

import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import jax
import jax.numpy as jnp
import torch
import triton
import triton_add
import triton_flash_attention as fa
import triton_matmul
import triton_softmax
from _timing import measure

import jax_triton as jt

FAILED = []


def jx(f, *args):
    return (lambda: f(*args)), jax.block_until_ready


def th(launch):
    return launch, (lambda _: torch.cuda.synchronize())


def check(label, out, ref, rtol, atol):
    """Compares on the device (torch tensors against the JAX reference through DLPack)."""
    if isinstance(out, torch.Tensor):
        torch.cuda.synchronize()
        o, r = out.float(), torch.from_dlpack(ref).float()
        d = (o - r).abs()
        ok, err = bool((d <= atol + rtol * r.abs()).all()), float(d.max())
    else:
        o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
        d = jnp.abs(o - r)
        ok, err = bool(jnp.all(d <= atol + rtol * jnp.abs(r))), float(jnp.max(d))
    print(f"  check {label:40s} {'PASS' if ok else 'FAIL'}  max_abs_err={err:.2e}", flush=True)
    if not ok:
        FAILED.append(label)
    return ok


def report(name, unit, work, t_jt, t_torch, t_xla):
    xla = f"xla {t_xla * 1e3:8.3f} ms ({work / t_xla / 1e12:7.2f})  " if t_xla else ""
    xla_ratio = f"  xla/triton_call = {t_xla / t_jt:.3f}" if t_xla else ""
    print(
        f"{name:28s} triton_call {t_jt * 1e3:8.3f} ms ({work / t_jt / 1e12:7.2f} {unit})  "
        f"torch-launch {t_torch * 1e3:8.3f} ms ({work / t_torch / 1e12:7.2f})  {xla}"
        f"ratio torch/triton_call = {t_torch / t_jt:.3f}{xla_ratio}",
        flush=True,
    )


def tt(x):
    return torch.from_dlpack(x)


def bench_add():
    n = 1 << 28
    x = jax.random.normal(jax.random.key(0), (n,))
    y = jax.random.normal(jax.random.key(1), (n,))
    add = jax.jit(lambda a, b: triton_add.add(a, b, block_size=1024))  # num_warps 4 (default) both sides
    tx, ty = tt(x), tt(y)
    to = torch.empty_like(tx)
    launch = lambda: triton_add.add_kernel[(triton.cdiv(n, 1024),)](tx, ty, n, to, BLOCK_SIZE=1024)
    launch()
    ref = x + y
    check("add triton_call", add(x, y), ref, 0, 0)
    check("add torch launch", to, ref, 0, 0)
    t = measure({"jt": jx(add, x, y), "torch": th(launch), "xla": jx(jax.jit(jnp.add), x, y)})
    report("add f32 2^28", "TB/s", 3 * 4 * n, t["jt"], t["torch"], t["xla"])


def bench_softmax():
    s = jax.random.normal(jax.random.key(2), (16384, 8192))
    sm = jax.jit(triton_softmax.softmax)  # BLOCK_SIZE 8192, num_warps 8
    xla = jax.jit(lambda v: jax.nn.softmax(v, -1))
    ts = tt(s)
    tso = torch.empty_like(ts)
    launch = lambda: triton_softmax.softmax_kernel[(16384,)](ts, 8192, tso, BLOCK_SIZE=8192, num_warps=8)
    launch()
    ref = xla(s)
    check("softmax triton_call", sm(s), ref, 1e-4, 1e-6)
    check("softmax torch launch", tso, ref, 1e-4, 1e-6)
    t = measure({"jt": jx(sm, s), "torch": th(launch), "xla": jx(xla, s)})
    report("softmax f32 16384x8192", "TB/s", 2 * 4 * s.size, t["jt"], t["torch"], t["xla"])


def bench_matmul():
    m = 8192
    a = jax.random.normal(jax.random.key(3), (m, m)).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(4), (m, m)).astype(jnp.bfloat16)
    ref = jnp.dot(a, b, preferred_element_type=jnp.float32)
    ta, tb = tt(a), tt(b)
    tc = torch.empty_like(ta)
    strides = dict(stride_am=m, stride_ak=1, stride_bk=m, stride_bn=1, stride_cm=m, stride_cn=1)
    cands = {}
    auto = jax.jit(triton_matmul.matmul)  # triton.autotune: the runtime times the configs on first call
    if check("matmul triton_call autotuned", auto(a, b), ref, 1e-2, 1.0):
        cands["jt auto"] = jx(auto, a, b)
    labels = []
    for cfg, label in zip(triton_matmul.CONFIGS, labels_all()):
        kw, opts = cfg.kwargs, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        grid = (triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(m, kw["BLOCK_N"]),)
        fixed = jax.jit(
            lambda p, q, kw=kw, opts=opts, grid=grid: jt.triton_call(
                p, q, kernel=triton_matmul.matmul_kernel.fn,
                out_shape=jax.ShapeDtypeStruct((m, m), p.dtype), grid=grid,
                M=m, N=m, K=m, **strides, **kw, **opts,
            )
        )  # fmt: skip

        def launch(kw=kw, opts=opts, grid=grid):
            triton_matmul.matmul_kernel.fn[grid](ta, tb, tc, m, m, m, m, 1, m, 1, m, 1, **kw, **opts)

        launch()
        ok = check(f"matmul triton_call {label}", fixed(a, b), ref, 1e-2, 1.0)
        if check(f"matmul torch launch {label}", tc, ref, 1e-2, 1.0) and ok:
            cands[f"jt {label}"], cands[f"torch {label}"] = jx(fixed, a, b), th(launch)
            labels.append(label)
    xla = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16))
    cands["xla"] = jx(xla, a, b)
    t = measure(cands)
    fl = 2 * m**3
    for label in labels:
        jt_t, th_t = t[f"jt {label}"], t[f"torch {label}"]
        print(
            f"  config {label:22s} triton_call {fl / jt_t / 1e12:6.1f}  torch-launch {fl / th_t / 1e12:6.1f} "
            f"TFLOP/s  ratio torch/triton_call = {th_t / jt_t:.3f}"
        )
    if not labels:
        raise RuntimeError("no matmul config passed its check on both sides")
    best_jt = min(labels, key=lambda lb: t[f"jt {lb}"])
    best_th = min(labels, key=lambda lb: t[f"torch {lb}"])
    print(f"  best config: triton_call {best_jt}, torch-launch {best_th}")
    report("matmul bf16 8192^3 best-cfg", "TFLOP/s", fl, t[f"jt {best_jt}"], t[f"torch {best_th}"], t["xla"])
    if "jt auto" in t:
        rec = [r for r in jkr_records() if len(r[3]) == len(triton_matmul.CONFIGS)]
        if rec:
            print(f"  autotuned triton_call chose {labels_all()[rec[-1][2]]}")
        report("matmul bf16 8192^3 autotuned", "TFLOP/s", fl, t["jt auto"], t[f"torch {best_th}"], t["xla"])


def labels_all():
    return [
        f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}/{c.num_warps}w/{c.num_stages}s"
        for c in triton_matmul.CONFIGS
    ]


def jkr_records():
    import jax_kernel_runtime as jkr

    return jkr.tune_records()


def bench_attention():
    B, H, S, D = 4, 32, 4096, 128
    q, k, v = (jax.random.normal(jax.random.key(5 + i), (B, H, S, D)).astype(jnp.bfloat16) for i in range(3))
    tq, tk, tv = tt(q), tt(k), tt(v)
    tout = torch.empty_like(tq)
    qt, kt, vt = (jnp.transpose(x, (0, 2, 1, 3)) for x in (q, k, v))  # [B, S, H, D] for XLA
    sub = lambda o: o[-1, :: H - 1]  # checked part: last batch, first and last head
    for causal in (False, True):
        att = jax.jit(lambda q, k, v, c=causal: fa.attention(q, k, v, causal=c))  # 128x64, 8 warps, 3 stages

        def launch(c=causal):
            fa.attention_fwd_kernel[(S // 128, B * H)](tq, tk, tv, tout, D**-0.5, S, HEAD_DIM=D, BLOCK_M=128,
                                                       BLOCK_N=64, CAUSAL=c, num_warps=8, num_stages=3)  # fmt: skip

        launch()
        ref = fa.reference(sub(q)[None], sub(k)[None], sub(v)[None], causal)[0]
        check(f"attention causal={causal} triton_call", sub(att(q, k, v)), ref, 2e-2, 2e-2)
        check(f"attention causal={causal} torch launch", sub(tout), ref, 2e-2, 2e-2)
        cands = {"jt": jx(att, q, k, v), "torch": th(launch)}
        try:
            xla = jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(q, k, v, is_causal=c))
            jax.block_until_ready(xla(qt, kt, vt))
            cands["xla"] = jx(xla, qt, kt, vt)
        except Exception as e:  # noqa: BLE001
            print(f"  XLA dot_product_attention failed: {e!r}")
        t = measure(cands)
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        report(f"attention fwd causal={causal}", "TFLOP/s", flops, t["jt"], t["torch"], t.get("xla"))


def main():
    print(
        f"jax {jax.__version__}, triton {triton.__version__}, torch {torch.__version__}, {jax.devices()[0]}"
    )
    errors = []
    for bench in (bench_add, bench_softmax, bench_matmul, bench_attention):
        try:
            bench()
        except Exception:  # noqa: BLE001
            errors.append(bench.__name__)
            traceback.print_exc()
            print(f"{bench.__name__}: ERROR (above)", flush=True)
    print("autotune records (tune_key[:12], device, chosen, ms per config):")
    for key, device, chosen, times in jkr_records():
        print(f"  {key[:12]} dev{device} chose {chosen} times {[round(t, 3) for t in times]}")
    print(f"errors: {errors or 'none'}; failed checks: {FAILED or 'none'}")
    sys.exit(1 if errors or FAILED else 0)


if __name__ == "__main__":
    main()
