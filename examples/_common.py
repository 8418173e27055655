"""Helpers shared by the example scripts: backend choice, sizes, timing, result check.

Every example prints one result line in the form

    <name>: PASS  max_abs_err=1.2e-07 (tol 1e-05)  time=3.21 ms (median of 5, cpu-interpret)

and exits 1 when the check fails; `run_all.py` reads that line for its summary table.
"""

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Backend:
    """How the examples call `pallas_call` on this machine."""

    name: str  # "gpu" (compiled by pallas_gpu) or "cpu-interpret"
    interpret: bool
    # pallas_gpu.CompilerParams when compiling for a GPU
    compiler_params_cls: Any = None

    def call_kwargs(self, **gpu_params) -> dict[str, Any]:
        """Keyword arguments for `pl.pallas_call`: `interpret=True`, or the GPU compiler params.

        `gpu_params` (e.g. `num_warps=4, num_stages=3`) are used only when compiling for a GPU.
        """
        if self.interpret:
            return {"interpret": True}
        if gpu_params and self.compiler_params_cls is not None:
            return {"compiler_params": self.compiler_params_cls(**gpu_params)}
        return {}


def _pick_backend() -> Backend:
    # Compile for the GPU only when one is the default device *and* the GPU backend package is
    # installed; anything else (no GPU, no pallas-gpu, a pallas-gpu that is not usable yet)
    # falls back to interpret mode on the CPU, which needs nothing but pallas-core.
    if jax.default_backend() == "gpu":
        try:
            import pallas_gpu
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
            print(f"note: GPU present but `import pallas_gpu` failed ({e!r}); using interpret mode")
        else:
            return Backend(
                "gpu",
                interpret=False,
                compiler_params_cls=getattr(pallas_gpu, "CompilerParams", None),
            )
    return Backend("cpu-interpret", interpret=True)


def use_cpu_for_tpu_interpret() -> bool:
    """TPU kernels off a TPU run in TPU interpret mode, which models a TPU on the
    CPU: make the CPU the default device (on a GPU machine the interpreted
    program would otherwise run on the GPU, with its own f32 dot precision).
    Returns True when not on a TPU."""
    if jax.default_backend() == "tpu":
        return False
    jax.config.update("jax_default_device", jax.devices("cpu")[0])
    return True


def tpu_backend() -> tuple[Backend, dict[str, Any]]:
    """How a TPU example calls `pallas_call`: compiled by Mosaic on a TPU (no keyword),
    anywhere else in TPU interpret mode on the CPU (`interpret=pltpu.InterpretParams()`),
    which simulates VMEM, DMAs and semaphores."""
    if not use_cpu_for_tpu_interpret():
        return Backend("tpu", interpret=False), {}
    import pallas_tpu as pltpu

    return Backend("tpu-interpret", interpret=True), {"interpret": pltpu.InterpretParams()}


def setup(
    description: str, sizes: dict[str, dict[str, Any]], *, tpu: bool = False
) -> tuple[Backend, dict[str, Any]]:
    """Parses `--size`/`--runs`, picks the backend and prints it.

    Args:
      description: one line shown by `--help`.
      sizes: `{"small": {...}, "large": {...}}` problem sizes. The default is `large` on a GPU
        and `small` in interpret mode, so every example finishes in seconds on a laptop CPU.
      tpu: a TPU example: off a TPU it runs in TPU interpret mode on the CPU.

    Returns:
      The backend and the chosen size dict, with `runs` (timed repetitions) added.
    """
    if tpu:
        backend = tpu_backend()[0]
    else:
        backend = _pick_backend()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--size",
        choices=sorted(sizes),
        default=None,
        help="problem size (default: large on GPU, small in interpret mode)",
    )
    parser.add_argument("--runs", type=int, default=None, help="timed repetitions")
    args = parser.parse_args()
    size = args.size or ("small" if backend.interpret else "large")
    runs = args.runs or (3 if backend.interpret else 20)
    config = dict(sizes[size], runs=runs)
    print(f"backend: {backend.name}  (jax {jax.__version__}, device {jax.devices()[0]})")
    print(f"size: {size}  " + "  ".join(f"{k}={v}" for k, v in sizes[size].items()))
    return backend, config


def time_ms(fn: Callable[..., Any], *args: Any, runs: int) -> float:
    """Median wall time of `fn(*args)` in milliseconds, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check_and_report(
    name: str,
    out: jax.Array,
    expected: jax.Array,
    *,
    tol: float,
    ms: float,
    runs: int,
    backend: Backend,
) -> None:
    """Prints the result line and exits with status 1 if `out` is not within `tol` of `expected`."""
    if out.shape != expected.shape:
        print(f"{name}: FAIL  shape {out.shape} != expected {expected.shape}")
        sys.exit(1)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))
    ok = bool(np.isfinite(err)) and err <= tol
    print(
        f"{name}: {'PASS' if ok else 'FAIL'}  max_abs_err={err:.3g} (tol {tol:g})  "
        f"time={ms:.3f} ms (median of {runs}, {backend.name})"
    )
    if not ok:
        sys.exit(1)
