"""Every public name of JAX's Pallas modules (``pl``, ``pltpu`` and the Triton
backend's ``plgpu``) that ours lacks has its reason written here.

The names are those of the installed JAX and, so that the test means the same
on every JAX we support, JAX 0.12.0.1's (``JAX_0_12``, checked in: ``dir()`` of
its modules, submodules left out) and the two JAX 0.12.1 added (``JAX_0_12_1_ADDED``). A name missing from ours and from
``MISSING`` fails the test; so does a ``MISSING`` entry ours now has."""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest

JAX_0_12 = {
    "pl": """ANY BlockDim BlockSpec Blocked BoundedSlice Buffered CompilerParams CostEstimate Element
        GridSpec HOST Indirect MemoryRef MemorySpace RevisitMode Slice Squeezed align_to broadcast_to cdiv
        debug_check debug_print delay ds dslice empty empty_like empty_ref_like enable_debug_checks
        enable_poison_buffers estimate_cost get_global kernel loop lower_as_mlir multiple_of next_power_of_2
        no_block_spec num_programs pallas_call pallas_call_p pallas_export_experimental program_id run_scoped
        run_state select_ref semaphore semaphore_read semaphore_signal semaphore_wait squeezed
        strides_from_shape when with_scoped""",
    "tpu": """ACC ARBITRARY BufferType BufferedRef CMEM CORE_PARALLEL ChipVersion CompilerParams CoreType
        GridDimensionSemantics HBM InterpretParams LoweringException MemorySpace PARALLEL PipelineStep
        PrefetchScalarGridSpec SEMAPHORE SMEM SUBCORE_PARALLEL SemaphoreType SideEffectType TensorCoreMesh
        Tiling TpuInfo VMEM VMEM_SHARED annotate async_copy async_remote_copy bitcast conv core_barrier
        dma_semaphore einshape emit_pipeline emit_pipeline_with_allocations emit_pipeline_with_async_prefetch
        force_tpu_interpret_mode get_barrier_semaphore get_tpu_info get_tpu_info_for_chip has_memory_space
        is_tpu_device join_bits load make_async_copy make_async_remote_copy matmul_acc_lhs matmul_lhs_fifo
        matmul_pop matmul_pop_fifo matmul_push_rhs pack_elementwise pack_fp6 prng_random_bits prng_seed
        reciprocal reset_tpu_interpret_mode_state roll run_on_first_core sample_block set_tpu_interpret_mode
        split_bits stateful_bernoulli stateful_bits stateful_normal stateful_uniform stochastic_round store
        sync_copy to_pallas_key touch trace_value unpack_elementwise unpack_fp6 with_memory_space_constraint""",
    "triton": """CUSTOM_CALL_TARGET_NAME CompilerParams GpuInfo GpuVersion approx_tanh atomic_add atomic_and
        atomic_cas atomic_max atomic_min atomic_or atomic_xchg atomic_xor debug_barrier dot
        elementwise_inline_asm get_gpu_info get_gpu_info_from_version is_gpu_device load max_contiguous
        store""",
}

# The names JAX 0.12.1 added to those of 0.12.0 (its wheel, read with ``dir()`` of its
# modules: pl.pad_ref, pltpu.request_p_state); CI's newest installable JAX is 0.12.0.1.
JAX_0_12_1_ADDED = {"pl": "pad_ref", "tpu": "request_p_state", "triton": ""}

# (module, name) -> why ours does not offer it.
MISSING = {
    ("pl", "pallas_export_experimental"): (
        "blocks of symbolic shape in exports: pl.lower_as_mlir(dynamic_shapes=True) refuses them"
    ),
}

OURS = {"pl": "pallas", "tpu": "pallas_tpu", "triton": "pallas_gpu"}
JAX = {
    "pl": "jax.experimental.pallas",
    "tpu": "jax.experimental.pallas.tpu",
    "triton": "jax.experimental.pallas.triton",
}


def _public(mod) -> set[str]:
    return {n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n))}


def _answers(mod, name: str) -> bool:
    """Whether ``mod`` has ``name``, a deprecated alias (module ``__getattr__``) included."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            getattr(mod, name)
        except (AttributeError, NotImplementedError):
            return False
    return True


def _jax_names(key: str) -> set[str]:
    names = set(JAX_0_12[key].split()) | set(JAX_0_12_1_ADDED[key].split())
    try:
        names |= _public(importlib.import_module(JAX[key]))
    except ImportError:  # JAX's Triton backend module needs nothing more, but be safe
        pass
    return names


@pytest.mark.parametrize("key", ["pl", "tpu", "triton"])
def test_every_jax_name_is_ours_or_has_its_reason(key):
    ours = pytest.importorskip(OURS[key])
    missing = {n for n in _jax_names(key) if not _answers(ours, n)}
    unexplained = sorted(n for n in missing if (key, n) not in MISSING)
    assert not unexplained, (
        f"{OURS[key]} lacks these names of JAX's {JAX[key]}: {unexplained}; "
        "add them, or write the reason in MISSING"
    )


@pytest.mark.parametrize("key", ["pl", "tpu", "triton"])
def test_missing_list_stays_true(key):
    ours = pytest.importorskip(OURS[key])
    stale = sorted(n for (k, n) in MISSING if k == key and _answers(ours, n))
    assert not stale, f"{OURS[key]} now has {stale}: remove them from MISSING"
    assert all(n in _jax_names(k) for (k, n) in MISSING if k == key)


def test_the_0_12_1_names_are_jaxs_where_installed():
    import jax

    if jax.__version_info__ < (0, 12, 1):
        pytest.skip(f"JAX {jax.__version__} is installed; pad_ref and request_p_state are JAX 0.12.1's")
    for key, module in JAX.items():
        assert set(JAX_0_12_1_ADDED[key].split()) <= _public(importlib.import_module(module)), key


def test_the_checked_in_list_is_jax_012s_where_installed():
    import jax

    if jax.__version_info__[:3] != (0, 12, 0):
        pytest.skip(f"JAX {jax.__version__} is installed; the list is JAX 0.12.0's")
    for key, module in JAX.items():
        assert _public(importlib.import_module(module)) == set(JAX_0_12[key].split()), key
