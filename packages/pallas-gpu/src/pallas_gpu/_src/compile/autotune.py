"""Autotuning: the winner cache, and ``plgpu.autotune`` for block-size choices.

Two ways to tune a kernel:

* ``compiler_params=[plgpu.CompilerParams(...), ...]`` on one ``pallas_call``:
  the configs share the generated kernel and differ only in compile options.
  jax_kernel_runtime times each on its first execution on a device and keeps
  the fastest; the winner is then recorded here (memory and disk), so later
  lowerings, in this process or another, compile and launch only the winner.
* ``plgpu.autotune(fn, configs=[dict(block_m=64, ...), ...])``: one
  ``pallas_call`` per config (different block shapes, grids and
  ``CompilerParams``). The first call with given shapes on a GPU times each
  config and dispatches to the fastest from then on.

Winners live in ``$PALLAS_GPU_CACHE_DIR/autotune/<key>.json`` (written
atomically), keyed by everything the choice depends on: the kernel (or the
tuned function), the configs, how they are timed (``repeats``,
``min_batch_s``), the argument shapes and dtypes and the device.
``PALLAS_GPU_DISABLE_CACHE=1`` keeps them in memory only.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jax_kernel_runtime import triton as jkr_triton

# The winner cache is the shared one of jax_kernel_runtime, in pallas-gpu's
# cache directory (``compiler.DISK``, created on first use).
_winner_cache: jkr_triton.WinnerCache | None = None


def winners() -> jkr_triton.WinnerCache:
    global _winner_cache
    if _winner_cache is None:
        # Imported on use: ``import pallas_gpu`` stays free of Triton.
        from pallas_gpu._src.compile import compiler

        _winner_cache = jkr_triton.WinnerCache(compiler.DISK, "autotune")
    return _winner_cache


def lookup_winner(key: str, num_configs: int | None = None) -> int | None:
    """The recorded winning config index for ``key`` (memory, then disk);
    None if none is recorded in ``range(num_configs)``."""
    return winners().lookup(key, num_configs)


def record_winner(key: str, chosen: int, times_ms: Sequence[float] = ()) -> None:
    winners().record(key, chosen, times_ms)


def expect_tuning(key: str) -> None:
    """``key`` was passed to the runtime as a ``tune_key``; its result is
    recorded by the next ``flush_records``."""
    winners().expect(key)


flush_records = jkr_triton.flush_records
sha256 = jkr_triton.sha256


# ---------------------------------------------------------------------------
# plgpu.autotune


# A tuning that runs longer than this many seconds says so on stderr (which function, how many
# configs, and at the end the pick and the time it took).
PROGRESS_AFTER_S = 1.0


def _default_device() -> jax.Device:
    return jax.devices()[0]


def _on_gpu() -> bool:
    return _default_device().platform == "gpu"


def _device_name() -> str:
    d = _default_device()
    cc = getattr(d, "compute_capability", "")
    return f"{d.platform}:{d.device_kind}:{cc}"


def _aval_key(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{tuple(x.shape)}:{np.dtype(x.dtype).name}"
    return repr(x)  # a Python scalar: its value is part of the call


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _timing_data(x, i: int):
    """A concrete stand-in for a traced argument: normal random floats;
    zeros for ints and bools (they are often indices: zero is always valid)."""
    if not (_is_tracer(x) or isinstance(x, jax.ShapeDtypeStruct)):
        return x
    dtype = np.dtype(x.dtype)
    if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
        data = np.random.default_rng(i).standard_normal(x.shape, np.float32).astype(dtype)
    else:
        data = np.zeros(x.shape, dtype)
    return jax.device_put(data)


def interleaved_times(
    fns: Sequence[Callable[..., Any]],
    args: Sequence[Any],
    warmup: int = 1,
    repeats: int = 5,
    min_batch_s: float = 2e-3,
) -> tuple[list[float], list[tuple[int, Exception]]]:
    """(median seconds per call of each of ``fns`` on ``args``, inf for one that
    raised; [(index, exception)] of those).

    Each function is compiled and warmed up first. Then ``repeats`` rounds each
    time every function in turn (the order alternating between rounds, so that
    clock and temperature drift hits all alike) over a batch of calls issued back
    to back and waited for once, long enough to last ``min_batch_s``: one synced
    call of a kernel of a few hundred microseconds also times the host's dispatch
    and wait, tens of microseconds that vary from call to call. (Callers time from
    a thread outside any trace: see ``Autotuned._tune``.)"""
    batch: dict[int, int] = {}
    errors: list[tuple[int, Exception]] = []
    for i, f in enumerate(fns):
        try:
            for _ in range(1 + warmup):
                jax.block_until_ready(f(*args))
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            batch[i] = max(1, min(1000, math.ceil(min_batch_s / max(time.perf_counter() - t, 1e-7))))
        except Exception as e:  # noqa: BLE001 - a config that cannot run loses
            errors.append((i, e))
    samples: dict[int, list[float]] = {i: [] for i in batch}
    for r in range(repeats):
        for i in list(batch)[:: 1 if r % 2 == 0 else -1]:
            f, t = fns[i], time.perf_counter()
            for _ in range(batch[i]):
                out = f(*args)
            jax.block_until_ready(out)  # one stream: the last call ends after the others
            samples[i].append((time.perf_counter() - t) / batch[i])
    times = [float(np.median(samples[i])) if i in samples else float("inf") for i in range(len(fns))]
    return times, errors


class WrongResult(Exception):
    """A config's output failed the ``check`` of ``plgpu.autotune``."""


