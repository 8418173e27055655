"""Blocks for the TPU generations we cannot run, chosen by ``pltpu.estimate`` (a CPU with libtpu).

    python benchmarks/tpu_estimate_blocks.py                     # v5e (the check), v4, v5p, v6e
    python benchmarks/tpu_estimate_blocks.py --chips v6e --shapes 4096x4096x4096

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
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import math
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", nargs="*", default=["v5e", "v4", "v5p", "v6e"])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="MxKxN")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument(
        "--write", action="store_true", help=f"also write {ROOT / 'results' / 'tpu_estimate_blocks.txt'}"
    )
    a = ap.parse_args()
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
        best = [min(t[i] for t in times.values()) for i in range(len(shapes))]
        score = {
            b: math.exp(sum(math.log(t / best[i]) for i, t in enumerate(row)) / len(row))
            for b, row in times.items()
        }
        ranked = sorted(score, key=score.get)
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


if __name__ == "__main__":
    sys.exit(main())
