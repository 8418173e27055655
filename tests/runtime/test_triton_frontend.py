"""The shared Triton front-end check (``jax_kernel_runtime.triton.check_frontend``):
Triton's own diagnostic at trace time, no GPU needed; used by jax-triton's
CPU path."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from jax_kernel_runtime.triton import _frontend  # noqa: E402


@triton.jit
def good_kernel(x_ptr, o_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs) * 2.0)


@triton.jit
def pointer_sum_kernel(x_ptr, o_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs) + x_ptr)  # pointer + pointer


SIGNATURE = {"x_ptr": "*fp32", "o_ptr": "*fp32", "BLOCK": "constexpr"}


def test_a_kernel_triton_accepts_passes_and_is_memoized(monkeypatch):
    key = ("good", 64)
    _frontend.check_frontend(good_kernel, SIGNATURE, {"BLOCK": 64}, {}, {"num_warps": 4}, key)
    assert key in _frontend._checked
    calls = []
    monkeypatch.setattr(_frontend, "_make_ir", lambda *a: calls.append(a))
    _frontend.check_frontend(good_kernel, SIGNATURE, {"BLOCK": 64}, {}, {"num_warps": 4}, key)
    assert calls == []  # the same key is not checked twice


def test_a_kernel_triton_rejects_raises_its_diagnostic():
    with pytest.raises(_frontend.TritonFrontendError) as info:
        _frontend.check_frontend(
            pointer_sum_kernel, SIGNATURE, {"BLOCK": 64}, {}, {"num_warps": 4}, ("bad", 64)
        )
    assert "tl.load(x_ptr + offs) + x_ptr" in str(info.value)  # Triton's source excerpt
    assert ("bad", 64) not in _frontend._checked  # a failure is checked again next time


def test_jax_triton_uses_the_shared_check():
    pytest.importorskip("jax_triton")
    from jax_triton._src import frontend

    assert frontend.TritonFrontendError is _frontend.TritonFrontendError
