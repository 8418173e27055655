"""The dk/dv kernel of ``pallas_gpu.ops.attention`` at 1, 2 and 3 pipeline
stages (GPU): the relative error of dq, dk, dv against an f32 reference at
two launches (the 32x128, 8-warp one that Triton 3.6 miscompiled with more
than one stage, and the default), and the fwd+bwd TFLOP/s of the defaults at
B4 S4096 H32 D128 causal. This is where ``attention._DKV_PIPELINED`` comes from.

The stage count is forced by wrapping ``attention.call_params`` (the dk/dv
kernel is the only caller that asks for 1 stage), so the kernels run exactly
as ``mha`` builds them.

    python benchmarks/attention_dkv_stages.py   # on the GPU
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from _timing import measure

from pallas_gpu.ops import attention

F32 = jnp.float32
STAGES = [1]
_call_params = attention.call_params


def _forced(interpret, num_warps, num_stages):
    return _call_params(interpret, num_warps, STAGES[0] if num_stages == 1 else num_stages)


def vjp(f, q, k, v, do):
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(do)


def operands(shape, seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(kk, shape, F32).astype(jnp.bfloat16) for kk in keys]


def mha(causal, blocks, warps):
    return lambda q, k, v: attention.mha(
        q, k, v, None, sm_scale=128**-0.5, causal=causal, block_sizes=blocks, num_warps=warps
    )


def main() -> None:
    attention.call_params = _forced
    fa2 = attention.BlockSizes(128, 64, block_q_dkv=32, block_kv_dkv=128, block_q_dq=128, block_kv_dq=32)
    up = lambda a: a.astype(F32)  # noqa: E731
    for name, shape, blocks, warps, causal in [
        ("32x128/8w", (1, 1024, 4, 128), fa2, 8, False),
        ("defaults, causal", (2, 2048, 4, 128), None, None, True),
        ("defaults", (2, 2048, 4, 128), None, None, False),
    ]:
        q, k, v, do = operands(shape, 1)
        ref = lambda q, k, v, c=causal: attention.mha_reference(  # noqa: E731
            up(q), up(k), up(v), None, sm_scale=128**-0.5, causal=c
        )
        with jax.default_matmul_precision("highest"):
            _, want = jax.jit(functools.partial(vjp, ref))(q, k, v, up(do))
        for s in (1, 2, 3):
            STAGES[0] = s
            _, got = jax.jit(functools.partial(vjp, mha(causal, blocks, warps)))(q, k, v, do)
            errs = [float(jnp.max(jnp.abs(up(g) - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want)]
            print(
                f"{name} dk/dv stages={s}: relative error dq {errs[0]:.4f} dk {errs[1]:.4f} dv {errs[2]:.4f}"
            )
    q, k, v, do = operands((4, 4096, 32, 128), 2)
    flops = 3.5 * 4 * 4 * 32 * 4096 * 4096 * 128 * 0.5
    runs = {}
    for s in (1, 2, 3):
        STAGES[0] = s
        g = jax.jit(functools.partial(vjp, mha(True, None, None)))
        runs[f"stages={s}"] = (functools.partial(g, q, k, v, do), jax.block_until_ready)
        jax.block_until_ready(runs[f"stages={s}"][0]())  # compile with this stage count now
    t = measure(runs, rounds=5, min_round_s=0.1)
    print(
        "fwd+bwd causal B4 S4096 H32 D128: "
        + " | ".join(f"{n} {flops / x / 1e12:.1f} TFLOP/s" for n, x in t.items())
    )


if __name__ == "__main__":
    main()
