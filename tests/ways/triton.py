"""The ``triton`` way: pallas-gpu's lowering of a kernel to Triton source, run by Triton's
interpreter on the CPU (``pallas_call(interpret=plgpu.InterpretParams())``).

It compares the outputs of the generated Triton kernel with the test's plain-``jnp`` reference at
the host's arithmetic: a check of our GPU lowering without a GPU (the GPU suite's own engine,
``gpu.py``, also compiles the kernel for sm_80/sm_90, or runs it on a GPU). Needs Triton and
pallas-gpu; every pallas-core kernel applies (a gap of the lowering is a strict ``xfail``).
"""

from __future__ import annotations

from .engine import InterpretEngine


class TritonEngine(InterpretEngine):
    name = "triton"

    def interpret(self, way):
        import pallas_gpu as plgpu

        return plgpu.InterpretParams()
