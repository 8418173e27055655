"""The disk caches of the shared Triton layer: compiled kernels and
autotuning winners, for pallas-gpu and jax-triton alike.

A ``DiskCache`` is one directory, named by its owner (``PALLAS_GPU_CACHE_DIR``
for pallas-gpu, ``JAX_TRITON_AUTOTUNE_DIR`` for jax-triton's winners). Its
files are never trusted: every entry carries a hash of its content (or is
checked against its key) and anything that does not parse, does not match or
is out of range is a miss, rewritten by the next write. A directory that
cannot be written (read-only, or a path through a file) costs only the
cache: one warning per directory, then the process runs uncached.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from jax_kernel_runtime._call import tune_records
from jax_kernel_runtime._config import KernelConfig

_warned: set[str] = set()
_warn_lock = threading.Lock()


def write_atomically(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that readers see all of it or nothing."""
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class DiskCache:
    """One cache directory: ``directory()`` resolves it on each use (the
    environment may change), ``enabled()`` says whether to use it at all."""

    def __init__(self, label: str, directory: Callable[[], str], enabled: Callable[[], bool] = lambda: True):
        self.label = label
        self.directory = directory
        self.enabled = enabled

    def path(self, *parts: str) -> str | None:
        """The file for ``parts`` under the cache, or None when disabled."""
        if not self.enabled():
            return None
        return os.path.join(self.directory(), *parts)

    def read(self, *parts: str) -> bytes | None:
        path = self.path(*parts)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:  # missing, unreadable, or a path through a file
            return None

    def write(self, data: bytes, *parts: str) -> bool:
        """Writes an entry; on failure warns once per directory and returns False."""
        path = self.path(*parts)
        if path is None:
            return False
        try:
            write_atomically(path, data)
            return True
        except OSError as e:
            self._warn_unwritable(e)
            return False

    def _warn_unwritable(self, error: OSError) -> None:
        root = self.directory()
        with _warn_lock:
            if root in _warned:
                return
            _warned.add(root)
        warnings.warn(
            f"{self.label}: cannot write to the cache directory {root!r} "
            f"({type(error).__name__}: {error.strerror or error}); running without the disk "
            "cache (kernels are compiled again in each process). Point the cache variable at a "
            "writable directory to keep them.",
            RuntimeWarning,
            stacklevel=4,
        )


