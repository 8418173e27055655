"""``pallas_tpu.ops._policy``: the block and VMEM policy every family of ``pallas_tpu.ops`` asks.

* Each generation file's facts agree with ``pltpu.get_tpu_info()``'s for that chip (the
  figures the families' rules were written against), a chip without a file gets those.
* ``choose`` answers from the generation's measured row, else the estimate hook, else the
  family's rule; ``fit_block`` and the VMEM formulas give what the families computed before
  the policy held them.
* Every measured row compiles with libtpu for its generation (compile-only devices, no TPU):
  each op with rows has an ``EXAMPLES`` call that runs the row's blocks; a row of an op
  without one fails here, naming it. The examples of ops without rows yet are lowered for a
  v5e with their rule's blocks, so that they are ready when a row comes.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import pytest

import pallas_tpu as pltpu
from pallas_tpu._src.mosaic import compile_check
from pallas_tpu.ops import _policy
from pallas_tpu.ops import matmul as mm
from pallas_tpu.ops.paged_attention import paged_attention
from pallas_tpu.ops.random import threefry

S = jax.ShapeDtypeStruct
gmm_module = importlib.import_module("pallas_tpu.ops.megablox.gmm")  # the attribute `gmm` is the function
rpa_kernel = importlib.import_module("pallas_tpu.ops.ragged_paged_attention.kernel")
tbs = importlib.import_module("pallas_tpu.ops.ragged_paged_attention.tuned_block_sizes")

needs_libtpu = pytest.mark.skipif(
    not compile_check.libtpu_available(), reason='needs libtpu: pip install "jax[tpu]"'
)


@pytest.mark.parametrize("chip", _policy.GENERATIONS)
def test_facts_agree_with_tpu_info(chip):
    info = pltpu.get_tpu_info(chip)
    facts = _policy.generation_facts(chip)
    assert facts.name == chip
    assert dataclasses.replace(facts, instruction_bundles=None, num_cores=info.num_cores) == _policy.Facts.of(
        info
    )
    assert _policy.facts(info).num_cores == info.num_cores  # the device's, not the file's


def test_a_chip_without_a_file_gets_tpu_infos_facts():
    info = pltpu.get_tpu_info("7x")
    assert "7x" not in _policy.GENERATIONS
    assert _policy.facts(info) == _policy.Facts.of(info)
    assert _policy.facts(info).instruction_bundles is None


def test_choose_asks_the_row_then_the_estimated_row_then_the_hook_then_the_rule(monkeypatch):
    v5e, v6e, v5p = (pltpu.get_tpu_info(c) for c in ("v5e", "v6e", "v5p"))
    rule = lambda facts, key: ("rule", facts.name, key)
    assert _policy.choose("matmul", 2, rule, v5e) == (1024, 1024, 1024)  # the v5e's measured row
    assert _policy.choose("matmul", 2, rule, v6e) == (1024, 1024, 2048)  # the v6e's estimated row
    assert _policy.choose("matmul", 4, rule, v6e) == ("rule", "v6e", 4)  # no row for f32
    assert _policy.choose("matmul", 2, rule, v5p) == ("rule", "v5p", 2)
    asked = []
    monkeypatch.setattr(_policy, "ESTIMATE", lambda op, key, facts: asked.append((op, key)) or (8, 8))
    assert _policy.choose("matmul", 2, rule, v5p) == (8, 8)
    assert _policy.choose("matmul", 2, rule, v5e) == (1024, 1024, 1024)  # a row is not estimated
    assert _policy.choose("matmul", 2, rule, v6e) == (1024, 1024, 2048)
    assert asked == [("matmul", 2)]
    monkeypatch.setattr(_policy, "ESTIMATE", lambda op, key, facts: None)
    assert _policy.choose("matmul", 2, rule, v5p) == ("rule", "v5p", 2)
    # A measured row wins over an estimated one of the same key.
    monkeypatch.setattr(_policy._generation("v6e"), "BLOCKS", {"matmul": {2: (512, 512, 512)}})
    assert _policy.choose("matmul", 2, rule, v6e) == (512, 512, 512)


def test_attention_blocks_come_from_the_policy(monkeypatch):
    """flash and splash attention ask ``choose`` ("flash_attention", "splash_attention") with
    their ``_rule``: the chip's facts (VMEM, instruction memory) decide, and the estimate hook
    is heard."""
    from pallas_tpu.ops import flash_attention as fa
    from pallas_tpu.ops import splash_attention as sa
    from pallas_tpu.ops.splash_attention import _blocks as sb

    v5e, v4 = pltpu.get_tpu_info("v5e"), pltpu.get_tpu_info("v4")
    assert fa.tuned_block_sizes(1, 1, 8192, 8192, 128, info=v5e).block_q == 1024
    assert fa.tuned_block_sizes(1, 1, 8192, 8192, 128, info=v4).block_q == 512
    assert sb.default_blocks(8192, 8192, True, 128, 2, info=v5e).block_q == 1024
    assert sb.default_blocks(8192, 8192, True, 128, 2, info=v4).block_q == 512
    assert sb.default_blocks(8192, 8192, True, 256, 2, info=v5e).block_kv == 2048
    # half the instruction memory: half the work of a step (keys of a splash block, queries of
    # a flash dk/dv sweep)
    small = dataclasses.replace(_policy.generation_facts("v5e"), instruction_bundles=28_000)
    assert sb.default_blocks(8192, 8192, True, 256, 2, info=small).block_kv == 1024
    assert fa.tuned_block_sizes(1, 1, 8192, 8192, 128, info=small).block_q_major_dkv == 2048
    asked = []
    guess = sa.BlockSizes(256, 256)
    monkeypatch.setattr(_policy, "ESTIMATE", lambda op, key, facts: asked.append((op, key)) or guess)
    assert sb.default_blocks(512, 512, False, 64, 4, info=v5e) is guess
    assert asked == [("splash_attention", (512, 512, 64, False, 4))]


def test_fit_block():
    assert _policy.fit_block(300, 512) == 300  # the whole axis
    assert _policy.fit_block(3072, 1024) == 1024
    assert _policy.fit_block(1280, 1024) == 640
    assert _policy.fit_block(1000, 512) is None  # no multiple of 128 divides it: padded
    assert _policy.fit_block(1000, 512, or_whole=True) == 1000
    assert _policy.fit_block(None, 512) == 512
    assert _policy.fit_block(96, 64, 8) == 48


@pytest.mark.parametrize("chip", _policy.GENERATIONS)
def test_vmem_formulas_are_the_families_own(chip):
    """The numbers each family computed in its own module before the policy held them."""
    info = pltpu.get_tpu_info(chip)
    cap = info.vmem_capacity_bytes
    for needed in (1, 5 << 20, 3 * (7 << 20) + 1, 60 << 20):
        assert _policy.vmem_limit("matmul", needed, info) == int(
            min(cap * 0.9, max(32 << 20, 1.5 * needed + (4 << 20)))
        )
        assert _policy.vmem_limit("megablox", needed, info) == _policy.vmem_limit("matmul", needed, info)
        paged = int(min(cap * 0.9, max(32 << 20, 2 * needed + (8 << 20))))
        assert _policy.vmem_limit("paged_attention", needed, info) == paged
        ragged = int(min(cap * 0.9, max(32 << 20, needed * 3 // 2 + (8 << 20))))
        assert _policy.vmem_limit("ragged_paged_attention", needed, info) == ragged
        assert _policy.vmem_limit("all_gather", needed, info) == int(
            min(0.9 * cap, max(16 << 20, needed + (8 << 20)))
        )
    assert _policy.vmem_budget("matmul", info) == int(0.6 * cap)
    assert _policy.vmem_budget("paged_attention", info) == cap // 4
    assert _policy.vmem_budget("ragged_paged_attention", info) == (2 << 20 if cap >= 64 << 20 else 1 << 20)
    assert _policy.vmem_budget("random", info) == min(2 << 20, cap // 32)
    assert _policy.vmem_budget("attention", info) == min(cap * 3 // 4, 100 << 20)


def test_ragged_tuned_block_sizes_are_the_policys_rows():
    """JAX's ``TUNED_BLOCK_SIZES`` is the rows of the generation files, by JAX's device name."""
    want: dict = {}
    for chip in _policy.GENERATIONS:
        for key, blocks in _policy.measured(chip, "ragged_paged_attention").items():
            want.setdefault(f"TPU v{_policy.generation_facts(chip).generation}", {})[key] = blocks
    assert tbs.TUNED_BLOCK_SIZES == want


# ------------------------------------------------------------------ every row compiles

I32, BF16, F32 = jnp.int32, jnp.bfloat16, jnp.float32


def matmul_example(key, blocks):
    """Two k steps of a product over the row's blocks; key: the input itemsize."""
    dtype, out = {1: (jnp.int8, I32), 2: (BF16, BF16), 4: (F32, F32)}[key]
    bm, bn, bk = blocks
    fn = lambda x, y: mm.matmul(x, y, block_shape=(bm, bn), block_k=bk, out_dtype=out)
    return fn, (S((bm, 2 * bk), dtype), S((2 * bk, bn), dtype))


