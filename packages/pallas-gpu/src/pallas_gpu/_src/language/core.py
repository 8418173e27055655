"""pallas-gpu's backend types: ``CompilerParams`` and ``InterpretParams``."""

from __future__ import annotations

import dataclasses

import pallas as pl
from pallas import backend as plb


@dataclasses.dataclass(frozen=True)
class CompilerParams(pl.CompilerParams):
    """Options for compiling a Pallas kernel with Triton.

    Args:
      num_warps: warps per program (a power of two, 1 to 32).
      num_stages: software-pipelining stages of loops that load from memory.
      num_ctas: CTAs per cluster (Hopper and newer).
      enable_fp_fusion: let the compiler fuse multiply-adds.
      debug: compile with Triton's device-side assertions.
      use_tma: read and write the blocks of input/output Refs through Hopper's
        Tensor Memory Accelerator (device-side ``tl.make_tensor_descriptor``
        loads and stores) wherever an access allows it: a dense tile whose dims
        are powers of two of at most 256 elements, the last one at least 16
        bytes, in an array whose leading strides are multiples of 16 bytes.
        Other accesses keep pointer arithmetic. Out-of-bounds parts of a tile
        read as zero and are not written, as the masked path does. TMA is
        Hopper's (sm_90+); on earlier GPUs Triton compiles the descriptors to
        ordinary loads and stores. Runs anywhere under ``plgpu.InterpretParams()``.
      warp_specialize: ask Triton to warp-specialize the kernel's outermost
        loops (``tl.range(..., warp_specialize=True)``: producer warps issue
        the loads while consumer warps compute). Blackwell (sm_100+) only;
        compiling for an earlier GPU is an error that says why: Triton 3.6's
        Hopper pass (num_warps=4: a producer and two consumer warpgroups)
        miscompiled plain Triton attention kernels on the H200 (wrong causal
        masks, NaN with 128x64 tiles) and rejects the reshaped 4-D blocks this
        backend loads for squeezed block dims.

    ``use_tma`` and ``warp_specialize`` change the generated kernel, so all the
    configs of one autotuned ``pallas_call`` (a list of ``CompilerParams``)
    must agree on them; tune them with ``plgpu.autotune`` instead.
    """

    PLATFORM = "cuda"
    num_warps: int = 4
    num_stages: int = 3
    num_ctas: int = 1
    enable_fp_fusion: bool = True
    debug: bool = False
    use_tma: bool = False
    warp_specialize: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self, where: str = "plgpu.CompilerParams") -> None:
        """Raises ValueError naming ``where`` if a field is out of range.

        Runs on construction, and again when a ``pallas_call`` is lowered
        (params restored without ``__init__``, e.g. unpickled, are checked
        there, with the kernel's name).
        """
        nw = self.num_warps
        if not isinstance(nw, int) or nw < 1 or nw > 32 or nw & (nw - 1):
            raise ValueError(
                f"{where}: num_warps must be a power of two between 1 and 32 "
                f"(at most 1024 threads per program), got {nw!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"{where}: num_stages must be a positive int, got {self.num_stages!r}")
        if not isinstance(self.num_ctas, int) or self.num_ctas < 1:
            raise ValueError(f"{where}: num_ctas must be a positive int, got {self.num_ctas!r}")
        for name in ("enable_fp_fusion", "debug", "use_tma", "warp_specialize"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # enable_fp_fusion="False" is truthy
                raise plb.ValueOrTypeError(
                    f"{where}: {name} must be True or False, got {value!r} ({type(value).__name__})"
                )

    def source_options(self) -> tuple[tuple[str, bool], ...]:
        """The fields that change the generated kernel (not only its compilation)."""
        return (("use_tma", self.use_tma), ("warp_specialize", self.warp_specialize))

    def compile_options(self) -> dict:
        return {
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "num_ctas": self.num_ctas,
            "enable_fp_fusion": self.enable_fp_fusion,
            "debug": self.debug,
        }


@dataclasses.dataclass(frozen=True)
class InterpretParams:
    """Run the generated Triton kernel on the CPU through Triton's interpreter.

    ``pallas_call(..., interpret=plgpu.InterpretParams())`` lowers the kernel
    exactly as for a GPU, then executes the generated Triton source under
    ``triton``'s interpreter on host buffers (any platform, no GPU needed).

    Args:
      uninitialized: what outputs hold before the kernel writes them:
        ``"nan"`` (NaN for floats, the smallest int for ints: makes reads of
        never-written memory visible) or ``"zero"``.
    """

    uninitialized: str = "nan"

    def __post_init__(self):
        if self.uninitialized not in ("nan", "zero"):
            raise ValueError(
                f"plgpu.InterpretParams: uninitialized must be 'nan' or 'zero', got {self.uninitialized!r}"
            )
