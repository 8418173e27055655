"""Blocks for the TPU generations we cannot run, chosen by ``pltpu.estimate`` (a CPU with libtpu).

    python benchmarks/tpu_estimate_blocks.py                     # v5e (the check), v4, v5p, v6e
    python benchmarks/tpu_estimate_blocks.py --chips v6e --shapes 4096x4096x4096
    python benchmarks/tpu_estimate_blocks.py --op gmm            # or --op flash, --op splash

For ``pallas_tpu.ops.matmul`` with bf16 operands (the policy's key 2): each candidate block
``(bm, bn, bk)`` that fits the chip's matmul VMEM budget is estimated at each shape (libtpu's
compile for that generation, its bundles simulated: ``pltpu.estimate``), and the candidates are
ranked by the geometric mean over the shapes of their time over the shape's best. The v5e row
is the check: the chip's measured row (``_policy/v5e.py``) should rank at or near the top,
as the chip ranked it. The estimate ranks matmul's block choices as the v5e does and is within
2-5 % of it at 4096^3 (``results/tpu_estimate_v5e_chip.txt``); for the other generations the
simulator's machine model (clock, MXUs, HBM rate from the chips' published figures) is not
checked against a chip, which is why the rows it picks say so where they are written
(``_policy/<chip>.py``). Writes what it prints to ``results/tpu_estimate_blocks.txt`` with
``--write``.

``--op gmm`` (``megablox.gmm``, bf16 in and out, even groups: G8 8192x2048x2048 and G32
16384x4096x4096) ranks tilings ``(tm, tk, tn)``: tm 512 (the rule's at these group sizes; 256
where 512 does not fit), tk and tn of 512 to 2048 that fit the chip's megablox VMEM budget
(``GMM_TK_TN``), and the family's rule. ``--op flash`` (``flash_attention``'s forward, bf16, B1 H16 L4096 D128, causal and not)
ranks forward blocks ``(block_q, block_k_major, block_k)`` built like the rule: a tile of 512,
1024 or 2048 for ``block_q`` and ``block_k``, a key sweep of one, two or four tiles, where a
step's scores fit the chip's attention budget (``max_step_scores``), and the rule's own blocks.
The rule of both is asked as the op asks it in the estimate's trace (the chip's facts as the
compile-only device gives them), per shape: a rule that picks other blocks at each shape is a
row of its own. Each line ``chosen for CHIP`` says the rule's rank and its score over the best
one's (``rule / best``). ``--op splash`` (splash attention's forward, bf16, H16 L4096 D128, a
causal mask and a full one) ranks ``(block_q, block_kv, block_kv_compute)`` from
``SPLASH_BLOCKS`` that fit the attention budget, and the rule's. Written to ``results/tpu_estimate_blocks_<op>.txt`` with ``--write``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import itertools
import math
import os
import sys
from pathlib import Path

from pallas_tpu._src import estimate as est

est.enable_dumps()  # before anything starts libtpu: compile in this process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tpu.ops import _policy  # noqa: E402
from pallas_tpu.ops import matmul as mm  # noqa: E402

ROOT = Path(__file__).resolve().parent
_blocks = importlib.import_module(
    "pallas_tpu.ops.matmul._blocks"
)  # the package re-exports a function of that name
SHAPES = ("4096x4096x4096", "2048x8192x8192")
SIDES = (512, 1024, 2048)


def candidates(chip: str) -> list[tuple[int, int, int]]:
    """(bm, bn, bk) over SIDES that fit the chip's matmul VMEM budget (bf16 in and out), and the
    policy's row and rule for the chip whatever their sides."""
    facts = _policy.generation_facts(chip)
    budget = _policy.vmem_budget("matmul", facts)
    out = []
    for bm, bn, bk in itertools.product(SIDES, SIDES, SIDES):
        if _blocks.vmem_bytes(bm, bn, bk, jnp.bfloat16, jnp.bfloat16, scratch=True) <= budget:
            out.append((bm, bn, bk))
    theirs = [_policy.measured(chip, "matmul").get(2), _blocks._rule(facts, jnp.bfloat16, jnp.bfloat16)]
    return out + [b for b in theirs if b is not None and b not in out]


def rank_candidates(times: dict) -> tuple[dict, list]:
    """``(score, ranked)`` of candidates by their times at each shape (``times[c]``: a list, one
    time per shape): a candidate's score is the geometric mean over the shapes of its time over
    the shape's best; ``ranked`` the candidates, best first."""
    best = [min(t[i] for t in times.values()) for i in range(len(next(iter(times.values()))))]
    score = {
        b: math.exp(sum(math.log(t / best[i]) for i, t in enumerate(row)) / len(row))
        for b, row in times.items()
    }
    return score, sorted(score, key=score.get)


