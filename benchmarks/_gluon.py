"""Compiling a Gluon kernel for sm_90 without a GPU and reporting what
decides its speed: registers, spills, shared memory, wgmma waits,
``setmaxnreg`` and whether ptxas serialized the wgmmas (C7514). Shared by
``gluon_attention.py --compile`` and ``gluon_matmul.py --compile``."""

from __future__ import annotations

import re
import subprocess
import tempfile


def compile_report(fn, signature: dict, constexprs: dict, num_warps: int, label: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except Exception as e:  # noqa: BLE001
        print(f"{label}: FAILED {type(e).__name__}: {str(e)[:3000]}")
        return
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True)  # fmt: skip
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", k.asm["ptx"])
    setmaxnreg = re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])
    print(f"{label}: {k.metadata.num_warps} warps, shared {k.metadata.shared} B, registers {regs}, "
          f"spill stores {spills} B, wgmma waits {waits[:8]}, setmaxnreg {sorted(set(setmaxnreg))}, "
          f"wgmma serialized by ptxas (C7514): {'C7514' in out.stderr}")  # fmt: skip