class Autotuned:
    """A function tuned over ``configs``; see ``plgpu.autotune``."""

    def __init__(self, fn, configs, key, name, warmup, repeats, timer, min_batch_s=2e-3, check=None):
        if not configs or not all(isinstance(c, dict) for c in configs):
            raise ValueError(f"plgpu.autotune({_fn_name(fn)}): configs must be a non-empty list of dicts")
        if isinstance(min_batch_s, bool) or not isinstance(min_batch_s, (int, float)) or not min_batch_s > 0:
            raise ValueError(
                f"plgpu.autotune({_fn_name(fn)}): min_batch_s must be a positive number of seconds; "
                f"got {min_batch_s!r}"
            )
        self.fn = fn
        self.configs = [dict(c) for c in configs]
        self.key = key
        self.name = name or _fn_name(fn)
        self.warmup = warmup
        self.repeats = repeats
        self.timer = timer
        if check is not None and not callable(check):
            raise ValueError(
                f"plgpu.autotune({_fn_name(fn)}): check must be a callable check(out, *args, **kwargs) -> bool "
                f"or None; got {check!r}"
            )
        self.min_batch_s = min_batch_s
        self.check = check
        self.times: dict[str, list[float]] = {}  # tune key -> seconds per config (inf: failed)
        # How the configs are timed (and whether their outputs are checked) is part of the key:
        # a winner picked from short bursts is not reused by a tuner that asks for sustained
        # batches, nor an unchecked one by a tuner that checks.
        self._identity = sha256(
            self.name, _source_hash(fn), [sorted(c.items()) for c in self.configs], repeats, min_batch_s,
            check is not None,
        )  # fmt: skip
        self._jitted: dict[tuple[int, str], Callable] = {}
        self._lock = threading.Lock()
        self._background: dict[str, threading.Thread] = {}  # tune key -> its running background tuning
        functools.update_wrapper(self, fn)

    def tune_key(self, *args, **kwargs) -> str:
        """The key the winner for these arguments is stored under."""
        if self.key is not None:
            bucket = repr(self.key(*args, **kwargs))
        else:
            leaves, tree = jax.tree.flatten(args)
            bucket = f"{tree}|{[_aval_key(x) for x in leaves]}"
        return sha256(self._identity, bucket, sorted(kwargs.items()), _device_name())

    def best_index(self, *args, **kwargs) -> int:
        """Index of the config used for these arguments (tunes if needed)."""
        if self.timer is None and not _on_gpu():
            return 0  # CPU / interpret mode: timings would say nothing about a GPU
        key = self.tune_key(*args, **kwargs)
        winner = lookup_winner(key, len(self.configs))
        if winner is not None:
            return winner
        with self._lock:
            winner = lookup_winner(key, len(self.configs))
            if winner is None:
                winner = self._tune(key, args, kwargs)
        return winner

    def recorded_index(self, *args, **kwargs) -> int | None:
        """Index of the config a finished tuning picked for these arguments (in
        this process, or kept on disk by an earlier one); None if none has run.
        Never tunes (0 without a GPU, as ``best_index``)."""
        if self.timer is None and not _on_gpu():
            return 0
        return lookup_winner(self.tune_key(*args, **kwargs), len(self.configs))

    def tune_in_background(self, *args, **kwargs) -> None:
        """Starts the tuning for these arguments' shapes on a thread of its own
        and returns at once (nothing when a winner is known or that tuning is
        running). The timing runs beside whatever the caller puts on the GPU, so
        its ranking is noisier than ``best_index``'s; the winner is recorded as
        any other (``recorded_index`` finds it once known). A process that exits
        first waits for the tuning to end."""
        key = self.tune_key(*args, **kwargs)
        with self._lock:
            if key in self._background or lookup_winner(key, len(self.configs)) is not None:
                return
            # stand-ins of the shapes: the thread keeps neither tracers nor the caller's arrays
            leaves, tree = jax.tree.flatten(args)
            shapes = jax.tree.unflatten(
                tree, [jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "dtype") else x for x in leaves]
            )

            def work():
                try:
                    best = self._time_configs(key, shapes, kwargs)
                    print(
                        f"plgpu.autotune({self.name}): background tuning for {self._shapes(shapes)} picked "
                        f"config {best} {self.configs[best]}",
                        file=sys.stderr,
                        flush=True,
                    )
                except Exception as e:  # noqa: BLE001 - the caller has moved on: say it, keep its config
                    print(
                        f"plgpu.autotune({self.name}): background tuning for {self._shapes(shapes)} failed "
                        f"({type(e).__name__}: {e}); the configuration in use stays",
                        file=sys.stderr,
                        flush=True,
                    )
                finally:
                    with self._lock:
                        self._background.pop(key, None)

            thread = threading.Thread(
                target=work, name=f"plgpu.autotune({self.name}) background", daemon=True
            )
            self._background[key] = thread
            _BACKGROUND.add(thread)
            thread.start()

    def best_config(self, *args, **kwargs) -> dict:
        """The config used for these arguments (tunes if needed)."""
        return dict(self.configs[self.best_index(*args, **kwargs)])

    def _tune(self, key: str, args, kwargs) -> int:
        # Inside jit this runs at trace time. The configs run on a worker thread, which has
        # no trace: run from inside one (under ensure_compile_time_eval), each call of a jitted
        # function would take JAX's Python dispatch path, slow enough to be timed instead of
        # a sub-millisecond kernel.
        result: dict[str, Any] = {}

        def work():
            try:
                result["best"] = self._time_configs(key, args, kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                result["error"] = e

        what = f"plgpu.autotune({self.name}): timing {len(self.configs)} configs for {self._shapes(args)}"
        said = threading.Event()

        def say():
            said.set()
            print(f"{what} (once per shape; the pick is kept on disk) ...", file=sys.stderr, flush=True)

        start = time.perf_counter()
        progress = threading.Timer(PROGRESS_AFTER_S, say)
        progress.daemon = True
        progress.start()
        worker = threading.Thread(target=work, name=f"plgpu.autotune({self.name})", daemon=True)
        try:
            worker.start()
            worker.join()
        finally:  # an interrupted join (Ctrl-C) leaves no progress line to print later
            progress.cancel()
        if said.is_set():
            took = time.perf_counter() - start
            ending = (
                f"config {result['best']} {self.configs[result['best']]}" if "best" in result else "failed"
            )
            print(f"{what}: {ending}, after {took:.1f} s", file=sys.stderr, flush=True)
        if "error" in result:
            raise result["error"]
        return result["best"]

    @staticmethod
    def _shapes(args) -> str:
        return ", ".join(_aval_key(x) for x in jax.tree.leaves(args))

    def _wrong_results(self, data, kwargs) -> list[tuple[int, Exception]]:
        """[(index, WrongResult)] of the configs whose output on ``data`` fails
        ``check`` (a config that cannot run is left to the timing to report)."""
        wrong: list[tuple[int, Exception]] = []
        for i in range(len(self.configs)):
            try:
                out = self._jit(i, kwargs)(*data)
            except Exception:  # noqa: BLE001 - reported by the timing, as a config that cannot run
                continue
            try:
                ok = bool(self.check(out, *data, **kwargs))
                why = "its output fails the check"
            except Exception as e:  # noqa: BLE001 - a check that raises rejects the output
                ok, why = False, f"the check raised {type(e).__name__}: {e}"
            if not ok:
                wrong.append((i, WrongResult(f"config {i} {self.configs[i]}: {why}")))
                print(
                    f"plgpu.autotune({self.name}): config {i} {self.configs[i]} gave a wrong result for "
                    f"{self._shapes(data)} ({why}); it is left out",
                    file=sys.stderr,
                    flush=True,
                )
        return wrong

    def _time_configs(self, key: str, args, kwargs) -> int:
        leaves, tree = jax.tree.flatten(args)
        data = jax.tree.unflatten(tree, [_timing_data(x, i) for i, x in enumerate(leaves)])
        errors = self._wrong_results(data, kwargs) if self.check is not None else []
        wrong = {i for i, _ in errors}
        timed = [i for i in range(len(self.configs)) if i not in wrong]
        times = [float("inf")] * len(self.configs)
        if self.timer is None:
            ts, errs = interleaved_times(
                [self._jit(i, kwargs) for i in timed],
                data,
                warmup=self.warmup,
                repeats=self.repeats,
                min_batch_s=self.min_batch_s,
            )
            for i, t in zip(timed, ts):
                times[i] = t
            errors += [(timed[j], e) for j, e in errs]
        else:
            for i in timed:
                try:
                    times[i] = float(self.timer(self._jit(i, kwargs), data))
                except Exception as e:  # noqa: BLE001 - a config that cannot run loses
                    errors.append((i, e))
        self.times[key] = times
        best = int(np.argmin(times))
        if times[best] == float("inf"):
            i, first = min(errors, key=lambda ie: ie[0])
            raise RuntimeError(
                f"plgpu.autotune({self.name}): every config failed; config {i} "
                f"{self.configs[i]} raised {type(first).__name__}: {first}"
            ) from first
        record_winner(key, best, [t * 1e3 if np.isfinite(t) else -1.0 for t in times])
        return best

    def _jit(self, i: int, kwargs) -> Callable:
        k = (i, repr(sorted(kwargs.items())))
        f = self._jitted.get(k)
        if f is None:
            f = self._jitted[k] = jax.jit(functools.partial(self.fn, **kwargs, **self.configs[i]))
        return f

    def __call__(self, *args, **kwargs):
        i = self.best_index(*args, **kwargs)
        if any(_is_tracer(x) for x in jax.tree.leaves(args)):
            return self.fn(*args, **kwargs, **self.configs[i])
        return self._jit(i, kwargs)(*args)


# Background tunings still running when the interpreter exits are waited for: a thread
# stopped in the middle of a GPU call at shutdown can take the process down with it.
_BACKGROUND: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_background() -> None:
    for thread in list(_BACKGROUND):
        thread.join()


def _fn_name(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def _source_hash(fn) -> str:
    try:
        return sha256(inspect.getsource(fn))
    except (OSError, TypeError):
        return ""


def autotune(
    fn: Callable | None = None,
    *,
    configs: Sequence[dict[str, Any]],
    key: Callable[..., Any] | None = None,
    name: str | None = None,
    warmup: int = 1,
    repeats: int = 5,
    timer: Callable[[Callable, Sequence[Any]], float] | None = None,
    min_batch_s: float = 2e-3,
    check: Callable[..., bool] | None = None,
):
    """Picks the fastest of several configurations of a kernel, per shape.

    ``fn(*args, **kwargs, **config)`` computes the result with one config
    (typically it builds a ``pallas_call`` whose block shapes, grid and
    ``plgpu.CompilerParams`` come from ``config``). The returned function
    takes ``(*args, **kwargs)``; on its first call with given argument
    shapes and dtypes on a GPU it runs every config (jitted, ``warmup`` runs,
    then ``repeats`` rounds that time each config in turn over a batch of
    back-to-back calls of at least ``min_batch_s``, the order alternating; the
    median counts: ``interleaved_times``), keeps the fastest in memory and on disk,
    and from then on calls only that one. Inside ``jit`` it tunes at trace
    time on random data of the traced shapes (zeros for integer inputs).
    A config that fails (too much shared memory, say) is skipped. A tuning
    that takes longer than a second prints a line to stderr when it starts
    and one with its pick when it ends.

    On a machine without a GPU (CPU, interpret mode) no timing is done: the
    first config is used.

    Args:
      fn: the function to tune (or use ``@plgpu.autotune(configs=...)``).
      configs: dicts of keyword arguments for ``fn``, one per candidate.
      key: ``key(*args, **kwargs)`` -> a hashable value; calls with equal
        keys share one tuning result. Default: the shapes and dtypes of the
        arguments and the values of ``kwargs`` (which must be hashable).
      name: identifies ``fn`` in the disk cache and messages (default: its
        module and qualified name).
      warmup, repeats: warm-up runs and timed rounds per config.
      timer: ``timer(jitted_fn, args) -> seconds``, replacing the built-in
        timing (also on the CPU).
      min_batch_s: the shortest timed batch, in seconds. A GPU can run a short
        burst at a higher clock than a sustained load; batches as long as a
        real workload's steps rank the configs as that workload sees them.
      check: ``check(out, *args, **kwargs) -> bool``, whether a config's
        output on the tuning data is right (say, close to a plain-jnp
        reference). A config whose output fails it, or whose check raises, is
        left out of the timing, with a line on stderr: a compiler can
        miscompile one launch configuration of a correct kernel (Triton 3.6
        gave NaN for some on the H200). ``pallas_gpu.ops.matmul`` checks its
        candidates against an f32 XLA dot.

    Returns:
      An ``Autotuned`` callable; ``.best_config(*args)`` says which config it
      uses for those arguments, ``.times`` holds the measured seconds.
    """
    if fn is None:
        return functools.partial(
            autotune,
            configs=configs,
            key=key,
            name=name,
            warmup=warmup,
            repeats=repeats,
            timer=timer,
            min_batch_s=min_batch_s,
            check=check,
        )
    return Autotuned(fn, configs, key, name, warmup, repeats, timer, min_batch_s, check)
