"""Proves a refactor of ``pallas_tpu.ops`` changes no kernel: hashes the Mosaic module text (and
the custom call's config) of every kernel of each ops family's representative calls, lowered (not
compiled) for compile-only TPUs of several generations.

Usage (needs libtpu for the compile-only devices)::

    python scripts/ops_mlir_hash.py before.json [NAMES] [CHIPS]   # on the commit before the change
    python scripts/ops_mlir_hash.py after.json  [NAMES] [CHIPS]   # after it

or ``python scripts/ops_mlir_hash.py --compare before.json after.json``: each case whose digests
differ is printed, then the counts; a refactor that changes no kernel reports 0 differ and 0
errors. ``NAMES``: comma-separated substrings of the case names to run (e.g. ``flash,splash``;
default all); ``CHIPS``: comma-separated generations (default ``v5e,v6e,v5p,v4``). Prints one
line per (case, chip): each kernel's name, the sha256 prefix of its text and the text's length.
"""

import hashlib
import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.simplefilter("ignore")
import importlib  # noqa: E402

from pallas_tpu._src.mosaic import compile_check as cc  # noqa: E402
from pallas_tpu.ops import all_gather as ag  # noqa: E402
from pallas_tpu.ops import matmul as mm  # noqa: E402
from pallas_tpu.ops import megablox  # noqa: E402

gm = importlib.import_module("pallas_tpu.ops.megablox.gmm")
from pallas_tpu.ops.paged_attention import paged_attention  # noqa: E402
from pallas_tpu.ops.paged_attention import quantization_utils as qu  # noqa: E402
from pallas_tpu.ops.ragged_paged_attention import kernel as rk  # noqa: E402
from pallas_tpu.ops.ragged_paged_attention import v3  # noqa: E402
from pallas_tpu.ops.random import philox, threefry  # noqa: E402

S = jax.ShapeDtypeStruct
BF, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
CHIPS = ("v5e", "v6e", "v5p", "v4")


