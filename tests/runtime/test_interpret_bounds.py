"""The shared Triton interpreter (jax_kernel_runtime.triton.interpret) never
reads or writes outside a kernel's argument buffers: a masked-in pointer
outside all of them raises an error naming the kernel, the argument nearest
the pointer and the offset. Triton's own interpreter dereferences raw
addresses, so each case runs in a fresh process: a segfault or a double free
fails the test instead of killing pytest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

TRITON_CALL = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import triton, triton.language as tl
    import jax_triton as jt

    @triton.jit
    def unmasked_copy(x_ptr, o_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs + SHIFT))  # no mask

    @triton.jit
    def store_past_end(x_ptr, o_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + offs * 4096, tl.load(x_ptr + offs))

    @triton.jit
    def atomic_far_away(x_ptr, o_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.atomic_add(o_ptr + offs + 1 + (1 << 40), tl.load(x_ptr + offs), mask=offs < 4)

    case = sys.argv[1]
    x = jnp.arange(1000, dtype=jnp.float32)
    out = jax.ShapeDtypeStruct((1000,), jnp.float32)
    if case == "mask_always_true":  # the last program reads 24 elements past the end
        y = jt.triton_call(x, kernel=unmasked_copy, out_shape=out, grid=4, SHIFT=0, BLOCK=256)
    elif case == "huge_offset":
        y = jt.triton_call(x, kernel=unmasked_copy, out_shape=out, grid=4, SHIFT=1 << 34, BLOCK=256)
    elif case == "negative_offset":
        y = jt.triton_call(x, kernel=unmasked_copy, out_shape=out, grid=4, SHIFT=-100000, BLOCK=256)
    elif case == "store":
        y = jt.triton_call(x, kernel=store_past_end, out_shape=out, grid=1, BLOCK=256)
    elif case == "atomic":
        y = jt.triton_call(x, kernel=atomic_far_away, out_shape=out, grid=1, BLOCK=256)
    jax.block_until_ready(y)
    print("NO ERROR")
    """
)

CASES = {
    # case: (kernel, argument named, offset named)
    "mask_always_true": ("unmasked_copy", "x_ptr", "element offset 1000 "),
    # So far from both buffers that the nearest one may be either.
    "huge_offset": ("unmasked_copy", "", "element offset "),
    "negative_offset": ("unmasked_copy", "x_ptr", "element offset -100000 "),
    "store": ("store_past_end", "o_ptr", "element offset 4096 "),
    "atomic": ("atomic_far_away", "", "element offset "),
}


def run(tmp_path, script: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"  # @triton.jit reads its source from a file
    path.write_text(script)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    return subprocess.run(
        [sys.executable, str(path), *argv], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_call_out_of_bounds_raises(tmp_path, case):
    kernel = CASES[case][0]
    r = run(tmp_path, TRITON_CALL, case)
    assert r.returncode == 1, f"exit {r.returncode} (a negative exit is a crash):\n{r.stderr[-3000:]}"
    assert "OutOfBoundsError" in r.stderr, r.stderr[-3000:]
    op = {"store": "a store", "atomic": "an atomic"}.get(case, "a load")
    assert f"{op} is out of bounds" in r.stderr, r.stderr[-3000:]
    assert f"triton_call '{kernel}', program (" in r.stderr
    # The argument named is the buffer nearest the bad pointer, which depends on
    # where the allocator put the two buffers: either may be named.
    assert re.search(r"element offset -?\d+ from argument '(x_ptr|o_ptr)'", r.stderr), r.stderr[-3000:]
    assert "1000 x float32 = 4000 bytes, valid element offsets 0..999" in r.stderr


PALLAS = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import pallas as pl, pallas_gpu as plgpu
    from pallas_gpu._src.pallas_call_registration import lowered_kernel, run_interpreted

    case = sys.argv[1]
    shift = {"minus_one": -1, "far": 100000}.get(case, 0)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.arange(1 << 20, dtype=jnp.float32)
    f = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
        in_specs=[pl.BlockSpec((1 << 17,), lambda i: (i + shift,))],
        out_specs=pl.BlockSpec((1 << 17,), lambda i: (i,)),
        interpret=plgpu.InterpretParams(),
    )
    if case == "short_buffer":
        # The callback handed a buffer 16x smaller than the kernel was lowered for.
        eqn = [e for e in jax.make_jaxpr(f)(x).jaxpr.eqns if e.primitive.name == "pallas_call"][0]
        gm = eqn.params["grid_mapping"]
        lk = lowered_kernel(eqn.params["jaxpr"], gm)
        run_interpreted(lk, gm, (), plgpu.InterpretParams(), np.zeros(1 << 16, np.float32))
    else:
        y = np.asarray(f(x))
        blocks = np.arange(8) + shift  # out of range: a negative block counts once from the end, then clamps
        blocks = np.clip(np.where(blocks < 0, blocks + 8, blocks), 0, 7)
        want = np.concatenate([np.asarray(x).reshape(8, -1)[b] for b in blocks]) + 1.0
        np.testing.assert_array_equal(y, want)
    print("NO ERROR")
    """
)


def test_pallas_gpu_interpreter_checks_its_buffers(tmp_path):
    r = run(tmp_path, PALLAS, "short_buffer")
    assert r.returncode == 1, f"exit {r.returncode} (a negative exit is a crash):\n{r.stderr[-3000:]}"
    assert "OutOfBoundsError: pallas_call 'kernel' at " in r.stderr, r.stderr[-3000:]
    assert "a load is out of bounds" in r.stderr and "from argument '" in r.stderr
    assert "65536 x float32 = 262144 bytes, valid element offsets 0..65535" in r.stderr


@pytest.mark.parametrize("case", ["minus_one", "far"])
def test_pallas_gpu_out_of_range_index_map_never_touches_foreign_memory(tmp_path, case):
    # Whether the lowering defines such an index map (clamped) or not, the
    # process must not crash: the result is the clamped one, or the clear error.
    r = run(tmp_path, PALLAS, case)
    assert r.returncode in (0, 1), f"exit {r.returncode} (a crash):\n{r.stderr[-3000:]}"
    if r.returncode == 1:
        assert "OutOfBoundsError: pallas_call 'kernel' at " in r.stderr, r.stderr[-3000:]
    else:
        assert r.stdout.strip().endswith("NO ERROR")


PROGRESS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import triton, triton.language as tl
    import jax_triton as jt

    @triton.jit
    def add_one(x_ptr, o_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs) + 1.0)

    x = jnp.arange(64, dtype=jnp.float32)
    y = jt.triton_call(x, kernel=add_one, out_shape=x, grid=16, BLOCK=4)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) + 1.0)
    print("OK")
    """
)


