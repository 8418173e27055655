"""``pallas_tpu.ops.flash_attention`` on fresh random data, against a plain ``jnp`` attention (and
``jax.vjp`` of it for the gradients) and against JAX's own op run in JAX's TPU interpret mode.

The kernels run every TPU way (tests/ways): TPU interpret mode, our Mosaic lowering executed by
``run_mosaic`` (``mosaic``), and compiled by libtpu for compile-only TPUs (``compiled``). The
``jax_mosaic`` way runs JAX's op (``jax.experimental.pallas.ops.tpu.flash_attention``) lowered by JAX and
executed by ``run_mosaic``, beside ours on the same inputs. Shapes stay small (sequences of 256-512,
head_dim 128) so the suite fits a 2-core CI machine.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tpu as pltpu
from pallas_tpu._src.mosaic import compile_check
from pallas_tpu.ops import flash_attention as fa

jfa = pytest.importorskip("jax.experimental.pallas.ops.tpu.flash_attention")
from jax.experimental.pallas import tpu as jax_pltpu  # noqa: E402
from ways import Way, every_way  # noqa: E402
from ways.compiled import chip_mesh  # noqa: E402

needs_libtpu = pytest.mark.skipif(
    not compile_check.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]"'
)

jax.config.update("jax_enable_checks", True)

F32 = jnp.float32
BF16 = jnp.bfloat16
BLOCK_FIELDS = [f.name for f in dataclasses.fields(fa.BlockSizes)]


def rand(seed, shape, dtype=F32):
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def segments(seed, batch, length, pieces=3):
    """Sorted ids: ``pieces`` runs of random lengths per batch row (a packed sequence)."""
    cuts = jax.random.randint(jax.random.key(seed), (batch, length), 0, pieces)
    return jnp.sort(cuts, axis=1).astype(jnp.int32)


def attention(q, k, v, ab=None, segment_ids=None, *, causal=False, sm_scale=1.0):
    """softmax((q k^T + ab) * sm_scale, masked) v in float32 ``jnp``."""
    q, k, v = (x.astype(F32) for x in (q, k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest")
    if ab is not None:
        s = s + ab.astype(F32)
    s = s * sm_scale
    keep = jnp.ones(s.shape[-2:], bool)
    if causal:
        keep = jnp.arange(s.shape[-1])[None, :] <= jnp.arange(s.shape[-2])[:, None]
    keep = jnp.broadcast_to(keep, s.shape)
    if segment_ids is not None:
        keep = keep & (segment_ids.q[:, None, :, None] == segment_ids.kv[:, None, None, :])
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v, precision="highest")


def with_grads(f, q, k, v, ab, d_out):
    """``(out, dq, dk, dv[, dab])`` of ``f`` through ``jax.vjp``."""
    if ab is None:
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, None), q, k, v)
    else:
        out, vjp = jax.vjp(f, q, k, v, ab)
    return (out, *vjp(d_out))


def blocks(module, **sizes):
    """A ``BlockSizes`` of ``module`` (ours or JAX's), each size given or 128 (``block_b``: 1)."""
    return module.BlockSizes(
        **{name: sizes.get(name, 1 if name == "block_b" else 128) for name in BLOCK_FIELDS}
    )


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
    assert err <= tol, f"max |error| / max(1, max |want|) = {err:.3g} > {tol}"


def build_for(causal, sm_scale, sizes, grads, segment_ids=None, bias=False):
    """``build(pl, pltpu)``: our op (or, given JAX's namespaces, JAX's) over ``(q, k, v[, ab], do)``."""

    def build(pl, pltpu_ns):
        module = fa if pltpu_ns is pltpu else jfa
        seg = None if segment_ids is None else module.SegmentIds(*segment_ids)
        bs = None if sizes is None else blocks(module, **sizes)

        def op(q, k, v, ab):
            return module.flash_attention(q, k, v, ab, seg, causal=causal, sm_scale=sm_scale, block_sizes=bs)

        def f(q, k, v, *rest):
            ab = rest[0] if bias else None
            if not grads:
                return op(q, k, v, ab)
            return with_grads(op, q, k, v, ab, rest[-1])

        return f

    return build


def reference(args, causal, sm_scale, grads, segment_ids=None, bias=False):
    q, k, v, *rest = args
    ab = rest[0] if bias else None
    seg = None if segment_ids is None else fa.SegmentIds(*segment_ids)

    def op(q, k, v, ab):
        return attention(q, k, v, ab, seg, causal=causal, sm_scale=sm_scale)

    if not grads:
        return op(q, k, v, ab)
    to32 = [None if x is None else x.astype(F32) for x in (q, k, v, ab, rest[-1])]
    return with_grads(op, *to32)


def inputs(dtype, b=1, h=2, lq=256, lk=256, d=128, bias=False, grads=False):
    args = [rand(1, (b, h, lq, d), dtype), rand(2, (b, h, lk, d), dtype), rand(3, (b, h, lk, d), dtype)]
    if bias:
        args.append(rand(4, (b, h, lq, lk), dtype))
    if grads:
        args.append(rand(5, (b, h, lq, d), dtype))
    return tuple(args)


def check_all(outs, refs, tol):
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    refs = refs if isinstance(refs, (tuple, list)) else (refs,)
    assert len(outs) == len(refs), (len(outs), len(refs))
    for got, want in zip(outs, refs):
        close(got, want, tol)


# ---------------------------------------------------------------------------------------------
# Every way: forward and gradients.


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: object = F32
    causal: bool = False
    sm_scale: float = 1.0
    sizes: dict | None = None  # BlockSizes fields (the rest 128); None: the op's defaults
    bias: bool = False
    segments: bool = False
    grads: bool = False
    lq: int = 256
    lk: int = 256
    tol: float = 2e-3
    # the most scores a grid step runs as straight-line tiles (``_blocks.STRAIGHT_LINE_SCORES``);
    # 1: every step loops over its tiles and crosses the causal diagonal in one body
    straight_line: int | None = None


SMALL = dict(block_q=128, block_k_major=256, block_k=128)  # two key tiles a step: the diagonal at 0 or 128
CASES = {
    "fwd_f32": Case(sm_scale=0.125, sizes=SMALL),
    "fwd_causal_bf16": Case(BF16, causal=True, sm_scale=0.088, sizes=SMALL, tol=3e-2),
    # query blocks longer than key blocks: the diagonal crosses steps (``_Sweep._straddling``)
    "fwd_causal_straddling": Case(causal=True, sm_scale=0.3, sizes=dict(block_q=256, block_k_major=128)),
    "fwd_bias_segments_causal": Case(causal=True, sm_scale=0.5, bias=True, segments=True),
    "fwd_default_blocks_bf16": Case(BF16, lq=512, tol=3e-2),
    "grad_f32_bias": Case(
        sm_scale=0.2, sizes=dict(SMALL, block_q_major_dkv=256), bias=True, grads=True, tol=3e-3
    ),
    "grad_causal_f32_bias": Case(
        causal=True, sm_scale=0.3, sizes=dict(SMALL, block_q_major_dkv=256), bias=True, grads=True, tol=3e-3
    ),
    "grad_causal_bf16_segments": Case(BF16, causal=True, sm_scale=0.088, segments=True, grads=True, tol=4e-2),
    # the loops of steps too large to unroll (forced): tiles in a loop, the diagonal in one body
    "fwd_loops": Case(sm_scale=0.125, sizes=SMALL, lq=512, lk=512, straight_line=1),
    "grad_causal_loops_bias_segments": Case(
        causal=True,
        sm_scale=0.3,
        bias=True,
        segments=True,
        grads=True,
        lq=512,
        lk=512,
        tol=3e-3,
        sizes=dict(SMALL, block_q_major_dkv=256, block_k_major_dkv=128),
        straight_line=1,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
@every_way(tpu=True)
def test_ways(case, way, monkeypatch):
    c = CASES[case]
    if c.straight_line is not None:
        monkeypatch.setattr(fa._blocks, "STRAIGHT_LINE_SCORES", c.straight_line)
    args = inputs(c.dtype, lq=c.lq, lk=c.lk, bias=c.bias, grads=c.grads)
    seg = None
    if c.segments:  # a packed sequence: every query sees its own segment's keys
        ids = segments(7, 1, c.lq)
        seg = (ids, ids)
    if way.name == "jax_mosaic" and (c.dtype == BF16 or c.sizes is None):
        pytest.skip("JAX's op through run_mosaic: the f32 cases with explicit blocks cover it (CI time)")
    outs = way.jit(build_for(c.causal, c.sm_scale, c.sizes, c.grads, seg, c.bias)(*way.modules()))(*args)
    check_all(outs, reference(args, c.causal, c.sm_scale, c.grads, seg, c.bias), way.dot_tol(c.tol, c.dtype))


# ---------------------------------------------------------------------------------------------
# Against JAX's op in JAX's TPU interpret mode.


@contextlib.contextmanager
def jax_interpret():
    # JAX's interpret mode emits io_callbacks, which jax_enable_checks refuses inside its
    # custom_vjp ("Effects not supported in `custom_vjp`"): its side runs without checks.
    with jax.enable_checks(False), jax_pltpu.force_tpu_interpret_mode(jax_pltpu.InterpretParams()):
        yield


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_jax_op(causal):
    q, k, v, ab, do = inputs(F32, bias=True, grads=True)
    seg_ids = segments(11, 1, 256)
    sizes = dict(block_q=128, block_k_major=256, block_k=128)

    def run(module):
        seg = module.SegmentIds(seg_ids, seg_ids)

        def op(q, k, v, ab):
            bs = blocks(module, **sizes)
            return module.flash_attention(q, k, v, ab, seg, causal=causal, sm_scale=0.3, block_sizes=bs)

        return with_grads(op, q, k, v, ab, do)

    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        ours = run(fa)
    with jax_interpret():
        theirs = run(jfa)
    check_all(ours, theirs, 2e-4)


def test_separate_dq_kernel(monkeypatch):
    """Where a head's dq does not fit VMEM, dq is its own kernel (here forced, at unequal blocks)."""
    monkeypatch.setattr(fa._api, "_fused_backward_fits", lambda q: False)
    args = inputs(F32, bias=True, grads=True)
    seg = (segments(3, 1, 256),) * 2
    sizes = dict(block_q_dq=256, block_k_major_dq=128, block_k_dq=128)
    build = build_for(True, 0.4, sizes, True, seg, bias=True)
    interpret = Way("tpu_interpret")
    outs = interpret.jit(build(*interpret.modules()))(*args)
    check_all(outs, reference(args, True, 0.4, True, seg, bias=True), 3e-3)


def test_unequal_lengths_and_small_head():
    """Causal attention with more keys than queries (top-left aligned, as JAX's), head_dim 64."""
    q, k, v, do = inputs(F32, lq=256, lk=512, d=64, grads=True)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        got = with_grads(
            lambda q, k, v, ab: fa.flash_attention(q, k, v, causal=True, sm_scale=0.7), q, k, v, None, do
        )
    want = with_grads(lambda q, k, v, ab: attention(q, k, v, causal=True, sm_scale=0.7), q, k, v, None, do)
    check_all(got, want, 2e-3)


# ---------------------------------------------------------------------------------------------
# The module's surface: JAX's names, and its references.


def test_public_names_match_jax():
    theirs = {n for n in dir(jfa) if not n.startswith("_") and not isinstance(getattr(jfa, n), type(jax))}
    imported = {
        "Any",
        "NamedTuple",
        "annotations",
        "dataclasses",
        "functools",
        "jax",
        "jnp",
        "lax",
        "math",
        "pl",
        "pltpu",
    }
    missing = sorted(n for n in theirs - imported if not hasattr(fa, n))
    assert not missing, missing
    assert BLOCK_FIELDS == [f.name for f in dataclasses.fields(jfa.BlockSizes)]
    assert fa.SegmentIds._fields == jfa.SegmentIds._fields
    for name in ("DEFAULT_MASK_VALUE", "MIN_BLOCK_SIZE", "NUM_LANES", "NUM_SUBLANES", "TRANS_B_DIM_NUMBERS"):
        assert getattr(fa, name) == getattr(jfa, name), name
    # get_default means what JAX's does (and returns its blocks); the op's own pick is tuned_block_sizes
    assert fa.BlockSizes.get_default(2, 4, 4096, 4096, 128) == blocks(fa)
    assert dataclasses.asdict(fa.BlockSizes.get_default(2, 4, 4096, 4096, 128)) == dataclasses.asdict(
        jfa.BlockSizes.get_default(2, 4, 4096, 4096, 128)
    )
    tuned = fa.tuned_block_sizes(2, 4, 4096, 4096, 128)
    assert tuned.has_backward_blocks and tuned.block_q == 1024


@needs_libtpu  # the blocks are checked by libtpu's compile for each chip
@pytest.mark.parametrize("chip", ["v5e", "v4"])
def test_default_dkv_sweep_follows_head_dim(chip):
    """The ``dk``/``dv`` step's query sweep is divided by the MXU's passes over head_dim, down to
    512 (code size: the fused backward at D256, causal, L=4096 was 80.7k bundles in 5 overlays on
    the v5e with 1024 x 2048 steps, 32.9k in one with 1024 x 1024); the other blocks keep to it."""
    with chip_mesh(chip):
        got = {
            (d, causal): fa.tuned_block_sizes(1, 2, 4096, 4096, d, causal=causal)
            for d in (64, 128, 256, 512)
            for causal in (False, True)
        }
    tile = 1024 if chip == "v5e" else 512
    for (d, causal), b in got.items():
        at_128 = got[128, causal]  # the sweep at one pass: 2 tiles causal, up to 4 without
        assert at_128.block_q_major_dkv == (2 * tile if causal else at_128.block_k_major), at_128
        assert b.block_q_major_dkv == max(512, at_128.block_q_major_dkv // -(-d // 128)), (d, b)
        assert b.block_q_dkv == min(tile, b.block_q_major_dkv), (d, b)
        assert (b.block_q, b.block_k_major_dkv, b.block_k_dkv) == (tile, tile, tile), (d, b)
        assert b.block_k_major == at_128.block_k_major, (d, b)  # forward and dq: as at 128
    if chip == "v5e":
        assert got[256, True].block_q_major_dkv == 1024 and got[256, False].block_q_major_dkv == 2048


def test_references():
    q, k, v, ab, do = inputs(F32, bias=True, grads=True)
    seg = fa.SegmentIds(*(segments(5, 1, 256),) * 2)
    kw = dict(causal=True, sm_scale=0.25)
    want, want_vjp = jax.vjp(lambda q, k, v, ab: attention(q, k, v, ab, seg, **kw), q, k, v, ab)
    close(fa.mha_reference(q, k, v, ab, seg, **kw), want, 1e-2)  # bfloat16 matmuls, as JAX's
    close(fa.mha_reference_no_custom_vjp(q, k, v, ab, seg, **kw), want, 1e-5)
    got = jax.vjp(lambda q, k, v, ab: fa.mha_reference(q, k, v, ab, seg, **kw), q, k, v, ab)[1](do)
    for g, w in zip(got, want_vjp(do)):
        close(g, w, 2e-2)
    assert fa.below_or_on_diag(1, 128, 1, 128) and not fa.below_or_on_diag(0, 128, 1, 128)


# ---------------------------------------------------------------------------------------------
# Errors name the argument.

BAD = {
    "rank": (dict(q=(256, 128)), "q must be"),
    "batch": (dict(k=(2, 2, 256, 128)), "batch sizes"),
    "heads": (dict(v=(1, 3, 256, 128)), "head counts"),
    "head_dim": (dict(k=(1, 2, 256, 64)), "head_dim of q"),
    "kv_len": (dict(v=(1, 2, 128, 128)), "kv_seq_len of k"),
    "ab": (dict(ab=(1, 2, 256, 128)), "ab must have shape"),
    "segments": (dict(seg_q=(1, 128)), "segment_ids.q"),
    "block_q": (dict(sizes=dict(block_q=384)), "block_sizes.block_q=384"),
    "block_k_major": (dict(sizes=dict(block_k_major=192, block_k=64)), "block_sizes.block_k_major=192"),
    "lanes": (dict(sizes=dict(block_q_dkv=64)), "multiple of 128"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_arguments(bad):
    change, words = BAD[bad]
    shapes = dict(q=(1, 2, 256, 128), k=(1, 2, 256, 128), v=(1, 2, 256, 128))
    shapes.update({n: s for n, s in change.items() if n in ("q", "k", "v")})
    q, k, v = (jnp.zeros(shapes[n], F32) for n in "qkv")
    ab = jnp.zeros(change["ab"], F32) if "ab" in change else None
    seg = None
    if "seg_q" in change:
        seg = fa.SegmentIds(jnp.zeros(change["seg_q"], jnp.int32), jnp.zeros((1, 256), jnp.int32))
    bs = blocks(fa, **change["sizes"]) if "sizes" in change else None
    with pytest.raises(ValueError, match=words):
        fa.flash_attention(q, k, v, ab, seg, block_sizes=bs)


def test_block_sizes_checks_itself():
    with pytest.raises(ValueError, match="block_k=384 must divide BlockSizes.block_k_major=512"):
        fa.BlockSizes(block_q=128, block_k_major=512, block_k=384, block_b=1)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        fa.BlockSizes(block_q=0, block_k_major=128, block_k=128, block_b=1)


# ---------------------------------------------------------------------------------------------
# Accuracy against a float32 reference, beside JAX's op's (both in TPU interpret mode).


def errors(outs, refs):
    """Each output's max |error| relative to its reference's max |value|."""
    return [
        float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))) / np.max(np.abs(w)))
        for g, w in zip(outs, refs)
    ]


ACCURACY = {
    # logit scale 1 (unscaled normal q, k: a sharp softmax), where a query rounded after its scaling
    # gave several times JAX's error
    "scale1_causal": dict(sm_scale=1.0, causal=True),
    "scale1_bias": dict(sm_scale=1.0, bias=True),
    "scaled_full": dict(sm_scale=128**-0.5),
    "scaled_causal_bias": dict(sm_scale=128**-0.5, causal=True, bias=True),
}


@pytest.mark.parametrize("case", list(ACCURACY))
def test_accuracy_against_jax_op(case):
    """bfloat16 forward and gradients: ours' max error is at most 1.1 times JAX's (+1e-4)."""
    c = ACCURACY[case]
    causal, sm_scale, bias = c.get("causal", False), c["sm_scale"], c.get("bias", False)
    args = inputs(BF16, lq=256, lk=256, bias=bias, grads=True)

    def run(module):
        return build_for(causal, sm_scale, None, True, bias=bias)(None, pltpu if module is fa else None)(
            *args
        )

    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        ours = run(fa)
    with jax_interpret():
        theirs = run(jfa)
    refs = reference(args, causal, sm_scale, True, bias=bias)
    for name, mine, jax_err in zip(
        ("out", "dq", "dk", "dv", "dab"), errors(ours, refs), errors(theirs, refs)
    ):
        print(f"{case} {name}: ours {mine:.3g}, JAX's {jax_err:.3g}")
        assert mine <= 1.1 * jax_err + 1e-4, (name, mine, jax_err)


# ---------------------------------------------------------------------------------------------
# Edges of the shapes and of the masks.


def interpret_grads(f, q, k, v, ab, do):
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        return with_grads(f, q, k, v, ab, do)


@pytest.mark.parametrize(
    "lq,lk,sizes",
    [(128, 512, dict(block_k_major_dkv=128, block_k_dkv=128)), (256, 512, None), (384, 128, None)],
    ids=["keys_split", "default_blocks", "more_queries"],
)
def test_causal_unequal_lengths_grads(lq, lk, sizes):
    """Causal with q_len != kv_len, top-left aligned as JAX's op (keys past the last query are seen
    by none): the backward's key blocks past every query do nothing (they crashed the index map)."""
    q, k, v, do = inputs(F32, lq=lq, lk=lk, grads=True)
    bs = None if sizes is None else blocks(fa, **sizes)
    got = interpret_grads(
        lambda q, k, v, ab: fa.flash_attention(q, k, v, causal=True, sm_scale=0.2, block_sizes=bs),
        q,
        k,
        v,
        None,
        do,
    )
    want = with_grads(lambda q, k, v, ab: attention(q, k, v, causal=True, sm_scale=0.2), q, k, v, None, do)
    check_all(got, want, 2e-5)
    if lq < lk:
        assert not np.any(np.asarray(got[2])[:, :, lq:]) and not np.any(np.asarray(got[3])[:, :, lq:])
    if sizes is None:
        with jax_interpret():
            theirs = with_grads(
                lambda q, k, v, ab: jfa.flash_attention(q, k, v, causal=True, sm_scale=0.2), q, k, v, None, do
            )
        check_all(got, theirs, 2e-5)


def attention_seeing_nothing(q, k, v, ab=None, segment_ids=None, *, sm_scale=1.0):
    """``attention`` where a query row that sees no key (segment absent from the keys, or bias
    below -1e20) gets the mean of all values, as JAX's op gives it, and no gradient."""
    seen = jnp.ones(q.shape[:3], bool)
    if segment_ids is not None:
        same = segment_ids.q[:, :, None] == segment_ids.kv[:, None, :]
        seen = seen & jnp.any(same, axis=-1)[:, None, :]
    if ab is not None:
        seen = seen & jnp.any(ab > -1e20, axis=-1)
    ab_seen = None if ab is None else jnp.where(seen[..., None], ab, 0.0)
    seg = segment_ids
    if seg is not None:  # the unseen rows attend to everything, then are replaced
        seg = fa.SegmentIds(jnp.where(seen[:, 0], seg.q, seg.kv[:, :1]), seg.kv)
    out = attention(q, k, v, ab_seen, seg, sm_scale=sm_scale)
    mean = jax.lax.stop_gradient(jnp.broadcast_to(jnp.mean(v, axis=2, keepdims=True), out.shape))
    return jnp.where(seen[..., None], out, mean)


@pytest.mark.parametrize("how", ["segment_absent", "bias_row"])
def test_row_that_sees_nothing(how):
    """A query row that sees no key: the forward gives the mean of the values (as JAX's op), and the
    row contributes no gradient (dq, dk, dv and dab were off by the row's whole weight before)."""
    q, k, v, do = inputs(F32, grads=True)
    ab, seg = None, None
    if how == "segment_absent":
        seg = fa.SegmentIds(
            jnp.zeros((1, 256), jnp.int32).at[0, 10:20].set(7), jnp.zeros((1, 256), jnp.int32)
        )
    else:
        ab = rand(4, (1, 2, 256, 256)).at[:, :, 30:33].set(-1e30)

    def ours(q, k, v, ab):
        return fa.flash_attention(q, k, v, ab, seg, sm_scale=0.3)

    got = interpret_grads(ours, q, k, v, ab, do)
    want = with_grads(
        lambda q, k, v, ab: attention_seeing_nothing(q, k, v, ab, seg, sm_scale=0.3), q, k, v, ab, do
    )
    check_all(got, want, 2e-5)
    rows = slice(10, 20) if seg is not None else slice(30, 33)
    assert not np.any(np.asarray(got[1])[:, :, rows])  # no dq for the rows
    if seg is not None:  # JAX's forward (its gradients of such rows differ: they are not zero)
        with jax_interpret():
            theirs = jfa.flash_attention(q, k, v, None, jfa.SegmentIds(*seg), sm_scale=0.3)
        close(got[0], theirs, 2e-5)


def test_float_segment_ids_compared_as_given():
    """1.5 and 1.7 are different segments (they were truncated to the same int)."""
    q, k, v, do = inputs(F32, grads=True)
    ids = jnp.where(jnp.arange(256) < 100, 1.5, 1.7)[None].astype(F32)
    seg = fa.SegmentIds(ids, ids)
    got = interpret_grads(
        lambda q, k, v, ab: fa.flash_attention(q, k, v, None, seg, sm_scale=0.2), q, k, v, None, do
    )
    want = with_grads(lambda q, k, v, ab: attention(q, k, v, None, seg, sm_scale=0.2), q, k, v, None, do)
    check_all(got, want, 2e-5)


@pytest.mark.parametrize("lq,lk,causal", [(1, 128, False), (1, 200, True), (136, 136, True)], ids=str)
def test_lengths_off_the_blocks(lq, lk, causal):
    """One query; lengths that are not multiples of 128 (blocks as long as the sequence)."""
    q, k, v, do = inputs(F32, h=1, lq=lq, lk=lk, grads=True)
    got = interpret_grads(
        lambda q, k, v, ab: fa.flash_attention(q, k, v, causal=causal, sm_scale=0.3), q, k, v, None, do
    )
    want = with_grads(lambda q, k, v, ab: attention(q, k, v, causal=causal, sm_scale=0.3), q, k, v, None, do)
    check_all(got, want, 2e-5)


def test_empty_query_sequence():
    q, k, v = jnp.zeros((1, 2, 0, 128)), rand(2, (1, 2, 128, 128)), rand(3, (1, 2, 128, 128))
    out, vjp = jax.vjp(lambda q, k, v: fa.flash_attention(q, k, v), q, k, v)
    assert out.shape == (1, 2, 0, 128) and out.dtype == q.dtype
    dq, dk, dv = vjp(out)
    assert dq.shape == q.shape and not np.any(np.asarray(dk)) and not np.any(np.asarray(dv))


BAD_TYPES = {
    "int_q": (TypeError, "q must have a floating dtype.*int32"),
    "int_ab": (TypeError, "ab must have a floating dtype.*int32"),
    "causal_str": (TypeError, "causal must be a bool, got 'False'"),
    "tuple_segments": (TypeError, "segment_ids must be a SegmentIds"),
    "splash_blocks": (TypeError, "block_sizes must be a pallas_tpu.ops.flash_attention.BlockSizes"),
    "empty_keys": (ValueError, "kv_seq_len is 0"),
    "block_q_64": (ValueError, "block_q=64 must be a multiple of 128 .* logsumexp .* lane-dense"),
}


@pytest.mark.parametrize("bad", list(BAD_TYPES))
def test_bad_argument_types(bad):
    from pallas_tpu.ops import splash_attention

    error, words = BAD_TYPES[bad]
    q = k = v = jnp.zeros((1, 2, 256, 128), F32)
    kw = {}
    ab = seg = None
    if bad == "int_q":
        q = jnp.zeros((1, 2, 256, 128), jnp.int32)
    elif bad == "int_ab":
        ab = jnp.zeros((1, 2, 256, 256), jnp.int32)
    elif bad == "causal_str":
        kw["causal"] = "False"
    elif bad == "tuple_segments":
        seg = (jnp.zeros((1, 256), jnp.int32),) * 2
    elif bad == "splash_blocks":
        kw["block_sizes"] = splash_attention.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
    elif bad == "empty_keys":
        k = v = jnp.zeros((1, 2, 0, 128), F32)
    elif bad == "block_q_64":
        kw["block_sizes"] = blocks(fa, block_q=64)
    with pytest.raises(error, match=words):
        fa.flash_attention(q, k, v, ab, seg, **kw)
