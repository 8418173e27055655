"""Why ``plgpu.autotune`` times its configs on a worker thread: the host time
per call of a small jitted function called plainly, from inside a ``jit``
trace under ``jax.ensure_compile_time_eval`` (where the tuner runs when the
tuned function is called under ``jit``), and from a worker thread during that
trace. Runs on any backend (CPU included).

    python benchmarks/autotune_dispatch.py
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp


def per_call_us(f, x, n=2000) -> float:
    jax.block_until_ready(f(x))
    t = time.perf_counter()
    for _ in range(n):
        out = f(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    f = jax.jit(lambda x: x + 1)
    x = jnp.ones((8,))
    res = {"plain": per_call_us(f, x)}

    def outer(y):
        with jax.ensure_compile_time_eval():
            res["inside a jit trace"] = per_call_us(f, x)
        worker = threading.Thread(
            target=lambda: res.__setitem__("worker thread during the trace", per_call_us(f, x))
        )
        worker.start()
        worker.join()
        return y

    jax.jit(outer)(x)
    print(f"host time per call of a jitted x + 1 ({jax.devices()[0].platform}, jax {jax.__version__}):")
    for name, us in res.items():
        print(f"  {name:32s} {us:7.1f} us  ({us / res['plain']:.1f}x plain)")


if __name__ == "__main__":
    main()