def estimate_us(chip: str, shape: tuple[int, int, int], blocks) -> float | None:
    m, k, n = shape
    bm, bn, bk = blocks
    if m % bm or n % bn or k % bk:
        return None
    f = functools.partial(mm.matmul, block_shape=(bm, bn), block_k=bk)
    s = jax.ShapeDtypeStruct
    try:
        return est.estimate(f, s((m, k), jnp.bfloat16), s((k, n), jnp.bfloat16), chip=chip).total_us
    except Exception as e:  # noqa: BLE001 (a candidate libtpu refuses is left out, said)
        print(f"#   {chip} {shape} {blocks}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return None


# --- gmm and flash attention (``--op``) ---------------------------------------------------------

BF = jnp.bfloat16
# gmm: (name, (groups, m, k, n)), even groups.
GMM_SHAPES = (("G8 8192x2048x2048", (8, 8192, 2048, 2048)), ("G32 16384x4096x4096", (32, 16384, 4096, 4096)))
GMM_TM = 512  # the rule's row tile at both shapes' mean group sizes (1024 and 512 rows); or 256
GMM_TK_TN = ((512, 512), (512, 1024), (1024, 512), (1024, 1024), (1024, 2048), (2048, 1024), (2048, 2048))
# flash: (name, (batch, heads, length, head_dim, causal)), forward only.
FLASH_SHAPES = (
    ("1x16x4096x128 causal", (1, 16, 4096, 128, True)),
    ("1x16x4096x128", (1, 16, 4096, 128, False)),
)
FLASH_TILES = (512, 1024, 2048)
FLASH_SWEEPS = (1, 2, 4)  # block_k_major in tiles


def traced_facts(chip: str) -> _policy.Facts:
    """The facts the ops' rules see while ``estimate`` traces them for ``chip``."""
    from pallas_tpu._src.mosaic import compile_check as cc

    with cc._traced_for(chip, ((), {})):
        return _policy.facts()


def _gmm_candidates(chip: str) -> list[tuple[int, int, int]]:
    from pallas_tpu.ops.megablox import _blocks as gb

    facts = traced_facts(chip)
    budget = _policy.vmem_budget("megablox", facts)
    out = []
    for tk, tn in GMM_TK_TN:
        for tm in (GMM_TM, GMM_TM // 2):  # half the rows where the rule's tm does not fit (v4)
            need = max(
                gb.vmem_bytes(tm, tk, tn, 2, 2, tiles_k=-(-k // tk), transposed=False, existing=False)
                for _, (_, _, k, _) in GMM_SHAPES
            )
            if need <= budget:
                out.append((tm, tk, tn))
                break
    return out


def _gmm_rule(chip: str, shape) -> tuple[int, int, int]:
    from pallas_tpu.ops.megablox._blocks import choose_tiling

    g, m, k, n = shape
    return tuple(choose_tiling(m, k, n, g, BF, BF, info=traced_facts(chip)))


def _gmm_estimate(chip: str, shape, blocks) -> float:
    from pallas_tpu.ops.megablox.gmm import gmm

    g, m, k, n = shape
    s = jax.ShapeDtypeStruct
    f = functools.partial(gmm, tiling=tuple(blocks), preferred_element_type=BF)
    sizes = jnp.full((g,), m // g, jnp.int32)  # concrete: the kernel's visit table reads them
    return est.estimate(f, s((m, k), BF), s((g, k, n), BF), sizes, chip=chip).total_us


def _flash_candidates(chip: str) -> list[tuple[int, int, int]]:
    from pallas_tpu.ops.flash_attention import _blocks as fb

    most = fb.max_step_scores(traced_facts(chip))
    length = min(shape[2] for _, shape in FLASH_SHAPES)
    out = []
    for tile, sweep in itertools.product(FLASH_TILES, FLASH_SWEEPS):
        if tile * sweep <= length and tile * tile * sweep <= most:
            out.append((tile, tile * sweep, tile))
    return out


def _flash_rule(chip: str, shape) -> tuple[int, int, int]:
    from pallas_tpu.ops.flash_attention._blocks import tuned_block_sizes

    b, h, length, d, causal = shape
    bs = tuned_block_sizes(b, h, length, length, d, causal=causal, info=traced_facts(chip))
    return (bs.block_q, bs.block_k_major, bs.block_k)


def _flash_estimate(chip: str, shape, blocks) -> float:
    from pallas_tpu.ops.flash_attention import BlockSizes, flash_attention

    b, h, length, d, causal = shape
    bq, bkm, bk = blocks
    bs = BlockSizes(block_q=bq, block_k_major=bkm, block_k=bk, block_b=1)  # backward: the rule's
    f = functools.partial(flash_attention, causal=causal, block_sizes=bs)
    s = jax.ShapeDtypeStruct((b, h, length, d), BF)
    return est.estimate(f, s, s, s, chip=chip).total_us


# splash: (name, (heads, length, head_dim, causal)), forward only; blocks (block_q, block_kv,
# block_kv_compute).
SPLASH_SHAPES = (("16x4096x128 causal", (16, 4096, 128, True)), ("16x4096x128", (16, 4096, 128, False)))
SPLASH_BLOCKS = (
    (512, 2048, 512),
    (512, 4096, 512),
    (1024, 1024, 512),
    (1024, 2048, 512),
    (1024, 4096, 512),
    (1024, 4096, 1024),
    (2048, 2048, 512),
)


def _splash_candidates(chip: str) -> list[tuple[int, int, int]]:
    from pallas_tpu.ops.splash_attention import _blocks as sb

    budget = _policy.vmem_budget("attention", traced_facts(chip))
    return [b for b in SPLASH_BLOCKS if sb._forward_vmem(b[0], b[1], 128, 2) <= budget]


def _splash_rule(chip: str, shape) -> tuple[int, int, int]:
    from pallas_tpu.ops.splash_attention._blocks import default_blocks

    h, length, d, causal = shape
    bs = default_blocks(length, length, causal, d, 2, info=traced_facts(chip))  # causal: partial blocks
    return (bs.block_q, bs.block_kv, bs.block_kv_compute)


def _splash_estimate(chip: str, shape, blocks) -> float:
    from pallas_tpu.ops.splash_attention import splash_attention_kernel as sk
    from pallas_tpu.ops.splash_attention import splash_attention_mask as sm

    h, length, d, causal = shape
    one = sm.CausalMask((length, length)) if causal else sm.FullMask((length, length))
    bq, bkv, bc = blocks
    bs = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bc)  # backward: from the forward's
    kernel = sk.make_splash_mha_single_device(sm.MultiHeadMask([one] * h), block_sizes=bs)
    s = jax.ShapeDtypeStruct((h, length, d), BF)
    return est.estimate(kernel, s, s, s, chip=chip).total_us


@dataclasses.dataclass(frozen=True)
class Op:
    title: str
    shapes: tuple  # ((name, shape), ...)
    candidates: object  # chip -> [blocks]
    rule: object  # (chip, shape) -> blocks
    estimate: object  # (chip, shape, blocks) -> us
    policy_op: str  # the op's name in ``_policy``


OPS = {
    "gmm": Op(
        "megablox.gmm's bf16 tilings (tm, tk, tn), even groups, bf16 out",
        GMM_SHAPES,
        _gmm_candidates,
        _gmm_rule,
        _gmm_estimate,
        "megablox",
    ),
    "flash": Op(
        "flash_attention's bf16 forward blocks (block_q, block_k_major, block_k)",
        FLASH_SHAPES,
        _flash_candidates,
        _flash_rule,
        _flash_estimate,
        "flash_attention",
    ),
    "splash": Op(
        "splash attention's bf16 forward blocks (block_q, block_kv, block_kv_compute)",
        SPLASH_SHAPES,
        _splash_candidates,
        _splash_rule,
        _splash_estimate,
        "splash_attention",
    ),
}


def sweep(op: Op, chips, top: int, say) -> None:
    """``op``'s candidates and rule estimated per chip at its shapes, ranked as matmul's."""
    names = [name for name, _ in op.shapes]
    for chip in chips:
        rules = [tuple(op.rule(chip, shape)) for _, shape in op.shapes]
        cands = op.candidates(chip)
        # The rule is a candidate of its own where it picks other blocks at other shapes.
        rule_key = rules[0] if all(r == rules[0] for r in rules) else "rule"
        keys = cands + ([rule_key] if rule_key not in cands else [])
        memo: dict = {}  # (shape index, blocks) -> us
        times = {}
        for key in keys:
            row = []
            for i, (_, shape) in enumerate(op.shapes):
                blocks = rules[i] if key == "rule" else key
                if (i, blocks) not in memo:
                    try:
                        memo[i, blocks] = op.estimate(chip, shape, blocks)
                    except Exception as e:  # noqa: BLE001 (a candidate libtpu refuses is left out, said)
                        say(
                            f"#   {chip} {names[i]} {blocks}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                        )
                        memo[i, blocks] = None
                row.append(memo[i, blocks])
            if all(t is not None for t in row):
                times[key] = row
        if not times:
            say(f"\n## {chip}: no candidate compiled")
            continue
        score, ranked = rank_candidates(times)
        rows = {**_policy.estimated(chip, op.policy_op), **_policy.measured(chip, op.policy_op)}
        rule_text = (
            " / ".join(f"{r} at {n}" for r, n in zip(rules, names)) if rule_key == "rule" else str(rule_key)
        )
        say(
            f"\n## {chip}: {len(times)} candidates; the policy's rows {'none' if not rows else rows}, the rule {rule_text}"
        )
        say("| blocks | " + " | ".join(f"{n} us" for n in names) + " | score |")
        say("|---|" + "---|" * len(names) + "---|")
        for b in ranked[:top] + [b for b in (rule_key,) if b in times and b not in ranked[:top]]:
            label = "rule" if b == "rule" else (f"{b} (rule)" if b == rule_key else str(b))
            say(f"| {label} | " + " | ".join(f"{t:.1f}" for t in times[b]) + f" | {score[b]:.3f} |")
        if rule_key in score:
            rank = f"rank of the rule: {ranked.index(rule_key) + 1}, rule / best = {score[rule_key] / score[ranked[0]]:.2f}x"
        else:
            rank = "rank of the rule: -, it did not compile"
        say(f"chosen for {chip}: {ranked[0]} ({rank})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=["matmul", *OPS], default="matmul")
    ap.add_argument("--chips", nargs="*", default=["v5e", "v4", "v5p", "v6e"])
    ap.add_argument(
        "--shapes", nargs="*", default=None, help=f"MxKxN, matmul's only (default {' '.join(SHAPES)})"
    )
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument(
        "--write",
        action="store_true",
        help=f"also write {ROOT / 'results' / 'tpu_estimate_blocks.txt'} (--op matmul), else tpu_estimate_blocks_<op>.txt",
    )
    a = ap.parse_args()
    if a.op != "matmul":
        if a.shapes is not None:
            ap.error("--shapes is matmul's: the other ops sweep their own shapes")
        return main_op(a)
    if a.shapes is None:
        a.shapes = list(SHAPES)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes]
    lines = [f"# pltpu.estimate's ranking of matmul's bf16 blocks (bm, bn, bk); jax {jax.__version__}"]
    lines.append(
        f"# shapes (m, k, n): {', '.join(a.shapes)}; score: geometric mean of time / the shape's best"
    )

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    for chip in a.chips:
        times = {}
        for blocks in candidates(chip):
            row = [estimate_us(chip, s, blocks) for s in shapes]
            if all(t is not None for t in row):
                times[blocks] = row
        if not times:
            say(f"\n## {chip}: no candidate compiled")
            continue
        score, ranked = rank_candidates(times)
        row = _policy.measured(chip, "matmul").get(2)
        rule = _blocks._rule(_policy.generation_facts(chip), jnp.bfloat16, jnp.bfloat16)
        say(f"\n## {chip}: {len(times)} candidates; the policy's row {row}, the rule {rule}")
        say("| blocks | " + " | ".join(f"{s} us" for s in a.shapes) + " | score |")
        say("|---|" + "---|" * len(shapes) + "---|")
        shown = ranked[: a.top] + [b for b in (row, rule) if b in times and b not in ranked[: a.top]]
        for b in shown:
            mark = " (row)" if b == row else (" (rule)" if b == rule else "")
            say(f"| {b}{mark} | " + " | ".join(f"{t:.1f}" for t in times[b]) + f" | {score[b]:.3f} |")
        say(
            f"chosen for {chip}: {ranked[0]} (rank of the row: {ranked.index(row) + 1 if row in score else '-'}, of the rule: {ranked.index(rule) + 1 if rule in score else '-'})"
        )
    if a.write:
        (ROOT / "results" / "tpu_estimate_blocks.txt").write_text("\n".join(lines) + "\n")
    return 0


def main_op(a) -> int:
    op = OPS[a.op]
    lines = [
        f"# python benchmarks/tpu_estimate_blocks.py --op {a.op} --top {a.top}{' --write' if a.write else ''}"
        f" ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, a {os.cpu_count()}-core CPU)",
        f"# pltpu.estimate's ranking of {op.title}; jax {jax.__version__}",
        f"# shapes: {', '.join(n for n, _ in op.shapes)}; score: geometric mean of time / the shape's best",
    ]
    for line in lines:
        print(line, flush=True)

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    sweep(op, a.chips, a.top, say)
    if a.write:
        (ROOT / "results" / f"tpu_estimate_blocks_{a.op}.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
