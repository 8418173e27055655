"""``acc + jnp.dot(a, b)`` in a kernel is lowered as one ``tl.dot(a, b, acc)``
(the accumulator stays in the tensor cores: Triton does not fold the add for
fp8 on sm_90 itself), and only where that is the same computation: results
against ``jnp`` on random data through Triton's interpreter (compiled for
sm_80/sm_90 too), or on the GPU with PALLAS_GPU_TESTS=gpu."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import ON_DEVICE, Runner, assert_close, lowered, random
from jax import lax

import pallas as pl

F32 = jnp.float32
FUSED = re.compile(r"tl\.dot\(\w+, \w+, (?!out_dtype|input_precision)\w+")  # tl.dot(a, b, acc, ...)


def k_loop(a, b, combine, out_dtype=F32, steps=4):
    """A k-loop kernel over (64, 64 * steps) @ (64 * steps, 32) whose body is ``combine(acc, a_k, b_k)``."""
    bk = a.shape[1] // steps

    def kernel(a_ref, b_ref, o_ref):
        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            return combine(acc, a_ref[:, pl.ds(k0, bk)], b_ref[pl.ds(k0, bk), :])

        acc = lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, F32))
        o_ref[...] = acc.astype(o_ref.dtype)

    out = jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), out_dtype)
    return Runner().call(kernel, out), pl.pallas_call(kernel, out, interpret=False)


def dot(a, b):
    return jnp.dot(a, b, preferred_element_type=F32)


COMBINES = {
    "acc_plus_dot": lambda acc, a, b: acc + dot(a, b),
    "dot_plus_acc": lambda acc, a, b: dot(a, b) + acc,
    "scaled_acc_plus_dot": lambda acc, a, b: acc * 0.5 + dot(a, b),  # as in flash attention
}


@pytest.mark.parametrize("name", COMBINES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e5m2])  # e4m3 needs sm_89+
def test_accumulating_dot_is_fused(name, dtype):
    a, b = random((64, 256), F32).astype(dtype), random((256, 32), F32).astype(dtype)
    combine = COMBINES[name]
    run, plain = k_loop(a, b, combine)
    src = lowered(plain, a, b).body
    # fp8 fuses only a loop-carried accumulator: fused, acc * 0.5 + dot gave wrong sums on the H200.
    fused = name != "scaled_acc_plus_dot" or jnp.dtype(dtype).itemsize > 1
    assert bool(FUSED.search(src)) == fused, src
    ref = jnp.zeros((64, 32), F32)
    for i in range(4):
        ref = combine(ref, a[:, 64 * i : 64 * (i + 1)].astype(F32), b[64 * i : 64 * (i + 1)].astype(F32))
    rel = 2e-3 if ON_DEVICE else 1e-5
    assert_close(run(a, b), ref, rtol=rel, atol=rel * float(jnp.max(jnp.abs(ref))))


def test_dot_used_twice_is_not_fused():
    # acc + d and d * 2 both need the product: it is computed once, on its own.
    a, b = random((64, 256), jnp.bfloat16), random((256, 32), jnp.bfloat16)

    def combine(acc, a, b):
        d = dot(a, b)
        return acc + d - d * 0.25

    run, plain = k_loop(a, b, combine)
    src = lowered(plain, a, b).body
    assert not FUSED.search(src) and src.count("tl.dot(") == 1, src
    ref = jnp.dot(a.astype(F32), b.astype(F32)) * 0.75
    assert_close(run(a, b), ref, rtol=1e-2, atol=1e-2 * float(jnp.max(jnp.abs(ref))))


def test_low_precision_dot_result_is_not_fused():
    # A bf16 product rounds before the add: folding it into the f32 accumulator would not.
    a, b = random((64, 256), jnp.bfloat16), random((256, 32), jnp.bfloat16)

    def combine(acc, a, b):
        return acc + jnp.dot(a, b, preferred_element_type=jnp.bfloat16).astype(F32)

    run, plain = k_loop(a, b, combine)
    assert not FUSED.search(lowered(plain, a, b).body)
    ref = sum(
        jnp.dot(
            a[:, 64 * i : 64 * (i + 1)], b[64 * i : 64 * (i + 1)], preferred_element_type=jnp.bfloat16
        ).astype(F32)
        for i in range(4)
    )
    assert_close(run(a, b), ref, rtol=1e-2, atol=1e-2 * float(jnp.max(jnp.abs(ref))))
