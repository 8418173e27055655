"""Device timing and the results writer (CSV + PNG) shared by the GPU benchmarks."""

from __future__ import annotations

import csv
import math
import os
import shutil
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


def measure(cands, rounds=5, min_round_s=0.05):
    """{name: (run, sync)} -> {name: median seconds per call}.

    Each round runs a candidate back to back enough times to last at least
    ``min_round_s``, then syncs once; rounds alternate the candidates' order so
    that drift (clocks, temperature) hits all of them alike.
    """
    n = {}
    for name, (run, sync) in cands.items():
        sync(run())  # warm up (compile, autotune)
        t = time.perf_counter()
        for _ in range(3):
            out = run()
        sync(out)
        n[name] = max(3, min(20000, math.ceil(min_round_s / ((time.perf_counter() - t) / 3))))
    times = {name: [] for name in cands}
    for r in range(rounds):
        for name in list(cands)[:: 1 if r % 2 == 0 else -1]:
            run, sync = cands[name]
            t = time.perf_counter()
            for _ in range(n[name]):
                out = run()
            sync(out)
            times[name].append((time.perf_counter() - t) / n[name])
    return {name: statistics.median(ts) for name, ts in times.items()}


RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Panel:
    """One subplot of ``write_results``' figure: ``y`` against ``x`` over the
    rows whose values match ``where``, one line per value of ``series``."""

    title: str
    x: str
    y: str
    where: Mapping[str, object] = field(default_factory=dict)
    series: str = "impl"
    xlabel: str | None = None  # None: the key x
    ylabel: str | None = None  # None: the key y
    xlog: int | None = 2  # log base of the x axis; None: linear
    ylog: int | None = None


def write_results(
    name, rows, fields, panels, out_dir=RESULTS, dashed=("copy",), panel_size=(5.5, 4)
) -> list[Path]:
    """Writes ``rows`` (dicts keyed by ``fields``) to ``out_dir/name.csv`` and,
    if matplotlib imports, draws ``out_dir/name.png``: ``panels`` is the grid of
    subplots, a list of rows of ``Panel`` (a flat list of ``Panel``: one row).
    A series keeps its colour in every panel; those named in ``dashed`` are
    drawn dashed; a row whose x or y is empty is left off the plot;
    ``panel_size``: inches per subplot (width, height). Prints
    ``wrote <path>`` per file, copies both to ``$OUT`` when set and returns the
    paths. Writes nothing when there are no rows (a failed sweep does not
    overwrite the last results)."""
    if not rows:
        print(f"no rows: {name}.csv not written")
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.csv"]
    with open(paths[0], "w", newline="") as fh:
        w = csv.DictWriter(fh, fields)
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not importable: no {name}.png")
    else:
        grid = [list(p) for p in panels] if panels and not isinstance(panels[0], Panel) else [list(panels)]
        nrows, ncols = len(grid), max(len(r) for r in grid)
        fig, axes = plt.subplots(
            nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False
        )
        colours = {}
        for i, row in enumerate(grid):
            for j in range(ncols):
                ax = axes[i][j]
                if j >= len(row):
                    ax.axis("off")
                    continue
                p = row[j]
                sel = [r for r in rows if all(r.get(k) == v for k, v in p.where.items())]
                for s in dict.fromkeys(r[p.series] for r in sel):
                    pts = sorted(
                        (float(r[p.x]), float(r[p.y]))
                        for r in sel
                        if r[p.series] == s and r[p.x] not in ("", None) and r[p.y] not in ("", None)
                    )
                    if pts:
                        colour = colours.setdefault(s, f"C{len(colours) % 10}")
                        ax.plot(*zip(*pts), marker="o", label=s, color=colour,
                                linestyle="--" if s in dashed else "-")  # fmt: skip
                if p.xlog:
                    ax.set_xscale("log", base=p.xlog)
                if p.ylog:
                    ax.set_yscale("log", base=p.ylog)
                ax.set(title=p.title, xlabel=p.xlabel or p.x, ylabel=p.ylabel or p.y)
                ax.grid(True, alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize=8)
                else:
                    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[1], dpi=110)
        plt.close(fig)
    for p in paths:
        print(f"wrote {p}")
        if os.environ.get("OUT"):
            shutil.copy(p, os.environ["OUT"])
    return paths
