"""TPU instruction counts: our Mosaic lowering against JAX's, compiled by libtpu.

No TPU is needed: libtpu's compile-only devices run Mosaic's whole pipeline down to
LLO (the TPU's instructions), and ``--xla_mosaic_dump_to`` writes each kernel's
final LLO. This script runs the TPU suites' compiled way (tests/tpu, ``-k
compiled``: every kernel the TPU ways run (tests/ways), the TPU examples, JAX's TPU ops
and the multi-device kernels), each kernel lowered by us and by JAX's Pallas and
compiled for each chip, and prints per kernel the LLO op count of ours beside
JAX's, in total and inside the innermost loop, as a ratio.

It is the closest measure of TPU speed available without a TPU, and only that: it
counts instructions, not cycles (no stalls, DMA time, bundle packing or memory
bandwidth), and an op inside a loop counts once, however often the loop runs.

    python benchmarks/tpu_llo.py                 # v5e and v6e
    python benchmarks/tpu_llo.py --chips v4,v5p  # other generations
    python benchmarks/tpu_llo.py -k flash        # a subset (pytest -k)

Writes results/tpu_llo.csv and results/tpu_llo.png (if matplotlib imports), and
prints the Markdown table of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def collect(chips: str, select: str | None, workers: int) -> list[dict]:
    """Runs the compiled way of the TPU suites; the rows each compile recorded."""
    with tempfile.TemporaryDirectory() as tmp:
        report, dump = os.path.join(tmp, "report"), os.path.join(tmp, "dump")
        os.makedirs(report)
        env = dict(
            os.environ,
            PALLAS_TPU_COMPILE_REPORT=report,
            PALLAS_TPU_LLO_DUMP=dump,
            PALLAS_TPU_CHIPS=chips,
            PALLAS_TPU_JAX_BESIDE="1",
        )
        k = "compiled" + (f" and ({select})" if select else "")
        cmd = [sys.executable, "-m", "pytest", "tests/tpu", "-q", "-k", k, "-p", "no:cacheprovider"]
        if workers > 1:
            cmd += ["-n", str(workers)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        print(f"pytest {' '.join(cmd[3:])}: {tail[0]}", file=sys.stderr)
        rows = []
        for name in sorted(os.listdir(report)):
            with open(os.path.join(report, name)) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    return rows


def table(rows: list[dict]) -> list[dict]:
    """One row per (test, chip): ours and JAX's LLO ops, summed over the test's kernels."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["test"], r["chip"]), {})[r["lowering"]] = r
    out = []
    for (test, chip), both in sorted(by.items()):
        ours, theirs = both.get("ours"), both.get("jax")
        if ours is None or not ours.get("llo"):
            continue
        row = dict(
            kernel=test.split("::", 1)[-1],
            file=os.path.basename(test.split("::", 1)[0]),
            chip=chip,
            ours_ops=sum(c[0] for c in ours["llo"]),
            ours_loop_ops=max(c[1] for c in ours["llo"]),
            jax=theirs["outcome"] if theirs else "not run",
            jax_ops="",
            jax_loop_ops="",
            ratio="",
            loop_ratio="",
        )
        if theirs and theirs.get("llo"):
            row["jax_ops"] = sum(c[0] for c in theirs["llo"])
            row["jax_loop_ops"] = max(c[1] for c in theirs["llo"])
            row["ratio"] = round(row["ours_ops"] / max(row["jax_ops"], 1), 3)
            if row["jax_loop_ops"]:
                row["loop_ratio"] = round(row["ours_loop_ops"] / row["jax_loop_ops"], 3)
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "| kernel | chip | ours: LLO ops (innermost loop) | JAX's | ratio (loop) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["jax_ops"] == "":
            jax_col, ratio = f"({r['jax']})", "ours only"
        else:
            jax_col = f"{r['jax_ops']} ({r['jax_loop_ops']})"
            ratio = f"{r['ratio']:.3f}" + (f" ({r['loop_ratio']:.3f})" if r["loop_ratio"] != "" else "")
        lines.append(
            f"| {r['kernel']} | {r['chip']} | {r['ours_ops']} ({r['ours_loop_ops']}) | {jax_col} | {ratio} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    both = [r for r in rows if r["ratio"] != ""]
    over = [r for r in both if r["ratio"] > 1.0]
    lines = []
    for chip in sorted({r["chip"] for r in rows}):
        mine = [r for r in rows if r["chip"] == chip]
        b = [r for r in mine if r["ratio"] != ""]
        lines.append(
            f"{chip}: {len(mine)} kernels compiled from ours, {len(b)} also from JAX's; ours/JAX's LLO ops: "
            f"min {min((r['ratio'] for r in b), default=0):.3f}, max {max((r['ratio'] for r in b), default=0):.3f}, "
            f"{sum(r['ratio'] > 1 for r in b)} above 1.00"
        )
    if over:
        lines.append("above 1.00: " + ", ".join(f"{r['kernel']} [{r['chip']}] {r['ratio']}" for r in over))
    del both
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    both = [r for r in rows if r["ratio"] != ""]
    if not both:
        return
    chips = sorted({r["chip"] for r in both})
    fig, ax = plt.subplots(figsize=(8, 5))
    for chip in chips:
        xs = [r["jax_ops"] for r in both if r["chip"] == chip]
        ys = [r["ours_ops"] for r in both if r["chip"] == chip]
        ax.scatter(xs, ys, s=12, label=chip, alpha=0.7)
    hi = max(max(r["jax_ops"], r["ours_ops"]) for r in both)
    ax.plot([1, hi], [1, hi], "k--", lw=0.8, label="ours = JAX's")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("JAX's lowering: LLO ops per kernel")
    ax.set_ylabel("our lowering: LLO ops per kernel")
    ax.set_title("TPU instructions after Mosaic (libtpu), per kernel of the TPU suites")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chips", default="v5e,v6e")
    ap.add_argument("-k", dest="select", default=None, help="a pytest -k expression to run a subset")
    ap.add_argument("-n", dest="workers", type=int, default=2)
    args = ap.parse_args()
    rows = table(collect(args.chips, args.select, args.workers))
    if not rows:
        sys.exit("no LLO counts recorded (is libtpu installed? pip install 'jax[tpu]')")
    os.makedirs(RESULTS, exist_ok=True)
    csv_path = os.path.join(RESULTS, "tpu_llo.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(RESULTS, "tpu_llo.png"))
    print(markdown(rows))
    print()
    print(summary(rows))


if __name__ == "__main__":
    main()