def megablox_example(key, blocks):
    """gmm (or tgmm) at the key's shape with the row's tiling."""
    m, k, n, groups, isz, osz, transposed, existing = key
    dtype, out = (BF16 if isz == 2 else F32), (BF16 if osz == 2 else F32)
    if transposed:
        fn = lambda lhs, rhs, sizes: gmm_module.tgmm(lhs, rhs, sizes, out, tuple(blocks))
        return fn, (S((k, m), dtype), S((m, n), dtype), S((groups,), I32))
    fn = lambda lhs, rhs, sizes: gmm_module.gmm(lhs, rhs, sizes, out, tuple(blocks))
    return fn, (S((m, k), dtype), S((groups, k, n), dtype), S((groups,), I32))


def paged_example(key, pages):
    """Decode over two compute blocks a sequence; key: (page_size, head_dim, kv itemsize, scales)."""
    page_size, head_dim, isz, scales_dim = key
    assert scales_dim is None, "a row for quantized pages: give this example their scales"
    dtype = {2: BF16, 4: F32}[isz]
    kv = S((2, 4 * pages, page_size, head_dim), dtype)
    fn = lambda q, k, v, lengths, table: paged_attention(
        q, k, v, lengths, table, pages_per_compute_block=pages
    )
    return fn, (S((2, 8, head_dim), dtype), kv, kv, S((2,), I32), S((2, 2 * pages), I32))


