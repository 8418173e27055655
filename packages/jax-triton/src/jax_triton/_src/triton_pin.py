"""The Triton build jax-triton-bridge was validated against, checked at import.

jax-triton-bridge pins one Triton build: the release (``triton==3.6.0`` in
pyproject.toml), its git commit, and the sha256 of ``triton/_C/libtriton.so`` in
the PyPI wheel. At import the installed Triton is compared with it; a difference
is a ``RuntimeWarning`` that names the installed build and the exact fix.

The check is cheap: the version comes from the installed metadata, a
``libtriton.so`` of another size differs without hashing, and the file's sha256
(about 400 MB, 0.5 s) is computed once per installation and kept under
jax-kernel-runtime's cache directory, keyed by the file's path, size and mtime.
``JAX_TRITON_PIN_CHECK=0`` turns the check off (for a deliberate other build).

Also checked at import: the upstream ``jax-triton`` distribution installs the
same ``jax_triton`` package, so with both installed the files on disk are a mix
of the two; that is an ``ImportError`` saying which one to uninstall.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import sys
import warnings
from importlib import metadata

VALIDATED_TRITON_VERSION = "3.6.0"
# The commit of Triton's v3.6.0 release tag (github.com/triton-lang/triton).
VALIDATED_TRITON_COMMIT = "7c56a5e40f7fd928dfd5c72902d5def0097db73a"
# sha256 of triton/_C/libtriton.so in the PyPI wheel triton-3.6.0, by (CPython tag,
# machine): libtriton.so is a CPython extension, so each wheel has its own. Taken from
# the RECORD of the installed cp312 manylinux x86_64 wheel (urlsafe base64, as pip
# records it) and checked against the file. For other wheels only the version is checked.
VALIDATED_LIBTRITON = {
    ("cp312", "x86_64"): ("KNqqcKkE5Pit11TlGFM-imm5SrixZDHOd9RfHyUoK4c", 415617000),
}

# Upstream jax-triton releases are 0.4.x and older. This package was called
# "jax-triton" (0.5.0) in development checkouts before it was renamed: those
# editable installs are not upstream's.
_UPSTREAM = "jax-triton"
_OUR_OLD_NAME_FROM = (0, 5)

_checked = False


def _record_hash(hexdigest: str) -> str:
    return base64.urlsafe_b64encode(bytes.fromhex(hexdigest)).rstrip(b"=").decode()


def _libtriton_path() -> str | None:
    try:
        dist = metadata.distribution("triton")
    except metadata.PackageNotFoundError:
        return None
    path = str(dist.locate_file("triton/_C/libtriton.so"))
    return path if os.path.exists(path) else None


def _cache_dir() -> str:
    from jax_kernel_runtime.triton import key_memo_dir

    return key_memo_dir()


def libtriton_sha256(path: str) -> str:
    """The sha256 of ``path`` (urlsafe base64 without padding, as in a wheel's
    RECORD), memoized on disk by the file's path, size, mtime and inode."""
    st = os.stat(path)
    stamp = f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    name = hashlib.sha256(stamp.encode()).hexdigest()[:32]
    memo = os.path.join(_cache_dir(), f"libtriton-sha256-{name}.json")
    try:
        with open(memo, encoding="utf-8") as f:
            entry = json.load(f)
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    except (OSError, ValueError):  # missing, unreadable or damaged: hash again
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = _record_hash(h.hexdigest())
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"stamp": stamp, "sha256": digest}, f)
        os.replace(tmp, memo)
    except OSError:  # an unwritable cache only costs the hash next time
        pass
    return digest


def pin_problem() -> str | None:
    """Why the installed Triton is not the validated build, or None if it is
    (or if the build cannot be told apart here: a wheel without a recorded hash)."""
    try:
        installed = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "triton is not installed"
    if installed != VALIDATED_TRITON_VERSION:
        return f"triton {installed} is installed"
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    expected = VALIDATED_LIBTRITON.get((tag, platform.machine()))
    path = _libtriton_path()
    if expected is None or path is None:
        return None
    digest, size = expected
    if os.path.getsize(path) != size:
        return f"triton {installed} is installed, but its libtriton.so ({path}) is not the release wheel's (size {os.path.getsize(path)}, expected {size})"
    actual = libtriton_sha256(path)
    if actual != digest:
        return f"triton {installed} is installed, but its libtriton.so ({path}) is not the release wheel's (sha256 {actual}, expected {digest})"
    return None


def fix_command(problem: str) -> str:
    if problem.startswith(f"triton {VALIDATED_TRITON_VERSION} "):  # right version, other build
        return f'pip install --force-reinstall --no-deps --only-binary=:all: "triton=={VALIDATED_TRITON_VERSION}"'
    return f'pip install "triton=={VALIDATED_TRITON_VERSION}"'


def check_upstream_not_installed() -> None:
    """Raises ImportError when upstream jax-triton is installed beside us."""
    try:
        upstream = metadata.version(_UPSTREAM)
    except metadata.PackageNotFoundError:
        return
    try:
        major_minor = tuple(int(p) for p in upstream.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    if major_minor >= _OUR_OLD_NAME_FROM:
        return
    raise ImportError(
        f"jax-triton {upstream} (the upstream project) and jax-triton-bridge are both installed. "
        "Both install the `jax_triton` package, so its files are now a mix of the two. Fix: "
        "pip uninstall -y jax-triton jax-triton-bridge && pip install jax-triton-bridge"
    )


def check_triton_pin() -> None:
    """Warns once per process when the installed Triton is not the pinned
    build (version, or libtriton.so of the release wheel)."""
    global _checked
    if _checked or os.environ.get("JAX_TRITON_PIN_CHECK", "1") == "0":
        return
    _checked = True
    problem = pin_problem()
    if problem is None:
        return
    warnings.warn(
        f"jax_triton was validated with triton=={VALIDATED_TRITON_VERSION} (git "
        f"{VALIDATED_TRITON_COMMIT[:12]}, the PyPI wheel), but {problem}; kernels may fail to "
        f"compile or run. Fix: {fix_command(problem)} (or JAX_TRITON_PIN_CHECK=0 to keep this "
        "Triton and silence this warning).",
        RuntimeWarning,
        stacklevel=4,
    )


def check_at_import() -> None:
    check_upstream_not_installed()
    check_triton_pin()