def cases():
    yield "matmul bf16 512x1024x768", lambda x, y: mm.matmul(x, y), (S((512, 1024), BF), S((1024, 768), BF))
    yield "matmul f32 8192^2", lambda x, y: mm.matmul(x, y), (S((2048, 8192), F32), S((8192, 4096), F32))
    yield "matmul bf16 8192^3", lambda x, y: mm.matmul(x, y), (S((8192, 8192), BF), S((8192, 8192), BF))
    yield (
        "matmul int8->int32",
        lambda x, y: mm.matmul(x, y, out_dtype=jnp.int32),
        (S((256, 512), jnp.int8), S((512, 384), jnp.int8)),
    )
    yield (
        "matmul f32 padded blocks given",
        lambda x, y: mm.matmul(x, y, block_shape=(128, 128), block_k=128),
        (S((256, 384), F32), S((384, 256), F32)),
    )
    yield "matmul f32 odd", lambda x, y: mm.matmul(x, y), (S((300, 2200), F32), S((2200, 130), F32))
    yield (
        "gmm bf16",
        lambda l, r, s: gm.gmm(l, r, s),
        (S((1024, 256), BF), S((4, 256, 384), BF), S((4,), I32)),
    )
    yield (
        "gmm large",
        lambda l, r, s: gm.gmm(l, r, s, jnp.bfloat16),
        (S((8192, 2048), BF), S((8, 2048, 2048), BF), S((8,), I32)),
    )
    yield (
        "gmm f32 ktail transpose existing",
        lambda l, r, s, o, e: gm.gmm(l, r, s, F32, (128, 128, 128), o, e, transpose_rhs=True),
        (S((512, 300), F32), S((3, 256, 300), F32), S((6,), I32), S((), I32), S((512, 256), F32)),
    )
    yield "tgmm", lambda l, r, s: gm.tgmm(l, r, s), (S((256, 1024), BF), S((1024, 384), BF), S((4,), I32))
    yield (
        "tgmm existing offset",
        lambda l, r, s, o, e: gm.tgmm(l, r, s, F32, None, o, 2, e),
        (S((256, 512), F32), S((512, 128), F32), S((4,), I32), S((), I32), S((2, 256, 128), F32)),
    )

    def gmm_grad(l, r, s):
        return jax.grad(lambda l, r: megablox.gmm(l, r, s).astype(F32).sum(), argnums=(0, 1))(l, r)

    yield "megablox.gmm vjp", gmm_grad, (S((512, 256), BF), S((4, 256, 256), BF), S((4,), I32))

    def paged(q, k, v, lens, idx, **kw):
        return paged_attention(q, k, v, lens, idx, **kw)

    pa_args = (
        S((4, 8, 128), BF),
        S((2, 64, 16, 128), BF),
        S((2, 64, 16, 128), BF),
        S((4,), I32),
        S((4, 16), I32),
    )
    yield "paged bf16", paged, pa_args
    yield (
        "paged megacore batch softcap ppcb",
        lambda *a: paged(*a, megacore_mode="batch", attn_logits_soft_cap=30.0, pages_per_compute_block=4),
        pa_args,
    )
    yield (
        "paged pages of 64",
        paged,
        (
            S((8, 32, 128), BF),
            S((8, 512, 64, 128), BF),
            S((8, 512, 64, 128), BF),
            S((8,), I32),
            S((8, 512), I32),
        ),
    )

    def paged_q(q, kw, ks, vw, vs, lens, idx):
        return paged_attention(q, qu.QuantizedTensor(kw, ks), qu.QuantizedTensor(vw, vs), lens, idx)

    yield (
        "paged int8",
        paged_q,
        (
            S((4, 8, 128), F32),
            S((2, 64, 16, 128), jnp.int8),
            S((2, 64, 16, 1), F32),
            S((2, 64, 16, 128), jnp.int8),
            S((2, 64, 16, 1), F32),
            S((4,), I32),
            S((4, 16), I32),
        ),
    )

    def ragged(*a, **kw):
        return rk.ragged_paged_attention(*a, **kw)

    r_args = (
        S((64, 8, 128), BF),
        S((40, 16, 4, 128), BF),
        S((6,), I32),
        S((6, 8), I32),
        S((7,), I32),
        S((1,), I32),
    )
    yield "ragged bf16", ragged, r_args
    yield (
        "ragged window cap f32 blocks",
        lambda *a: ragged(
            *a,
            sm_scale=0.1,
            sliding_window=20,
            soft_cap=10.0,
            num_kv_pages_per_block=2,
            num_queries_per_block=32,
        ),
        (
            S((64, 6, 128), F32),
            S((40, 16, 4, 128), F32),
            S((6,), I32),
            S((6, 8), I32),
            S((7,), I32),
            S((1,), I32),
        ),
    )
    yield (
        "ragged fp8 kscale",
        lambda *a: ragged(*a, k_scale=0.5, v_scale=2.0),
        (
            S((64, 16, 128), BF),
            S((40, 16, 8, 128), jnp.float8_e4m3fn),
            S((6,), I32),
            S((6, 8), I32),
            S((7,), I32),
            S((1,), I32),
        ),
    )
    yield (
        "ragged many heads",
        ragged,
        (
            S((128, 32, 128), BF),
            S((40, 16, 16, 128), BF),
            S((6,), I32),
            S((6, 8), I32),
            S((7,), I32),
            S((1,), I32),
        ),
    )

    def v3call(q, k, v, cache, lens, idx, cu, dist, sink=None, **kw):
        return v3.ragged_paged_attention(q, k, v, cache, lens, idx, cu, dist, sink, **kw)

    shape = v3.get_kv_cache_shape(83, 8, 2, 128, jnp.bfloat16)
    v3_args = (
        S((48, 4, 128), BF),
        S((48, 2, 128), BF),
        S((48, 2, 128), BF),
        S(shape, BF),
        S((10,), I32),
        S((80,), I32),
        S((11,), I32),
        S((3,), I32),
    )
    yield "v3 bf16", v3call, v3_args
    yield (
        "v3 sink window qscale",
        lambda *a: v3call(
            *a, sliding_window=16, soft_cap=20.0, q_scale=0.5, k_scale=0.5, v_scale=1.5, out_dtype=F32
        ),
        (*v3_args, S((4,), F32)),
    )
    shape8 = v3.get_kv_cache_shape(83, 16, 4, 64, jnp.int8)
    yield (
        "v3 int8 narrow",
        v3call,
        (
            S((48, 8, 64), BF),
            S((48, 4, 64), BF),
            S((48, 4, 64), BF),
            S(shape8, jnp.int8),
            S((10,), I32),
            S((80,), I32),
            S((11,), I32),
            S((3,), I32),
        ),
    )

    yield from attention_cases()
    key = S((2,), jnp.uint32)
    yield "threefry bits", lambda k: threefry.plthreefry_random_bits(k, 32, (300, 500)), (key,)
    yield "threefry bits 3d 8bit", lambda k: threefry.plthreefry_random_bits(k, 8, (4, 16, 1024)), (key,)
    yield (
        "threefry count block",
        lambda k: threefry.threefry_2x32_count(k, (512, 512), (500, 512), (256, 256)),
        (key,),
    )
    yield (
        "threefry split fold",
        lambda k, d: (threefry.threefry_split(k, (7,)), threefry.threefry_fold_in(k, d)),
        (key, S((), jnp.uint32)),
    )
    yield "philox count", lambda k: philox.philox_4x32_count(k, (8192, 8192)), (key,)
    yield (
        "philox kernel",
        lambda k: philox.philox_4x32_kernel(k, (256, 256), (256, 256), (128, 128), 5, False),
        (key,),
    )