@pytest.mark.parametrize("batch, first", [("1", "1/16"), ("4", "4/16")])
def test_long_interpreted_launch_reports_progress(tmp_path, batch, first):
    # batch 1: one program at a time (Triton's way); 4: passes of 4 programs.
    r = run(
        tmp_path,
        PROGRESS,
        JAX_KERNEL_RUNTIME_INTERPRET_PROGRESS_S="0",
        JAX_KERNEL_RUNTIME_INTERPRET_BATCH=batch,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[jax_kernel_runtime] interpreting")]
    assert lines, r.stderr[-3000:]
    assert f"triton_call 'add_one' on the CPU: {first} programs done in" in lines[0]
    assert "16/16 programs done" in lines[-1] and lines[-1].rstrip().endswith(
        "done (programs run one at a time where they cannot run together; a smaller grid goes faster)"
    )


def test_short_interpreted_launch_is_quiet(tmp_path):
    r = run(tmp_path, PROGRESS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[jax_kernel_runtime] interpreting" not in r.stderr


# ---------------------------------------------------------------------------
# The check itself, on addresses (no memory is touched)


def _bounds(*buffers):
    import numpy as np

    from jax_kernel_runtime.triton._state import Bounds as _Bounds

    return _Bounds("triton_call 'k'", [(n, s, b, np.dtype(np.float32)) for n, s, b in buffers]), np


def test_check_accepts_inside_and_masked_off_pointers():
    b, np = _bounds(("x", 4096, 64), ("alias_of_x", 4096, 64), ("y", 8192, 16))
    b.check("load", np.array([4096, 4156, 8192, 8204], np.uint64), None, 4)
    b.check("load", np.array([4096, 99, 2**64 - 4], np.uint64), np.array([True, False, False]), 4)


@pytest.mark.parametrize(
    ("ptr", "arg", "where"),
    [
        (4160, "x", "element offset 16 "),  # one past the end
        (4158, "x", "byte offset 62 "),  # straddles the end
        (4092, "x", "element offset -1 "),
        (2**64 - 4, "y", "element offset "),  # wraps around: must not pass as "inside"
        (8208, "y", "element offset 4 "),
    ],
)
def test_check_names_the_nearest_argument_and_the_offset(ptr, arg, where):
    from jax_kernel_runtime.triton._state import OutOfBoundsError

    b, np = _bounds(("x", 4096, 64), ("y", 8192, 16))
    with pytest.raises(OutOfBoundsError, match=f"from argument '{arg}'") as e:
        b.check("store", np.array([4096, ptr], np.uint64), None, 4)
    assert "triton_call 'k', program (0, 0, 0): a store is out of bounds: 1 of its 2 masked-in" in str(
        e.value
    )
    assert where in str(e.value)


def test_zero_size_buffer_and_no_buffers():
    from jax_kernel_runtime.triton._state import OutOfBoundsError

    b, np = _bounds(("empty", 4096, 0))
    with pytest.raises(
        OutOfBoundsError, match=r"'empty' \(the nearest buffer: 0 x float32 = 0 bytes, empty\)"
    ):
        b.check("load", np.array([4096], np.uint64), None, 4)
    b, np = _bounds()
    with pytest.raises(
        OutOfBoundsError, match="accesses address 0x1000, but the kernel has no pointer arguments"
    ):
        b.check("atomic", np.array([4096], np.uint64), None, 4)
