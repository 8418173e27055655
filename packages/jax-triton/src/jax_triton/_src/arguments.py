"""Checking and normalizing ``triton_call``'s arguments at trace time.

Every error starts with ``where`` (``triton_call 'kernel' at file.py:LINE``),
names the argument, and says what was expected. Dtypes are canonicalized as
JAX does (``float64`` -> ``float32`` while x64 is off), so the kernel is
specialized for the data JAX actually passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_kernel_runtime import normalize_grid
from jax_triton._src.compile import CompileOptions
from jax_triton._src.triton_compat import compile_option_names


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _dtype(dtype, what: str):
    try:
        return jax.dtypes.canonicalize_dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"{what} has dtype {dtype!r}, which is not a dtype") from None


def input_aval(x, what: str) -> jax.ShapeDtypeStruct:
    """The aval JAX passes for array input ``x`` (canonical dtype)."""
    return jax.ShapeDtypeStruct(tuple(x.shape), _dtype(x.dtype, what))


def output_avals(out_leaves, where: str, keyword: str = "out_shape") -> tuple[jax.ShapeDtypeStruct, ...]:
    """Checked, canonical avals of the ``out_type`` (``keyword``) leaves."""
    avals = []
    for i, leaf in enumerate(out_leaves):
        what = f"{where}: {keyword} leaf {i}"
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{what} is {leaf!r} of type {type(leaf).__name__}; every leaf must "
                f"have .shape and .dtype (use jax.ShapeDtypeStruct)"
            )
        shape = leaf.shape
        if not isinstance(shape, (tuple, list)) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(
                f"{what} has shape {shape!r}; a shape is a tuple of non-negative "
                f"Python ints (static, not traced)"
            )
        layout = getattr(getattr(leaf, "format", None), "layout", None)
        major_to_minor = getattr(layout, "major_to_minor", None)
        if major_to_minor is not None and tuple(major_to_minor) != tuple(range(len(shape))):
            raise ValueError(
                f"{what} asks for layout major_to_minor={tuple(major_to_minor)}; "
                f"triton_call writes outputs row-major (C-contiguous), "
                f"major_to_minor={tuple(range(len(shape)))}: leave the layout out "
                f"and transpose the result"
            )
        avals.append(jax.ShapeDtypeStruct(tuple(int(d) for d in shape), _dtype(leaf.dtype, what)))
    return tuple(avals)


def check_options(options, where: str) -> None:
    """num_warps / num_stages / num_ctas of one configuration."""
    for field, ok, expected in (
        ("num_warps", lambda v: 1 <= v <= 32 and v & (v - 1) == 0, "a power of 2 from 1 to 32"),
        ("num_stages", lambda v: v >= 0, "an int >= 0"),
        ("num_ctas", lambda v: 1 <= v <= 16 and v & (v - 1) == 0, "a power of 2 from 1 to 16"),
    ):
        value = getattr(options, field)
        if not _is_int(value) or not ok(int(value)):
            raise ValueError(f"{where}: {field}={value!r}, but {field} must be {expected}")


def check_aliases(aliases, inputs, out_avals, counted: str, where: str) -> dict[int, int]:
    """``input_output_aliases`` checked against the inputs and outputs.

    ``inputs``: ``(label, aval)`` for each index the aliases count (``aval``
    None for a scalar, which cannot be aliased); ``counted`` says what they
    count, for the out-of-range error.
    """
    if not isinstance(aliases, dict):
        raise TypeError(
            f"{where}: input_output_aliases is {aliases!r}; expected a dict {{input index: output index}}"
        )
    seen: dict[int, int] = {}
    for i, o in aliases.items():
        entry = f"{where}: input_output_aliases entry {i!r}: {o!r}"
        if not (_is_int(i) and _is_int(o)):
            raise TypeError(f"{entry}: indices must be ints")
        if not 0 <= i < len(inputs):
            raise ValueError(f"{entry}: input index {i} is out of range; {counted}")
        if not 0 <= o < len(out_avals):
            raise ValueError(f"{entry}: output index {o} is out of range; there are {len(out_avals)} outputs")
        if o in seen:
            raise ValueError(f"{entry}: output {o} is already aliased to input {seen[o]}")
        seen[o] = i
        label, a = inputs[i]
        b = out_avals[o]
        if a is None:
            raise ValueError(f"{entry}: {label} is a scalar; only arrays can be aliased to outputs")
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(
                f"{entry}: {label} is {a.dtype}{list(a.shape)} but output {o} is "
                f"{b.dtype}{list(b.shape)}; aliased buffers must match"
            )
    return {int(i): int(o) for i, o in aliases.items()}


def check_zeroed(zeroed, num_outputs: int, where: str) -> set[int]:
    try:
        zeroed = list(zeroed)
    except TypeError:
        raise TypeError(f"{where}: zeroed_outputs is {zeroed!r}; expected output indices") from None
    for z in zeroed:
        if not _is_int(z) or not 0 <= z < num_outputs:
            raise ValueError(
                f"{where}: zeroed_outputs has {z!r}, but outputs are numbered 0..{num_outputs - 1}"
            )
    return {int(z) for z in zeroed}


def grid_of(grid, meta: dict, name: str, where: str) -> tuple[int, int, int]:
    """The grid (callables get the metaparams), padded to 3 axes.

    An axis of 0 programs is allowed (zero-size inputs): the kernel does not
    run, as with Triton's own launcher.
    """
    if callable(grid):
        grid = grid(meta)
    entries = (grid,) if _is_int(grid) else grid
    if isinstance(entries, (tuple, list)) and 1 <= len(entries) <= 3 and all(_is_int(g) for g in entries):
        for axis, g in enumerate(entries):
            if g < 0:
                raise ValueError(f"{where}: grid {tuple(entries)}: entry {axis} is {g}; entries must be >= 0")
        if 0 in entries:
            return cast(tuple[int, int, int], tuple(int(g) for g in entries) + (1,) * (3 - len(entries)))
    try:
        return normalize_grid(grid, name)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


# Options set by the compile target, not by the caller.
_TARGET_OPTIONS = frozenset({"arch", "backend_name", "warp_size"})


def compile_options(explicit: dict, backend_options, debug_asserts: bool, where: str) -> CompileOptions:
    """``backend_options`` merged with the explicit ``num_warps``/... arguments.

    ``explicit`` holds the arguments the caller gave (not None); an option in
    both is an error, as upstream. Options other than those of
    ``CompileOptions`` must be options of Triton's CUDA backend, with
    hashable values (they key the compile caches).
    """
    if backend_options is None:
        backend_options = {}
    if not isinstance(backend_options, Mapping):
        raise TypeError(
            f"{where}: backend_options is {backend_options!r}; expected a mapping of "
            f"Triton compiler options, e.g. {{'num_warps': 8}}"
        )
    if both := sorted(explicit.keys() & backend_options.keys()):
        raise ValueError(
            f"{where}: {both} given both as arguments and in backend_options; give each option once"
        )
    known = compile_option_names() - _TARGET_OPTIONS
    for k, v in backend_options.items():
        if k not in known:
            raise ValueError(
                f"{where}: backend_options[{k!r}] is not a Triton compiler option for CUDA; "
                f"the options are {sorted(known)}"
            )
        try:
            hash(v)
        except TypeError:
            raise TypeError(
                f"{where}: backend_options[{k!r}] is {v!r:.60}, which is not hashable; "
                f"compile options key the kernel caches (use a tuple, not a list)"
            ) from None
    if backend_options.get("launch_pdl"):
        raise NotImplementedError(
            f"{where}: backend_options['launch_pdl']: jax-kernel-runtime does not launch "
            f"kernels with programmatic dependent launch"
        )
    merged = {**backend_options, **explicit}
    fields = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "debug")
    return CompileOptions(
        num_warps=merged.get("num_warps", 4),
        num_stages=merged.get("num_stages", 3),
        num_ctas=merged.get("num_ctas", 1),
        enable_fp_fusion=bool(merged.get("enable_fp_fusion", True)),
        debug=bool(merged.get("debug") or debug_asserts),
        extra=tuple(sorted((k, v) for k, v in merged.items() if k not in fields)),
    )