def ragged_example(key, blocks):
    """A batch of the key's sizes (``simplify_key``'s powers of two) with the row's blocks."""
    q_dtype, kv_dtype, q_heads, kv_heads, head_dim, page_size, tokens, kv_len = key
    pages_per_seq, seqs = kv_len // page_size, 4
    args = (S((tokens, q_heads, head_dim), jnp.dtype(q_dtype)),
            S((seqs * pages_per_seq, page_size, 2 * kv_heads, head_dim), jnp.dtype(kv_dtype)),
            S((seqs,), I32), S((seqs, pages_per_seq), I32), S((seqs + 1,), I32), S((1,), I32))  # fmt: skip
    pages, queries = blocks
    fn = lambda *a: rpa_kernel.ragged_paged_attention(
        *a, num_kv_pages_per_block=pages, num_queries_per_block=queries
    )
    return fn, args


def random_example(key, blocks):
    """Threefry's counters over two blocks of rows; key: (rows, width) of the output."""
    shape = (2 * blocks[0], blocks[1])
    return lambda k: threefry.threefry_2x32_count(k, shape, shape, blocks), (S((2,), jnp.uint32),)


# op -> example(key, blocks) -> (function, arguments): a call that runs the row's blocks.
EXAMPLES = {
    "matmul": matmul_example,
    "megablox": megablox_example,
    "paged_attention": paged_example,
    "ragged_paged_attention": ragged_example,
    "random": random_example,
}


def _rows(chip, op) -> dict:
    """The generation's measured and estimated rows of ``op`` (a key in both: the measured wins)."""
    return {**_policy.estimated(chip, op), **_policy.measured(chip, op)}


ROWS = [(chip, op, key) for chip in _policy.GENERATIONS for op in EXAMPLES for key in _rows(chip, op)]


def test_every_op_with_rows_has_an_example():
    for chip in _policy.GENERATIONS:
        module = _policy._generation(chip)
        missing = (set(module.BLOCKS) | set(getattr(module, "ESTIMATED", {}))) - set(EXAMPLES)
        assert not missing, (
            f"rows of {missing} in the {chip} generation file: add their call to EXAMPLES here"
        )


@needs_libtpu
@pytest.mark.parametrize("chip, op, key", ROWS, ids=[f"{c}-{o}-{k}" for c, o, k in ROWS])
def test_every_row_compiles_for_its_generation(chip, op, key):
    blocks = _rows(chip, op)[key]
    assert _policy.choose(op, key, lambda facts, key: None, pltpu.get_tpu_info(chip)) == blocks
    fn, args = EXAMPLES[op](key, blocks)
    reports = pltpu.compile_check(fn, *args, chips=(chip,), code_size=False)
    assert reports and all(r.compiled for r in reports), [r.error for r in reports]


# A small key and blocks per op, for the examples of ops without rows yet.
SMALL = {
    "matmul": (4, (256, 256, 256)),
    "megablox": ((1024, 256, 512, 4, 2, 4, False, False), (128, 256, 256)),
    "paged_attention": ((16, 128, 2, None), 4),
    "ragged_paged_attention": (("bfloat16", "bfloat16", 8, 2, 128, 16, 64, 256), (2, 16)),
    "random": ((64, 1024), (16, 1024)),
}


@needs_libtpu
@pytest.mark.parametrize("op", EXAMPLES)
def test_examples_lower(op):
    """Each example lowers (not compiled: quick) for a v5e at a small key and blocks, ready for
    the first row of its op."""
    fn, args = EXAMPLES[op](*SMALL[op])
    assert compile_check._kernels_of(fn, args, {}, "v5e"), op