def sha256(*parts: Any) -> str:
    """The hex SHA-256 of ``parts`` (as ``str``), joined by NUL: a cache key."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()


# ---------------------------------------------------------------------------
# Compiled kernels: one file per key, holding the launch fields and the image

_MAGIC = b"jax_kernel_runtime kernel v1\n"
_configs: dict[str, KernelConfig] = {}
_configs_lock = threading.Lock()


def encode_config(cfg: KernelConfig, key: str) -> bytes:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "image"}
    fields["image_sha256"] = hashlib.sha256(cfg.image).hexdigest()
    fields["key"] = key
    return _MAGIC + json.dumps(fields, sort_keys=True).encode() + b"\n" + cfg.image


def decode_config(data: bytes | None, key: str) -> KernelConfig | None:
    """The ``KernelConfig`` in a cache file, or None unless it is a whole,
    valid entry written for ``key`` (truncated, edited or foreign: a miss)."""
    if not data or not data.startswith(_MAGIC):
        return None
    header, sep, image = data[len(_MAGIC) :].partition(b"\n")
    if not sep:
        return None
    try:
        fields = json.loads(header.decode("utf-8"))
        if fields.pop("key") != key or fields.pop("image_sha256") != hashlib.sha256(image).hexdigest():
            return None
        for name in ("block_dims", "cluster_dims"):
            fields[name] = tuple(fields[name])
        return KernelConfig(image=image, **fields)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def cached_config(
    key: str, compile_config: Callable[[], KernelConfig], disk: DiskCache | None
) -> KernelConfig:
    """The config for ``key``: from memory, else from ``disk``, else
    ``compile_config()`` (then stored in both)."""
    with _configs_lock:
        cfg = _configs.get(key)
    if cfg is not None:
        return cfg
    parts = ("kernels", key[:2], key + ".bin")
    cfg = decode_config(disk.read(*parts), key) if disk is not None else None
    if cfg is None:
        cfg = compile_config()
        if disk is not None:
            disk.write(encode_config(cfg, key), *parts)
    with _configs_lock:
        _configs[key] = cfg
    return cfg


def clear_configs() -> None:
    """Forgets the compiled configs held in memory (the disk stays)."""
    with _configs_lock:
        _configs.clear()


# ---------------------------------------------------------------------------
# Autotuning winners

_pending: dict[str, WinnerCache] = {}  # tune keys handed to the runtime -> who records them
_seen_records = 0
_records_lock = threading.Lock()


def parse_winner(data: bytes | None, num_configs: int | None = None) -> int | None:
    """The ``chosen`` index of a winner file, or None for anything that is not
    ``{"chosen": <int in range>, ...}`` (``[1, 2]``, ``null``, ``-1``,
    ``1e400``, bytes that are not UTF-8...)."""
    if data is None:
        return None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    chosen = obj.get("chosen") if isinstance(obj, dict) else None
    if type(chosen) is not int or chosen < 0 or (num_configs is not None and chosen >= num_configs):
        return None
    return chosen


class WinnerCache:
    """Winning config indices by tune key, in memory and as
    ``<disk>/<subdir>/<key>.json`` (written atomically)."""

    def __init__(self, disk: DiskCache, subdir: str = "autotune"):
        self.disk = disk
        self.subdir = subdir
        self.winners: dict[str, int] = {}
        self.lock = threading.Lock()

    def _parts(self, key: str) -> tuple[str, ...]:
        return (self.subdir, key + ".json") if self.subdir else (key + ".json",)

    def lookup(self, key: str, num_configs: int | None = None) -> int | None:
        """The recorded winner for ``key`` (memory, then disk); None if there is
        none, or none in ``range(num_configs)``."""
        flush_records()
        with self.lock:
            chosen = self.winners.get(key)
        if chosen is None:
            chosen = parse_winner(self.disk.read(*self._parts(key)))
            if chosen is not None:
                with self.lock:
                    self.winners[key] = chosen
        if chosen is None or (num_configs is not None and chosen >= num_configs):
            return None
        return chosen

    def record(self, key: str, chosen: int, times_ms: Sequence[float] = ()) -> None:
        with self.lock:
            self.winners[key] = chosen
        with _records_lock:
            _pending.pop(key, None)
        times = [float(t) if t == t and abs(float(t)) != float("inf") else -1.0 for t in times_ms]
        self.disk.write(json.dumps({"chosen": int(chosen), "times_ms": times}).encode(), *self._parts(key))

    def expect(self, key: str) -> None:
        """``key`` was given to the runtime as a ``tune_key``: the next
        ``flush_records`` records its result here."""
        with _records_lock:
            _pending[key] = self

    def forget(self) -> None:
        """Forgets the winners held in memory (what a new process sees)."""
        with self.lock:
            self.winners.clear()


def flush_records() -> None:
    """Moves the runtime's new tuning results to the caches that expect them
    (results for keys nobody expects are left alone)."""
    global _seen_records
    with _records_lock:
        if not _pending:
            return
    records = tune_records()
    with _records_lock:
        start = _seen_records if _seen_records <= len(records) else 0
        new, _seen_records = records[start:], len(records)
        ours = [(r, _pending[r[0]]) for r in new if r[0] in _pending]
    for (key, _device, chosen, times), cache in ours:
        cache.record(key, chosen, times)


# The runtime tunes at the first execution, after lowering: a process that
# runs a tuned call once and exits records it here.
atexit.register(flush_records)
