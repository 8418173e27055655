"""Our public names against JAX's (``jax.experimental.pallas`` and ``.tpu``):
the names we lack are listed here with the reason, so a new JAX name or a
regression shows up as a failing test and the list stays true."""

from __future__ import annotations

import inspect

import pytest

import pallas as pl
import pallas_tpu as pltpu

jpl = pytest.importorskip("jax.experimental.pallas")
jpltpu = pytest.importorskip("jax.experimental.pallas.tpu")

# Names of jax.experimental.pallas.tpu we do not offer, and why.
MISSING_TPU: dict[str, str] = {}
# Names newer JAX releases added to jax.experimental.pallas.tpu (our target is 0.11.2's API).
NEWER_TPU = {
    "ACC": "JAX 0.12",
    "matmul_acc_lhs": "JAX 0.12",
    "matmul_lhs_fifo": "JAX 0.12",
    "matmul_pop": "JAX 0.12",
    "matmul_pop_fifo": "JAX 0.12",
    "matmul_push_rhs": "JAX 0.12",
    "has_memory_space": "JAX 0.12",
    "join_bits": "JAX 0.12",
    "split_bits": "JAX 0.12",
    "pack_fp6": "JAX 0.12",
    "unpack_fp6": "JAX 0.12",
    "request_p_state": "JAX 0.12.1",
}
# Names pallas_tpu has beyond jax.experimental.pallas.tpu (with NEWER_TPU on an older JAX): ours.
OURS_TPU = {
    "AsyncCopyDescriptor": "the descriptor make_async_copy returns, public",
    "CompileCheckError": "compile_check: libtpu missing or an unknown chip",
    "KernelCompile": "compile_check's report of one kernel",
    "MosaicCompileError": "libtpu refused a kernel: its message, the kernel and the user's line",
    "compile_check": "compiles for compile-only TPU devices with libtpu, no TPU needed",
    "EstimateError": "estimate cannot estimate a function for a chip",
    "estimate": "a kernel's time on a chip from libtpu's final bundles, no TPU needed",
    "KernelError": "a TPU interpret-mode kernel's error",
    "MosaicError": "run_mosaic's error",
    "run_mosaic": "runs a Mosaic module on a CPU",
    "mosaic_modules": "the Mosaic modules a function lowers to",
}
# Names of jax.experimental.pallas we do not offer, and why.
MISSING_PL = {
    "pallas_export_experimental": (
        "exports with blocks of symbolic shape: pl.lower_as_mlir(dynamic_shapes=True) refuses them "
        "(tests/core/test_namespace_jax012.py says the same)"
    ),
}


def _public(mod) -> set[str]:
    """Public names, without submodules (``pl.tpu``, ``pl.ops`` appear once imported)."""
    return {n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n))}


def test_tpu_names():
    missing = _public(jpltpu) - _public(pltpu) - set(NEWER_TPU)
    missing -= _deprecated_aliases(pltpu, missing)  # JAX 0.10's create_tensorcore_mesh: ours deprecates it
    print("missing from pallas_tpu:", sorted(missing))
    assert missing == set(MISSING_TPU) - (set(MISSING_TPU) - _public(jpltpu)), sorted(
        missing ^ set(MISSING_TPU)
    )


def test_tpu_additions_are_listed():
    import jax

    if jax.__version_info__ < (0, 11):
        pytest.skip("JAX 0.10 lacks names of 0.11's API (our target), which would count as ours")
    extra = _public(pltpu) - _public(jpltpu) - set(NEWER_TPU)
    extra -= _deprecated_aliases(jpltpu, extra)  # JAX 0.12 answers BufferedRefBase as deprecated
    assert extra <= set(OURS_TPU), sorted(extra - set(OURS_TPU))
    assert set(OURS_TPU) <= _public(pltpu), sorted(set(OURS_TPU) - _public(pltpu))


def _deprecated_aliases(mod, names) -> set[str]:
    """Those of ``names`` that ``mod`` answers through its module ``__getattr__`` (a name moved
    elsewhere, with a ``DeprecationWarning``): JAX 0.10's ``pl.reciprocal``, moved to pltpu in 0.11."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return {n for n in names if hasattr(mod, n)}


def test_pl_names():
    missing = _public(jpl) - _public(pl)
    missing -= _deprecated_aliases(pl, missing)
    print("missing from pallas:", sorted(missing))
    assert missing == set(MISSING_PL) - (set(MISSING_PL) - _public(jpl)), sorted(missing ^ set(MISSING_PL))


@pytest.mark.parametrize(
    "name",
    ["VMEM", "SMEM", "HBM", "SEMAPHORE", "PARALLEL", "ARBITRARY", "CORE_PARALLEL", "SUBCORE_PARALLEL"],
)
def test_constants_have_jax_values(name):
    ours, theirs = getattr(pltpu, name), getattr(jpltpu, name)
    assert str(ours.value) == str(theirs.value)


def test_compiler_params_fields_match():
    import dataclasses

    ours = {f.name for f in dataclasses.fields(pltpu.CompilerParams)}
    theirs = {f.name for f in dataclasses.fields(jpltpu.CompilerParams)}
    assert theirs <= ours, sorted(theirs - ours)
