"""pallas-gpu's Hopper flash-attention forward, written in Gluon (Triton 3.6's
``triton.experimental.gluon``; ``pallas_gpu.ops._attention_sm90_kernel``, the
kernel ``pallas_gpu.ops.attention`` launches on sm_90), launched directly from
torch over its schedule parameters, beside torch's cuDNN SDPA, each checked
against it (the aim: the attention forward at cuDNN's speed). GPU, needs torch. The benchmark imports the
product kernel and parametrizes it; it keeps no copy of it.

The kernel is FlashAttention-3's schedule, which plain Triton cannot express
(its software pipeliner waits for every ``Q @ K^T`` wgmma before the softmax,
so the exponentials never overlap the tensor cores: ``ops.attention``'s Triton
forward runs its tensor pipe 53 % busy against cuDNN's 75 %,
``results/ncu_attention_fwd.txt``): a one-warp TMA producer partition fills an
``NBUF``-deep ring of K/V slots, and two math warpgroups, partitions of their
own, take turns issuing their wgmmas (ping-pong), so one's softmax overlaps the
other's products; no wgmma stays in flight across the loop's back edge (when
one did, ptxas serialized every wgmma, C7514, which ``--compile`` reports).
The launches (``--kernel``):

* ``pp``: a program per 128-row Q tile;
* ``ppp``: persistent, one program per multiprocessor walking the tiles;
* ``pps``: persistent, heads in groups of about one wave, heaviest causal
  tiles first, in snake order (what ``ops.attention`` launches for causal).

``--config`` picks (block_m, block_n, NBUF); block_m is the kernel's 128.
H200, B4 S4096 H32 D128, non-causal / causal TFLOP/s, 2026-12-02: pp 566.7 /
495.4, ppp 598.6 / 494.7 (0.996x / 0.945x cuDNN). The two earlier forms this
file also held, a kernel whose 8 math warps issued their own loads (465.7 /
420.0) and the same warp-specialized without ping-pong (482.8 / 440.3), are
in its git history (before the shared Triton layer became public).

    python benchmarks/gluon_attention.py             # GPU: check against torch's cuDNN SDPA, time both
    python benchmarks/gluon_attention.py --kernel=pp --config=0   # one launch (a process each: a hang stays local)
    python benchmarks/gluon_attention.py --kernel=ppp --seq=1024  # seq 1024 at 16384 tokens (batch 16)
    python benchmarks/gluon_attention.py --compile   # no GPU: compile for sm_90; registers, spills, wgmma waits,
                                                     # setmaxnreg, and whether ptxas serialized the wgmmas
"""

from __future__ import annotations

import sys

import triton

from pallas_gpu.ops._attention_sm90 import BLOCK_Q, head_group
from pallas_gpu.ops._attention_sm90_kernel import mha_forward_sm90

CONFIGS = [(128, 2), (128, 3), (64, 4), (64, 6)]  # block_n, NBUF (block_m is the kernel's BLOCK_Q)
# The product kernel's launches: a program per tile, persistent, persistent in snake order.
KERNELS = ("pp", "ppp", "pps")
NUM_WARPS = 4  # the first math warpgroup's (the partitions bring their own)


def _launches(argv):
    """(launch, (block_n, NBUF)) pairs asked on the command line (``--kernel=pp|ppp|pps``,
    ``--config=i``), every pair by default."""
    kernels = [a.split("=")[1] for a in argv if a.startswith("--kernel=")] or list(KERNELS)
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        sys.exit(f"--kernel: {sorted(unknown)} unknown; the launches are {KERNELS}")
    configs = [CONFIGS[int(a.split("=")[1])] for a in argv if a.startswith("--config=")] or CONFIGS
    return [(k, c) for k in kernels for c in configs]


def _label(name, causal, bn, nbuf):
    return f"{name} causal={causal} {(BLOCK_Q, bn, nbuf)}"


def compile_only(argv) -> None:
    """Compiles every launch for sm_90 (no GPU) and prints registers, spills and shared memory."""
    from _gluon import compile_report

    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "sm_scale": "fp32"}
    for causal in (False, True):
        for name, (bn, nbuf) in _launches(argv):
            gh = head_group(128, 32, 132) if name == "pps" else 0
            consts = dict(B=4, T=4096, S=4096, H=32, D=128, BN=bn, NBUF=nbuf, CAUSAL=causal, GH=gh)
            compile_report(mha_forward_sm90, sig, consts, NUM_WARPS, _label(name, causal, bn, nbuf))


def main(argv) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    S = next((int(a.split("=")[1]) for a in argv if a.startswith("--seq=")), 4096)
    B, H, D = max(1, 16384 // S), 32, 128  # 16384 tokens, as gpu_attention.py's sweep
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(
        f"attention forward bf16 B{B} S{S} H{H} D{D}; triton {triton.__version__}, {torch.cuda.get_device_name()}"
    )
    for causal in (False, True):
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa = lambda: F.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal
            )  # noqa: E731
            ref = sdpa().transpose(1, 2).float()
            ms = triton.testing.do_bench(sdpa, warmup=50, rep=300)
        cudnn = flops / ms * 1e-9
        print(f"causal={causal} cuDNN (torch SDPA): {ms:.3f} ms, {cudnn:.1f} TFLOP/s")
        for name, (bn, nbuf) in _launches(argv):
            o = torch.empty_like(q)
            lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)

            def go(o=o, lse=lse, name=name, bn=bn, nbuf=nbuf, causal=causal):
                tiles = B * H * (S // BLOCK_Q)
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                gh = head_group(B * H, S // BLOCK_Q, sms) if name == "pps" else 0
                grid = (tiles,) if name == "pp" else (min(tiles, sms),)
                mha_forward_sm90[grid](
                    q, k, v, o, lse, D**-0.5, B, S, S, H, D, bn, nbuf, causal, gh, num_warps=NUM_WARPS
                )
                return o

            label = _label(name, causal, bn, nbuf)
            try:
                err = (go().float() - ref).abs().max().item()
                ms = triton.testing.do_bench(go, warmup=50, rep=300)
            except Exception as e:  # noqa: BLE001
                print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            tf = flops / ms * 1e-9
            print(
                f"{label}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({tf / cudnn:.3f}x cuDNN), max error {err:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    compile_only(sys.argv[1:]) if "--compile" in sys.argv else main(sys.argv[1:])