def _patched(module, name, value, fn):
    """``fn`` run with ``module.name`` set to ``value`` (a module constant such as a loop limit)."""

    def run(*args):
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args)
        finally:
            setattr(module, name, old)

    return run


def _grad3(f):
    return lambda *a: jax.grad(lambda *a: f(*a).astype(F32).sum(), argnums=(0, 1, 2))(*a)


def attention_cases():
    """flash_attention and splash attention: causal and not, segments, bias, soft cap, sinks,
    MHA/GQA/MQA, forward and backward (fused and with the separate dq kernel), wide heads,
    straight-line and looped steps (``STRAIGHT_LINE_SCORES``)."""
    from pallas_tpu.ops import flash_attention as fa
    from pallas_tpu.ops import splash_attention as sa
    from pallas_tpu.ops.flash_attention import _blocks as fa_blocks
    from pallas_tpu.ops.splash_attention import _common as sa_common

    q4 = S((1, 2, 1024, 128), BF)
    yield (
        "flash fwd causal",
        lambda q, k, v: fa.flash_attention(q, k, v, causal=True, sm_scale=0.1),
        (q4, q4, q4),
    )
    yield "flash fwd+bwd", _grad3(lambda q, k, v: fa.flash_attention(q, k, v)), (q4, q4, q4)
    seg4 = (S((1, 1024), I32), S((1, 1024), I32))
    ab4 = S((1, 2, 1024, 1024), F32)

    def flash_seg_bias(q, k, v, ab, sq, skv, causal):
        return fa.flash_attention(q, k, v, ab, fa.SegmentIds(sq, skv), causal=causal, sm_scale=0.5)

    yield (
        "flash fwd+bwd causal segments bias",
        lambda q, k, v, ab, sq, skv: _grad3(lambda q, k, v: flash_seg_bias(q, k, v, ab, sq, skv, True))(
            q, k, v
        ),
        (q4, q4, q4, ab4, *seg4),
    )
    yield (
        "flash fwd+bwd segments",
        lambda q, k, v, sq, skv: _grad3(
            lambda q, k, v: fa.flash_attention(q, k, v, None, fa.SegmentIds(sq, skv))
        )(q, k, v),
        (q4, q4, q4, *seg4),
    )
    q4f = S((2, 2, 512, 64), F32)
    yield (
        "flash fwd+bwd f32 bias causal",
        lambda q, k, v, ab: _grad3(lambda q, k, v: fa.flash_attention(q, k, v, ab, causal=True))(q, k, v),
        (q4f, q4f, q4f, S((2, 2, 512, 512), F32)),
    )
    qw = S((1, 2, 2048, 256), BF)
    kw = S((1, 2, 4096, 256), BF)
    yield (
        "flash fwd+bwd causal D256 kv longer",
        _grad3(lambda q, k, v: fa.flash_attention(q, k, v, causal=True)),
        (qw, kw, kw),
    )
    qlong = S((1, 1, 32768, 256), BF)
    yield (
        "flash fwd+bwd separate dq",
        _grad3(lambda q, k, v: fa.flash_attention(q, k, v)),
        (qlong, qlong, qlong),
    )
    blocks = fa.BlockSizes(
        block_q=256,
        block_k_major=512,
        block_k=256,
        block_b=1,
        block_q_major_dkv=512,
        block_k_major_dkv=256,
        block_k_dkv=128,
        block_q_dkv=256,
        block_k_major_dq=512,
        block_k_dq=256,
        block_q_dq=256,
    )
    yield (
        "flash fwd+bwd causal given blocks",
        _grad3(lambda q, k, v: fa.flash_attention(q, k, v, causal=True, block_sizes=blocks)),
        (q4, q4, q4),
    )
    q8 = S((1, 2, 4096, 128), BF)
    yield (
        "flash fwd+bwd causal looped",
        _patched(
            fa_blocks,
            "STRAIGHT_LINE_SCORES",
            1 << 20,
            _grad3(lambda q, k, v: fa.flash_attention(q, k, v, causal=True)),
        ),
        (q8, q8, q8),
    )
    yield (
        "flash fwd+bwd looped",
        _patched(
            fa_blocks, "STRAIGHT_LINE_SCORES", 1 << 20, _grad3(lambda q, k, v: fa.flash_attention(q, k, v))
        ),
        (q8, q8, q8),
    )

    def splash(q, k, v):
        mask = sa.MultiHeadMask([sa.CausalMask((1024, 1024))] * 2)
        kern = sa.make_splash_mha_single_device(mask)
        return jax.grad(lambda q, k, v: kern(q, k, v).astype(F32).sum(), argnums=(0, 1, 2))(q, k, v)

    q3 = S((2, 1024, 128), BF)
    yield "splash causal fwd+bwd", splash, (q3, q3, q3)

    def splash_call(mask, heads, kw, *, mqa=False, grad=True, sinks=False, segments=False):
        make = sa.make_splash_mqa_single_device if mqa else sa.make_splash_mha_single_device
        kern = make(sa.MultiHeadMask([mask] * heads), **kw)

        def call(q, k, v, *extra):
            extra = list(extra)
            seg = sa.SegmentIds(extra.pop(0), extra.pop(0)) if segments else None
            sink = extra.pop(0) if sinks else None
            if not grad:
                return kern(q, k, v, segment_ids=seg, sinks=sink)
            return _grad3(lambda q, k, v: kern(q, k, v, segment_ids=seg, sinks=sink))(q, k, v)

        return call

    L = 2048
    qs, ks = S((4, L, 128), BF), S((2, L, 128), BF)
    segs = (S((L,), I32), S((L,), I32))
    yield "splash fwd only full", splash_call(sa.FullMask((L, L)), 4, {}, grad=False), (qs, qs, qs)
    yield (
        "splash fwd residuals local",
        splash_call(sa.LocalMask((L, L), (256, 128), 0), 4, {"save_residuals": True}, grad=False),
        (qs, qs, qs),
    )
    yield (
        "splash GQA causal segments softcap",
        splash_call(sa.CausalMask((L, L)), 4, {"attn_logits_soft_cap": 30.0}, segments=True),
        (qs, ks, ks, *segs),
    )
    yield (
        "splash MQA causal segments sinks",
        splash_call(sa.CausalMask((L, L)), 4, {}, mqa=True, segments=True, sinks=True),
        (qs, S((L, 128), BF), S((L, 128), BF), *segs, S((4,), F32)),
    )
    yield (
        "splash MHA f32 D64 separate dq",
        splash_call(
            sa.CausalMask((1024, 1024)),
            2,
            {
                "block_sizes": sa.BlockSizes(
                    block_q=512,
                    block_kv=512,
                    block_kv_compute=256,
                    block_q_dkv=512,
                    block_kv_dkv=512,
                    block_kv_dkv_compute=256,
                    block_q_dq=512,
                    block_kv_dq=512,
                    use_fused_bwd_kernel=False,
                )
            },
        ),
        (S((2, 1024, 64), F32), S((2, 1024, 64), F32), S((2, 1024, 64), F32)),
    )
    big = sa.BlockSizes(
        block_q=2048,
        block_kv=2048,
        block_kv_compute=512,
        block_q_dkv=2048,
        block_kv_dkv=2048,
        block_kv_dkv_compute=512,
        use_fused_bwd_kernel=True,
    )
    q16 = S((2, 4096, 128), BF)
    yield (
        "splash causal bwd loops",
        splash_call(sa.CausalMask((4096, 4096)), 2, {"block_sizes": big}),
        (q16, q16, q16),
    )
    yield (
        "splash causal fwd loops",
        _patched(
            sa_common,
            "STRAIGHT_LINE_SCORES",
            {"fwd": 1 << 20, "bwd": 1 << 20},
            splash_call(sa.CausalMask((4096, 4096)), 2, {}, grad=False),
        ),
        (q16, q16, q16),
    )
    rng = np.random.default_rng(0)
    random_mask = sa.NumpyMask(rng.random((1024, 1024)) < 0.5)
    yield "splash numpy mask (loaded partial blocks)", splash_call(random_mask, 2, {}), (q3, q3, q3)
    yield (
        "splash chunked causal segments",
        splash_call(sa.ChunkedCausalMask((L, L), 512), 4, {}, segments=True),
        (qs, qs, qs, *segs),
    )


