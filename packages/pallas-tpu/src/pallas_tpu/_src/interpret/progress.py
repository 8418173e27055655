"""Progress lines on stderr while a program with TPU kernels in interpret mode is
traced and compiled.

TPU interpret mode turns each kernel into plain JAX ops of the program that calls
it, so a large kernel's first call is spent tracing it (the interpreter runs in
Python) and in XLA's compile of the whole program, silently. When either takes
longer than ``PALLAS_TPU_PROGRESS_S`` seconds (default 5) a line on stderr says
what is going on, and another when it is done. XLA's compile is seen through JAX's
public monitoring events: ``/jax/core/compile/backend_compile_duration`` is
recorded as a scalar when a compile starts and as a duration when it ends;
``/jax/core/compile/jaxpr_to_mlir_module_duration`` starts each lowering.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TO_MLIR = "/jax/core/compile/jaxpr_to_mlir_module_duration"

_state = threading.local()  # per lowering/compiling thread: kernels interpreted, the compile's timer
_installed = False
_install_lock = threading.Lock()


def progress_seconds() -> float:
    """Seconds before a slow interpret-mode step says what it is doing on stderr
    (``PALLAS_TPU_PROGRESS_S``, default 5)."""
    try:
        return float(os.environ.get("PALLAS_TPU_PROGRESS_S", "5"))
    except ValueError:
        return 5.0


def _say(msg: str) -> None:
    print(f"pallas_tpu: {msg}", file=sys.stderr, flush=True)


def _kernels() -> list[str]:
    if not hasattr(_state, "kernels"):
        _state.kernels = []
    return _state.kernels


def _names(kernels: list[str]) -> str:
    shown = ", ".join(f"'{k}'" for k in kernels[:4])
    return shown + (f" and {len(kernels) - 4} more" if len(kernels) > 4 else "")


class _Watch:
    """Says ``what`` on stderr after ``progress_seconds()`` and then at doubling intervals,
    until stopped; when it said anything, ``stop`` says how long it took."""

    def __init__(self, what: str, again: str):
        self.what, self.again, self.start, self.said = what, again, time.monotonic(), False
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None
        self._arm(progress_seconds())

    def _arm(self, delay: float) -> None:
        if delay <= 0:
            delay = 0.0
        self.timer = threading.Timer(delay, self._fire, args=(max(delay, 1.0),))
        self.timer.daemon = True
        self.timer.start()

    def _fire(self, delay: float) -> None:
        with self.lock:
            if self.timer is None:
                return
            took = f"{time.monotonic() - self.start:.0f} s so far"
            _say(f"{self.again}: {took}" if self.said else f"{self.what} ({took})")
            self.said = True
            self._arm(2 * delay)

    def stop(self, done: str | None = None) -> None:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.said and done:
                _say(f"{done} in {time.monotonic() - self.start:.1f} s")


def _on_scalar(event: str, value, **kwargs) -> None:
    if event == _TO_MLIR:  # a new lowering: kernels of an earlier one (an export) are not in this compile
        _kernels().clear()
    elif event == _BACKEND_COMPILE:
        kernels = list(_kernels())
        _kernels().clear()
        if not kernels:
            return
        n = len(kernels)
        what = (
            f"XLA is compiling a program with {n} TPU kernel{'s' if n > 1 else ''} in interpret mode "
            f"({_names(kernels)}); interpret mode compiles each kernel into the program that calls it, "
            "so a first call takes a while and later calls reuse the compiled program"
        )
        old = getattr(_state, "compile_watch", None)
        if old is not None:
            old.stop()
        _state.compile_watch = _Watch(what, f"XLA is still compiling ({_names(kernels)})")


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == _BACKEND_COMPILE:
        watch = getattr(_state, "compile_watch", None)
        _state.compile_watch = None
        if watch is not None:
            watch.stop("XLA compiled the program with TPU kernels in interpret mode")


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        jax.monitoring.register_scalar_listener(_on_scalar)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _installed = True


@contextlib.contextmanager
def interpreting(kernel_name: str):
    """Around the interpretation of one kernel while its caller is lowered: a
    progress line if tracing it takes long, and the kernel noted for the compile
    that follows."""
    _install()
    watch = _Watch(
        f"tracing TPU kernel '{kernel_name}' for interpret mode (the interpreter runs in Python)",
        f"still tracing TPU kernel '{kernel_name}'",
    )
    try:
        yield
    finally:
        watch.stop(f"traced TPU kernel '{kernel_name}' for interpret mode")
    _kernels().append(kernel_name)
