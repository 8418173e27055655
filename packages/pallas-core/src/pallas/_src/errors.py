"""Error messages that name the kernel, the culprit and the user's line."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import types

import jax

_PALLAS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))
_SKIP_DIRS: list[str] = [_PALLAS_DIR, _JAX_DIR, os.path.dirname(os.__file__)]


# absolute filename -> is_internal(filename): asked for the frames of every equation a backend lowers.
_internal: dict[str, bool] = {}


def register_internal_dir(path: str) -> None:
    """Backends add their package dir so user_source() skips their frames."""
    _SKIP_DIRS.append(os.path.dirname(os.path.abspath(path)))
    _internal.clear()


def is_internal(filename: str) -> bool:
    known = _internal.get(filename)
    if known is not None:
        return known
    path = os.path.abspath(filename)
    internal = any(path.startswith(d + os.sep) for d in _SKIP_DIRS) or (
        "contextlib" in path or path.startswith("<")
    )
    if path == filename:  # a relative name depends on the working directory: not kept
        _internal[filename] = internal
    return internal


def user_source() -> str:
    """'file.py:LINE' of the innermost frame outside pallas/JAX/stdlib."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if not is_internal(frame.f_code.co_filename):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def describe(kernel_name: str | None, source: str | None) -> str:
    """How messages name a kernel: ``pallas_call 'name' at file.py:12``."""
    where = f" at {source}" if source else ""
    return f"pallas_call '{kernel_name}'{where}" if kernel_name else f"pallas{where}"


# The kernel being traced, so that errors raised from inside the kernel body
# (a bad Ref store, program_id out of range) can name it.
_tls = threading.local()


def current_kernel() -> tuple[str, str] | None:
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


class kernel_scope:
    def __init__(self, name: str, source: str):
        self.entry = (name, source)

    def __enter__(self):
        if not hasattr(_tls, "stack"):
            _tls.stack = []
        _tls.stack.append(self.entry)

    def __exit__(self, *exc):
        _tls.stack.pop()


def kernel_error(cls: type[Exception], msg: str) -> Exception:
    """An exception raised while tracing a kernel body: names the kernel and
    the user's line inside the kernel."""
    k = current_kernel()
    name = k[0] if k else None
    where = user_source()
    prefix = f"in kernel '{name}' " if name else ""
    return cls(f"{prefix}at {where}: {msg}")


def is_internal_file(filename: str) -> bool:
    """True for files of JAX, pallas, registered backends and the stdlib: frames
    that error messages skip when naming the user's line."""
    return is_internal(filename)


class ValueOrTypeError(ValueError, TypeError):
    """A misuse that JAX's Pallas reports as ``ValueError`` where pallas-core has
    raised ``TypeError`` (an index map returning floats or arrays): catchable as
    either, so code written against either keeps working."""


def function_source(fn) -> str:
    """``name at file.py:LINE`` of a user function (JAX's ``func_src_info``), for
    messages that say what JAX's Pallas says; partials are unwrapped."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    if code is None:
        return name
    return f"{name} at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"


def python_arity_message(fn, n: int) -> str | None:
    """What Python says when ``fn`` is called with ``n`` positional arguments it
    cannot take (``f() missing 2 required positional arguments: 'i' and 'j'``),
    or None when it can take them."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    star = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    name = f"{getattr(fn, '__qualname__', None) or function_source(fn).split(' ')[0]}()"
    if n < len(required):
        missing = [f"'{p.name}'" for p in required[n:]]
        listed = (
            missing[0]
            if len(missing) == 1
            else ", ".join(missing[:-1]) + f"{',' if len(missing) > 2 else ''} and {missing[-1]}"
        )
        plural = "s" if len(missing) > 1 else ""
        return f"{name} missing {len(missing)} required positional argument{plural}: {listed}"
    if n > len(positional) and not star:
        takes = (
            len(positional)
            if len(required) == len(positional)
            else f"from {len(required)} to {len(positional)}"
        )
        plural = "" if takes == 1 else "s"
        was = "was" if n == 1 else "were"
        return f"{name} takes {takes} positional argument{plural} but {n} {was} given"
    return None


# Errors raised while a kernel runs, inside a host callback (TPU interpret mode's bounds
# checks, a deadlock between interpreted devices): XLA wraps them in a JaxRuntimeError
# whose first line is "INTERNAL: CpuCallback error calling callback: Traceback ...", the
# message last. A backend records the exception it raises there; a pallas_call called
# outside jit finds it in the JaxRuntimeError and raises it as it was, message first.
# (Callbacks run on XLA's threads, hence one list for all threads; the last few only.)
_runtime_errors: list[BaseException] = []
_runtime_lock = threading.Lock()


def record_runtime_error(exc: BaseException) -> BaseException:
    """Remembers ``exc``, an error a host callback of a running kernel raises."""
    with _runtime_lock:
        _runtime_errors.append(exc)
        del _runtime_errors[:-16]
    return exc


def runtime_error_in(wrapper: BaseException) -> BaseException | None:
    """The recorded error that ``wrapper`` (XLA's JaxRuntimeError) carries, if any;
    forgotten once found."""
    text = str(wrapper)
    if "callback" not in text.lower():
        return None
    with _runtime_lock:
        for i in range(len(_runtime_errors) - 1, -1, -1):
            if str(_runtime_errors[i]) and str(_runtime_errors[i]) in text:
                return _runtime_errors.pop(i)
    return None


class _RecordedErrorFilter(logging.Filter):
    """Drops JAX's "jax.debug.callback failed" log record (a traceback on stderr) of an
    error a kernel's host callback raised and recorded: the error itself reaches the
    caller (message first, see ``runtime_error_in``), so a caller that catches it sees
    nothing on stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        with _runtime_lock:
            return not any(e is exc for e in _runtime_errors)


for _logger in ("jax._src.debugging", "jax._src.callback"):
    logging.getLogger(_logger).addFilter(_RecordedErrorFilter())
