"""Device timing shared by the GPU benchmarks."""

from __future__ import annotations

import math
import statistics
import time


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