def ag_cases(chip):
    devs = cc.tpu_devices(chip)
    for n, memory_space, shape in ((4, None, (64, 128)), (4, "any", (4, 1000, 256)), (2, None, (6, 256))):
        mesh = jax.sharding.Mesh(np.array(devs[:n]), ("x",))
        import pallas as pl
        import pallas_tpu as pltpu

        ms = pl.ANY if memory_space == "any" else pltpu.VMEM
        placed = S(shape, F32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
        yield (
            f"all_gather {n} {memory_space} {shape}",
            (lambda a, mesh=mesh, ms=ms: ag.all_gather(a, mesh=mesh, axis_name="x", memory_space=ms)),
            (placed,),
        )


from pallas_tpu._src import pallas_call_registration as _pcr  # noqa: E402

CONFIGS = []
_orig_config = _pcr._custom_call_config


def _recording_config(*a, **k):
    c = _orig_config(*a, **k)
    CONFIGS.append(repr(sorted(c.items())))
    return c


_pcr._custom_call_config = _recording_config


def compare(before: str, after: str) -> int:
    """Prints the cases of ``after`` whose digests differ from ``before``'s, then the counts;
    returns 1 if any differ or failed, else 0."""
    with open(before) as f:
        a = json.load(f)
    with open(after) as f:
        b = json.load(f)
    bad = [k for k in sorted(b) if a.get(k) != b.get(k)]
    for k in bad:
        print("DIFF", k, str(b.get(k))[:300])
    errors = sum("ERROR" in str(v) for v in b.values())
    print(f"{len(b)} cases compared, {len(bad)} differ; errors: {errors}")
    return 1 if bad or errors else 0


def main():
    out = {}
    if len(sys.argv) > 1 and sys.argv[1] == "--compare":
        return compare(sys.argv[2], sys.argv[3])
    only = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else None
    chips = sys.argv[3].split(",") if len(sys.argv) > 3 else CHIPS
    for chip in chips:
        todo = list(cases()) + list(ag_cases(chip))
        for name, fn, args in todo:
            if only and not any(o in name for o in only):
                continue
            try:
                CONFIGS.clear()
                kernels = cc._kernels_of(fn, args, {}, chip)
                assert len(CONFIGS) == len(kernels), (len(CONFIGS), len(kernels))
                digests = [
                    (k.split(" at ")[0][:40], hashlib.sha256((t + c).encode()).hexdigest()[:16], len(t))
                    for (k, t, _), c in zip(kernels, CONFIGS)
                ]
            except Exception as e:  # noqa: BLE001
                digests = [("ERROR", f"{type(e).__name__}: {str(e)[:200]}", 0)]
            out[f"{name} @ {chip}"] = digests
            print(f"{name} @ {chip}: {digests}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
