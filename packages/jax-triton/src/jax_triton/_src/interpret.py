"""Running a ``triton_call`` on the CPU through Triton's interpreter.

The kernel runs inside a ``jax.pure_callback``: the callback receives the
inputs as numpy arrays, allocates the outputs, points the kernel's pointer
parameters at host memory and executes every program of the grid with
jax_kernel_runtime's patched Triton interpreter (no torch, no GPU): the same
one pallas-gpu uses, under the same lock, with bounds checks on every load,
store and atomic.
"""

from __future__ import annotations

import numpy as np

from jax_kernel_runtime import triton as jkr_triton
from jax_triton._src.signature import BoundCall


def run_on_host(
    fn,
    bound: BoundCall,
    grid: tuple[int, int, int],
    out_avals,
    input_output_aliases: dict[int, int],
    inputs,
    debug: bool = False,
):
    """Executes the kernel on host copies of ``inputs``; returns the outputs.

    Outputs start zero-filled (on the GPU they start undefined unless listed
    in ``zeroed_outputs``), aliased outputs start as a copy of their input.
    """
    inputs = [np.array(x, copy=True, order="C") for x in inputs]
    outputs = [np.zeros(a.shape, a.dtype) for a in out_avals]
    for i, o in input_output_aliases.items():
        outputs[o][...] = inputs[i]
        # The kernel sees one buffer for the pair, as on the GPU.
        inputs[i] = outputs[o]
    operands = inputs + outputs
    kwargs, constexprs = {}, set()
    for p in bound.params:
        if p.kind == "buffer":
            kwargs[p.name] = jkr_triton.Pointer(p.type, operands[p.operand])
        elif p.kind == "constexpr":
            kwargs[p.name] = p.value
            constexprs.add(p.name)
        else:
            kwargs[p.name] = p.value
    jkr_triton.interpret(
        fn.fn, grid, kwargs, name=f"triton_call {bound.kernel_name!r}", constexprs=constexprs, debug=debug
    )
    return tuple(outputs)
