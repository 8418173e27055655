"""A TPU kernel's speed without a TPU: ``pltpu.estimate``.

``estimate(f, *args, chip="v5e")`` compiles ``jax.jit(f)`` for a compile-only TPU of that
generation with libtpu (as ``pltpu.compile_check`` does), reads libtpu's final bundles of
every HLO instruction of the program (each Pallas kernel and each XLA op around them) and
runs them through ``pallas_tpu._src.mosaic.bundles.simulate``: the scalar unit exactly
(so the grid loop, ``pl.when`` branches and the pipeline's guards take the paths they take
on the chip), one bundle a cycle, stalls at DMA waits (DMAs through the chip's HBM
bandwidth) and at MXU result pops (each MXU a queue of passes). The report per kernel: the
time, the time per grid step and the number of steps, what bounds a step, VMEM and SMEM
used against the chip's, the unhidden pipeline prologue and epilogue, the overlays.

Every constant of a chip is in ``CHIPS`` with its source; the ones fitted on the v5e's
measurements say so. Validated on the v5e: ``benchmarks/tpu_estimate.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import re
import shutil
import tempfile
from typing import Any

from pallas_tpu._src import prefetch_values as prefetch_lib
from pallas_tpu._src.mosaic import bundles as bundles_lib
from pallas_tpu._src.mosaic import code_size as code_size_lib
from pallas_tpu._src.mosaic import compile_check as cc


class EstimateError(cc.CompileCheckError):
    """``estimate`` cannot estimate this function for this chip: no TPU kernel in it, an
    unknown chip, a kernel that is not a TPU kernel, libtpu missing."""


# --- the chips -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's constants, per chip unless named per core, each with its source
    in ``sources``."""

    name: str
    clock_hz: float
    tensorcores: int  # per chip
    mxus: int  # per TensorCore
    mxu_width: int  # an MXU is mxu_width x mxu_width
    mxu_rows_per_cycle: float  # rows of the left operand an MXU takes a cycle
    peak_bf16_flops: float  # per chip
    hbm_bytes_per_s: float  # per chip
    vmem_bytes: int  # per TensorCore
    smem_bytes: int  # per TensorCore
    granule_bytes: int  # the unit of DMA sizes in the bundles
    delay_slots: int  # bundles after a taken branch that still run
    hbm_efficiency: float  # the share of hbm_bytes_per_s a kernel's DMAs reach
    xla_op_us: float  # per XLA op beside the kernels (its launch)
    sources: dict[str, str]
    # From a DMA's issue to its first bytes moving (HBM's latency, the descriptor, the
    # completion's signal): a step that waits on a DMA it just issued waits this long.
    dma_latency_us: float = 1000 / 1.5e9 * 1e6

    def machine(self, cores_per_device: int) -> bundles_lib.Machine:
        share = cores_per_device / self.tensorcores  # a device's share of the chip's HBM
        per_cycle = self.hbm_bytes_per_s * self.hbm_efficiency * share / self.clock_hz
        # Two cores of one device (megacore) each run half the grid and share its HBM.
        return bundles_lib.Machine(
            mxu_width=self.mxu_width,
            mxu_rows_per_cycle=self.mxu_rows_per_cycle,
            hbm_bytes_per_cycle=per_cycle / cores_per_device,
            granule_bytes=self.granule_bytes,
            delay_slots=self.delay_slots,
            dma_latency_cycles=round(self.dma_latency_us * 1e-6 * self.clock_hz),
        )

    def core_peak_flops(self) -> float:
        return self.peak_bf16_flops / self.tensorcores


_GCLOUD = "Google Cloud TPU docs, 'TPU {}' system architecture page"
_LIBTPU = "libtpu's own output: {}"
_FIT_V5E = (
    "fitted on 8 kernels measured on the v5e (benchmarks/tpu_gmm_schedule.py --validate, "
    "max error 2.8%); other chips: assumed the v5e's"
)
_FIT_V5E_RUN = (
    "fitted on the 19 kernels of benchmarks/tpu_estimate.py measured on the v5e on 2026-12-07 "
    "(over 130 us): 600/800/1000/1500 cycles gave 14/14/15/15 within 10 %, rms error "
    "0.110/0.105/0.099/0.116; 1000 cycles at 1.5 GHz; other chips: assumed the v5e's in time"
)
_DERIVED_CLOCK = (
    "derived: peak bf16 FLOP/s / (TensorCores x MXUs x 2 x width^2 x rows/cycle); Google "
    "publishes no clock for this chip"
)


def _chip(*numbers, **notes: str) -> Chip:
    """The ``Chip`` of ``numbers`` (its fields in order, less ``sources``) with ``notes`` as the
    sources of its constants; those taken from the Google Cloud page (peak FLOP/s, HBM bandwidth,
    MXU count) or read from libtpu's output default to the words of their figures."""
    facts = dict(zip((f.name for f in dataclasses.fields(Chip)), numbers))
    gcloud = _GCLOUD.format(facts["name"])
    mxus = facts["mxus"]
    mxu_names = f"mxu0..mxu{mxus - 1}" if mxus > 2 else " and ".join(f"mxu{i}" for i in range(mxus))
    defaults = {
        "mxus": f"{gcloud}; libtpu's bundles name {mxu_names}",
        "peak_bf16_flops": f"{gcloud}: {round(facts['peak_bf16_flops'] / 1e12)} TFLOP/s",
        "hbm_bytes_per_s": f"{gcloud}: {round(facts['hbm_bytes_per_s'] / 1e9)} GB/s",
        "vmem_bytes": _LIBTPU.format(f"vmem_report's vmem_capacity, {facts['vmem_bytes'] >> 20} MiB"),
        "smem_bytes": "JAX's pltpu.get_tpu_info (smem_capacity_bytes)",
        "granule_bytes": _LIBTPU.format(f"size_in_granules of a DMA of a known block: {facts['granule_bytes']} B"),
        "delay_slots": _LIBTPU.format(f"the bundles after a loop's back branch: {facts['delay_slots']}"),
        "dma_latency_us": _FIT_V5E_RUN,
    }  # fmt: skip
    sources = {**defaults, **notes}
    named = [f.name for f in dataclasses.fields(Chip) if f.name != "sources"]
    return Chip(**facts, sources={f: sources[f] for f in named if f in sources})


#: Every generation libtpu compiles for (``compile_check.TOPOLOGIES``), with its constants.
CHIPS: dict[str, Chip] = {
    "v4": _chip("v4", 1.05e9, 2, 4, 128, 1.0, 275e12, 1228e9, 16 << 20, 1 << 20, 512, 1, 0.78, 0.7,
        clock_hz="1050 MHz: Jouppi et al., 'TPU v4: An Optically Reconfigurable Supercomputer', ISCA 2023, Table 1",
        tensorcores=_GCLOUD.format("v4") + " (2 TensorCores, 4 MXUs each)",
        mxu_width="128x128: ISCA 2023 paper; libtpu's weight pushes of 128 lanes",
        mxu_rows_per_cycle="derived: 275 TFLOP/s = 2 x 4 x 2 x 128^2 x 1.05 GHz x 1",
        hbm_bytes_per_s=_GCLOUD.format("v4") + ": 1228 GB/s (JAX's tpu_info: 1.23e12)",
    ),
    "v5e": _chip("v5e", 1.5e9, 1, 4, 128, 1.0, 197e12, 819e9, 128 << 20, 1 << 20, 32, 4, 0.78, 0.7,
        clock_hz=_DERIVED_CLOCK + ": 197e12 / (1 x 4 x 2 x 128^2 x 1) = 1.50 GHz",
        tensorcores=_GCLOUD.format("v5e") + " (one TensorCore, 4 MXUs)",
        mxu_width="128x128: libtpu's weight pushes of 128 lanes",
        mxu_rows_per_cycle="assumed 1 (a systolic array takes a row a cycle), which gives the 1.5 GHz clock",
        hbm_efficiency=_FIT_V5E + ": 640 of 819 GB/s",
        xla_op_us=_FIT_V5E,
    ),
    "v5p": _chip("v5p", 1.75e9, 2, 4, 128, 1.0, 459e12, 2765e9, 64 << 20, 1 << 20, 32, 4, 0.78, 0.7,
        clock_hz=_DERIVED_CLOCK + ": 459e12 / (2 x 4 x 2 x 128^2 x 1) = 1.75 GHz",
        tensorcores=_GCLOUD.format("v5p") + " (2 TensorCores, 4 MXUs each; one JAX device: megacore)",
        mxu_width="128x128: libtpu's weight pushes of 128 lanes",
        mxu_rows_per_cycle="assumed 1, as the v5e",
    ),
    "v6e": _chip("v6e", 1.75e9, 1, 2, 256, 2.0, 918e12, 1640e9, 128 << 20, 1 << 20, 32, 4, 0.78, 0.7,
        clock_hz=_DERIVED_CLOCK + ": 918e12 / (1 x 2 x 2 x 256^2 x 2) = 1.75 GHz",
        tensorcores=_GCLOUD.format("v6e") + " (one TensorCore, two 256x256 MXUs)",
        mxu_width=_GCLOUD.format("v6e") + ": 256x256",
        mxu_rows_per_cycle="assumed 2: one row a cycle would need a 3.5 GHz clock for 918 TFLOP/s",
    ),
    "7x": _chip("7x", 2.2e9, 2, 2, 256, 2.0, 2307e12, 7370e9, 64 << 20, 1 << 20, 32, 6, 0.78, 0.7,
        clock_hz=_DERIVED_CLOCK + ": 2307e12 / (2 x 2 x 2 x 256^2 x 2) = 2.2 GHz",
        tensorcores="Google Cloud TPU docs, 'TPU7x (Ironwood)': 2 TensorCores a chip, one JAX device each",
        mxus=_LIBTPU.format("the bundles name mxu0 and mxu1"),
        mxu_width="256x256: libtpu's 256-lane pushes (vmatprep + vmatmul)",
        mxu_rows_per_cycle="assumed 2, as the v6e",
        peak_bf16_flops="Google Cloud TPU docs, 'TPU7x (Ironwood)': 4614 TFLOP/s fp8, 2307 bf16",
        hbm_bytes_per_s="Google Cloud TPU docs, 'TPU7x (Ironwood)': 7.37 TB/s",
        granule_bytes="assumed 32 B, as the v5e (7x kernels take their operands in VMEM here)",
    ),
}  # fmt: skip

# Ops a bundle holds at most per unit: the most seen in one bundle of libtpu's v5e bundles
# (not published); a step whose bundles fill a unit's slots is bound by that unit.
SLOTS = {"vector": 4, "load": 3, "store": 2, "eup": 1, "xlu": 2, "scalar": 4}
UNIT_NAMES = {
    "mxu": "MXU",
    "hbm": "DMA / HBM",
    "vector": "vector ALU",
    "load": "vector loads",
    "store": "vector stores",
    "eup": "transcendental unit (EUP)",
    "xlu": "cross-lane unit (XLU)",
    "scalar": "scalar unit",
}


def chip_facts(chip: str) -> Chip:
    """The constants of ``chip`` (``CHIPS``), or ``EstimateError``."""
    if chip not in CHIPS:
        raise EstimateError(f"estimate: unknown TPU chip {chip!r}; libtpu compiles for: {', '.join(CHIPS)}")
    return CHIPS[chip]


# --- the report ----------------------------------------------------------------------------------


def _fmt_us(us: float) -> str:
    if us >= 1000:
        return f"{us / 1000:.3f} ms"
    return f"{us:.2f} us"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass
class KernelEstimate:
    """One Pallas kernel's estimate (``estimate``'s ``kernels``). Times in microseconds.

    Attributes:
      kernel: its name (``pallas_call 'matmul' at file.py:12``); ``hlo``: its HLO instruction.
      chip: the TPU generation.
      time_us: the kernel's time, start to end.
      steps: grid steps (the product of the grid); ``steps_per_core``: those one TensorCore
        runs (half on a megacore chip for a parallel grid).
      step_us: the time of a typical step (the median of the grid loop's iterations).
      bound: what bounds a typical step: ``"MXU"``, ``"DMA / HBM"``, ``"vector ALU"``,
        ``"vector loads"``, ``"vector stores"``, ``"transcendental unit (EUP)"``,
        ``"cross-lane unit (XLU)"``, ``"scalar unit"``; ``utilization``: each of those
        units' busy share of a typical step (the bound is the largest).
      mxu_cycles_per_step: the busiest MXU's busy cycles in a typical step (passes x rows
        per pass / rows per cycle); ``step_cycles``: the step's cycles; ``step_bundles``:
        bundles it issues; ``stall_cycles``: its stalls by cause (``dma``, ``mxu``).
      prologue_us: before the first step's blocks arrived (the pipeline's unhidden prologue);
        ``epilogue_us``: after the last compute op (the last output block's write back).
      vmem_bytes / vmem_capacity: VMEM the kernel holds (libtpu's vmem_report) and the core's;
        ``smem_bytes`` / ``smem_capacity``: SMEM (its SMEM operands, scalar prefetch and
        spill slots) and the core's.
      bundles: its code size; ``overlays``: the instruction-memory overlays holding it (1:
        it fits), None where libtpu does not say.
      flops: MXU FLOPs it runs (padded passes count whole); ``hbm_bytes``: bytes its DMAs
        move to and from HBM.
      unknown_branches: branches on values the estimate cannot know (scalar-prefetch data not
        given as arrays), taken as not taken; ``prefetch_known``: the kernel's scalar-prefetch
        operands whose values the simulation used (from ``estimate``'s concrete arguments and
        the trace's constants); ``extrapolated_steps``: grid-loop iterations not simulated (a
        large grid), estimated as the mean of the simulated ones over whole periods of the
        grid's trailing axes.
      timeline: one typical step's ``(cycle, unit, duration, op)`` events, for ``plot``.
    """

    kernel: str
    hlo: str
    chip: str
    time_us: float
    steps: int
    steps_per_core: int
    step_us: float
    step_cycles: float
    step_bundles: int
    bound: str
    utilization: dict[str, float]
    mxu_cycles_per_step: float
    stall_cycles: dict[str, int]
    prologue_us: float
    epilogue_us: float
    vmem_bytes: int | None
    vmem_capacity: int
    smem_bytes: int
    smem_capacity: int
    bundles: int
    overlays: int | None
    flops: float
    hbm_bytes: float
    unknown_branches: int
    extrapolated_steps: int
    grid: tuple[int, ...] = ()
    cores: int = 1
    prefetch_known: int = 0
    timeline: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def tflops(self) -> float:
        """Achieved TFLOP/s of the MXU passes over the kernel's time."""
        return self.flops / (self.time_us * 1e-6) / 1e12 if self.time_us else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain Python values (no timeline), for JSON."""
        d = dataclasses.asdict(self)
        d.pop("timeline")
        d["grid"] = list(self.grid)
        d["tflops"] = self.tflops
        return d

    def __str__(self) -> str:
        c = CHIPS[self.chip]
        rows = [
            ("time", f"{_fmt_us(self.time_us)} ({self.tflops:.1f} TFLOP/s of {c.core_peak_flops() * self.cores / 1e12:.0f})"),
            ("grid steps", f"{self.steps} (grid {self.grid})" + (f", {self.steps_per_core} per TensorCore" if self.steps_per_core != self.steps else "")),
            ("time per step", f"{_fmt_us(self.step_us)} ({self.step_cycles:.0f} cycles, {self.step_bundles} bundles)"),
            ("bound by", self.bound + "  [" + ", ".join(f"{k} {v:.0%}" for k, v in sorted(self.utilization.items(), key=lambda kv: -kv[1]) if v >= 0.01) + "]"),
            ("MXU cycles per step", f"{self.mxu_cycles_per_step:.0f} (busiest MXU)"),
            ("stalls per step", ", ".join(f"{k} {v}" for k, v in self.stall_cycles.items()) or "none"),
            ("unhidden prologue", _fmt_us(self.prologue_us)),
            ("unhidden epilogue", _fmt_us(self.epilogue_us)),
            ("VMEM", (f"{_fmt_bytes(self.vmem_bytes)}" if self.vmem_bytes is not None else "?") + f" of {_fmt_bytes(self.vmem_capacity)}"),
            ("SMEM", f"{_fmt_bytes(self.smem_bytes)} of {_fmt_bytes(self.smem_capacity)}"),
            ("code", f"{self.bundles} bundles" + (f", {self.overlays} overlays (fetched from HBM as it runs)" if self.overlays and self.overlays > 1 else "")),
            ("HBM traffic", _fmt_bytes(self.hbm_bytes)),
        ]  # fmt: skip
        if self.prefetch_known:
            rows.append(("scalar prefetch", f"{self.prefetch_known} operands' values known and simulated"))
        if self.unknown_branches:
            rows.append(
                (
                    "data-dependent",
                    f"{self.unknown_branches} branches on unknown values (scalar-prefetch data given only as "
                    "shapes), taken as not taken",
                )
            )
        if self.extrapolated_steps:
            rows.append(("extrapolated", f"{self.extrapolated_steps} loop iterations (the grid is large)"))
        width = max(len(k) for k, _ in rows)
        head = f"{self.kernel} on TPU {self.chip} ({self.hlo})"
        return "\n".join([head] + [f"  {k.ljust(width)}  {v}" for k, v in rows])

    def plot(self, path: str) -> str:
        """Saves a picture: a typical step's bundles as a timeline of the units, and the
        kernel against the chip's roofline. Needs matplotlib. Returns ``path``."""
        return plot_kernel(self, path)


@dataclasses.dataclass
class XlaOpEstimate:
    """An XLA op of the program beside the kernels (a fusion, a copy...), from its bundles."""

    hlo: str
    time_us: float
    bundles: int
    hbm_bytes: float

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain Python values."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Estimate:
    """``estimate``'s report: the kernels, the XLA ops around them and the total, in
    microseconds. ``str()`` is a readable table; ``to_dict()`` for JSON; ``plot(path)``."""

    chip: str
    kernels: list[KernelEstimate]
    xla_ops: list[XlaOpEstimate]
    total_us: float

    def to_dict(self) -> dict[str, Any]:
        """The report as plain Python values (JSON-ready)."""
        return dict(
            chip=self.chip,
            total_us=self.total_us,
            kernels=[k.to_dict() for k in self.kernels],
            xla_ops=[x.to_dict() for x in self.xla_ops],
        )

    def __str__(self) -> str:
        lines = [f"estimate for TPU {self.chip}: {_fmt_us(self.total_us)} in all"]
        head = "| kernel | time | steps | per step | bound | VMEM | prologue+epilogue |"
        lines += ["", head, "|---|---|---|---|---|---|---|"]
        for k in self.kernels:
            vmem = _fmt_bytes(k.vmem_bytes) if k.vmem_bytes is not None else "?"
            lines.append(
                f"| {k.kernel} | {_fmt_us(k.time_us)} | {k.steps} | {_fmt_us(k.step_us)} | {k.bound} "
                f"| {vmem} | {_fmt_us(k.prologue_us + k.epilogue_us)} |"
            )
        if self.xla_ops:
            lines += ["", "| XLA op | time | bundles | HBM |", "|---|---|---|---|"]
            for x in self.xla_ops:
                lines.append(f"| {x.hlo} | {_fmt_us(x.time_us)} | {x.bundles} | {_fmt_bytes(x.hbm_bytes)} |")
        for k in self.kernels:
            lines += ["", str(k)]
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """The first kernel's picture (``KernelEstimate.plot``); returns ``path``."""
        if not self.kernels:
            raise EstimateError("estimate: no kernel to plot")
        return self.kernels[0].plot(path)


# --- compiling and reading libtpu's dump ----------------------------------------------------------


_OWN_DUMP: str | None = None


def _libtpu_started() -> bool:
    """Whether this process's libtpu has read its flags already: it is loaded (JAX loads it
    when its backends start, even on a host without a TPU, where the TPU backend then fails
    and only the CPU one is left), or compile-only devices were made."""
    if cc.tpu_devices.cache_info().currsize:
        return True
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        return any("libtpu" in line for line in maps)
    with contextlib.suppress(Exception):
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {}))
    return False


def enable_dumps() -> str | None:
    """Makes this process's libtpu write the dumps ``estimate`` reads (a temporary folder),
    when libtpu has not started yet: ``estimate`` then compiles in this process, not in a
    child. Call it before anything starts libtpu (a TPU program, ``compile_check``).
    Returns the folder, or None when libtpu already started without it."""
    global _OWN_DUMP
    found = code_size_lib.dump_dir()
    if found is not None:
        return found
    if _libtpu_started():
        return None
    _OWN_DUMP = tempfile.mkdtemp(prefix="pltpu_estimate_")
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")
    os.environ["LIBTPU_INIT_ARGS"] = (flags + " " + code_size_lib.dump_args(_OWN_DUMP)).strip()
    return _OWN_DUMP


@dataclasses.dataclass
class _Program:
    files: list[str]  # libtpu's dump of one compile
    kernels: list[tuple[str, str]]  # (name, Mosaic module text) in program order
    cores: int  # TensorCores per device


def _compile(fn, args, kwargs, chip: str) -> _Program:
    dump = enable_dumps()
    devices = cc.tpu_devices(chip)
    cores = getattr(devices[0], "num_cores", 1) or 1
    if dump is not None:
        before = code_size_lib.dump_files(dump)
        try:
            _, kernels = cc.compile_for(fn, args, chip, kwargs)
        except cc.MosaicCompileError:
            raise
        except Exception as e:  # noqa: BLE001 (lowering for TPU failed: not a TPU kernel?)
            raise _not_tpu(e, chip) from e
        new = sorted(code_size_lib.dump_files(dump) - before)
        if new or not kernels:
            files = _keep(new, dump == _OWN_DUMP)
            return _Program(files, [(n, t) for n, t, _ in kernels], cores)
        # Kernels compiled but nothing dumped: libtpu read its flags before the dump's were set.
    # libtpu started without the dump flags: compile again in a child process that has them.
    try:
        kernels = cc._kernels_of(fn, args, kwargs or {}, chip)
    except Exception as e:  # noqa: BLE001
        raise _not_tpu(e, chip) from e
    if not kernels:
        return _Program([], [], cores)
    exported = cc.export_for(fn, args, kwargs or {}, chip)
    keep = tempfile.mkdtemp(prefix="pltpu_estimate_")
    done = cc.compile_in_child([exported], llo=False, code_size=True, keep_dump=keep)
    rows = [r for rows in done for r, _ in rows]
    for r in rows:
        if not r.compiled:
            shutil.rmtree(keep, ignore_errors=True)
            raise cc.MosaicCompileError(r.error or "libtpu could not compile", chip, r.kernel, None)
    files = _keep(sorted(glob.glob(os.path.join(keep, "*"))), True)
    shutil.rmtree(keep, ignore_errors=True)
    return _Program(files, [(n, t) for n, t, _ in kernels], cores)


def _keep(files: list[str], move: bool) -> list[str]:
    """The dump files read into memory-backed temporary copies (``move``: the originals,
    ours, removed): later compiles of this process add to the same folder."""
    out = tempfile.mkdtemp(prefix="pltpu_estimate_run_")
    kept = []
    for f in files:
        dst = os.path.join(out, os.path.basename(f))
        if move:
            shutil.move(f, dst)
        else:
            shutil.copy(f, dst)
        kept.append(dst)
    return kept


def _not_tpu(e: Exception, chip: str) -> EstimateError:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return EstimateError(
        f"estimate: the function does not lower for TPU {chip} ({type(e).__name__}: {text}); "
        "estimate takes TPU kernels (pallas_call with the TPU backend)"
    )


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _vmem_report(files) -> dict:
    for f in files:
        if f.endswith("vmem_report.html"):
            m = re.search(r"const DATA\s*=\s*(\{.*?\});\s*\n", _read(f), re.S)
            if m:
                with contextlib.suppress(ValueError):
                    return json.loads(m.group(1))
    return {}


_SMEM_ARG = re.compile(r"memref<([\dx]*)x?(i\d+|f\d+|bf16)(?:,[^>]*)?, #tpu\.memory_space<smem>>")


def _smem_bytes(module_text: str, bundle_text: str) -> int:
    head = module_text.split("{", 2)[:2]
    sig = re.search(r"func\.func @\w+\((.*?)\)\s*(?:->|attributes|\{)", module_text, re.S)
    total = 0
    for dims, dtype in _SMEM_ARG.findall(sig.group(1) if sig else "".join(head)):
        n = math.prod(int(d) for d in dims.split("x") if d) if dims else 1
        bits = 16 if dtype == "bf16" else int(re.sub(r"\D", "", dtype))
        total += n * max(bits, 32) // 8  # SMEM holds 32-bit words
    spills = set(re.findall(r"smem:\[#(allocation\d+_spill)", bundle_text))
    return total + 4 * len(spills)


def _grid(module_text: str) -> tuple[int, ...]:
    m = re.search(r"iteration_bounds = array<i64(?::\s*([\d,\s]*))?>", module_text)
    if not m or not m.group(1):
        return ()
    return tuple(int(x) for x in m.group(1).split(",") if x.strip())


def _parallel(module_text: str) -> bool:
    return "dimension_semantics<parallel>" in module_text or "core_parallel" in module_text


@dataclasses.dataclass
class _Hlo:
    name: str
    bundles_file: str | None
    total_bundles: int | None
    body: bytes


def _hlo_ops(files) -> tuple[list[str], dict[str, _Hlo]]:
    """The program's HLO instructions in call order (the top-level program's inlined calls)
    and, per name, its final bundles."""
    ops: dict[str, _Hlo] = {}
    for f in files:
        base = os.path.basename(f)
        m = re.match(r"\d+-(.+)-(\d+)-(schedule-analysis_)?final_bundles\.txt$", base)
        if not m or m.group(1) == "TLP" or m.group(1).startswith("<"):
            continue
        h = ops.setdefault(m.group(1), _Hlo(m.group(1), None, None, b""))
        if m.group(3):
            text = _read(f)
            h.total_bundles = code_size_lib.total_bundles(text)
            h.body = code_size_lib._body(text)
        else:
            h.bundles_file = f
    tlp = code_size_lib._tlp(files, "-final_bundles.txt")
    order = [n for _, n in code_size_lib.inlined_calls(_read(tlp))] if tlp else []
    order = [n for n in order if n in ops]
    order += [n for n in ops if n not in order]
    return order, ops


# --- the estimate ---------------------------------------------------------------------------------


def _median_iteration(iters: list[bundles_lib.IterationStats]) -> bundles_lib.IterationStats | None:
    if not iters:
        return None
    inner = iters[1:-1] if len(iters) >= 3 else iters
    ranked = sorted(inner, key=lambda it: it.cycles)
    return ranked[len(ranked) // 2]


def _period_mean(
    iters: list[bundles_lib.IterationStats], grid: tuple[int, ...]
) -> bundles_lib.IterationStats | None:
    """The mean iteration over whole periods of the grid's trailing axes, for the iterations a
    truncated simulation did not run. A step's path depends on its grid indices (a causal mask
    skips, halves or runs a tile), and the pattern repeats over the trailing axes: the mean of
    the last ``n x period`` simulated iterations (any window of whole periods has the pattern's
    mean, whatever its phase) is the period's, where the median of a prefix is one kind of
    step. The period: the longest product of trailing axes that the simulated iterations (less
    the first, the pipeline's prologue) hold at least once. None without a whole period."""
    done = iters[1:]
    period = 0
    prod = 1
    for n in reversed(grid):
        prod *= n
        if prod > len(done):
            break
        period = prod
    if not period:
        return None
    window = done[len(done) - (len(done) // period) * period :]
    mean = bundles_lib.IterationStats()
    k = len(window)
    mean.cycles = round(sum(it.cycles for it in window) / k)
    mean.bundles = round(sum(it.bundles for it in window) / k)
    mean.flops = sum(it.flops for it in window) / k
    mean.hbm_bytes = sum(it.hbm_bytes for it in window) / k
    mean.dma_bytes = sum(it.dma_bytes for it in window) / k
    return mean


def _utilization(it: bundles_lib.IterationStats, machine: bundles_lib.Machine) -> dict[str, float]:
    t = max(it.cycles, 1)
    u = {
        "MXU": max(it.mxu_busy.values(), default=0.0) / t,
        "DMA / HBM": it.hbm_bytes / machine.hbm_bytes_per_cycle / t,
    }
    for unit, slots in SLOTS.items():
        u[UNIT_NAMES[unit]] = it.ops.get(unit, 0) / slots / t
    return u


# Bundles a kernel's simulation runs before the grid loop's remaining iterations are
# extrapolated (about 160 k bundles a second in CPython: at most some 12 s a kernel). Enough
# for the whole grid of most kernels: a data-dependent grid (gmm's idle tiles at its end, a
# causal mask's skipped blocks) is only right where simulated.
SIM_BUDGET = 2_000_000


def _simulate(text: str, machine, record: int | None = None, budget: int = 300_000):
    bundles, regions = bundles_lib.parse(text)
    return bundles, bundles_lib.simulate(bundles, regions, machine, budget=budget, record_iteration=record)


def _kernel_estimate(
    name, module_text, hlo: _Hlo, chip: Chip, cores: int, vmem: dict, size, operands=None
) -> KernelEstimate:
    machine = chip.machine(cores)
    text = _read(hlo.bundles_file) if hlo.bundles_file else ""
    grid = _grid(module_text)
    steps = math.prod(grid) if grid else 1
    blist, regions = bundles_lib.parse(text)
    bound_iters = bundles_lib.loop_bound(blist)
    split = cores > 1 and _parallel(module_text) and bound_iters is not None and bound_iters < steps
    steps_per_core = -(-steps // cores) if split else steps
    iters_total = bound_iters or steps_per_core
    record = max(1, min(iters_total // 2, 8)) if iters_total > 2 else 0
    r = bundles_lib.simulate(
        blist, regions, machine, budget=SIM_BUDGET, record_iteration=record, operands=operands or None
    )
    cycles = r.cycles
    extrapolated = 0
    typical = _median_iteration(r.iterations)
    if typical is None:  # no grid loop: the whole kernel is its one step
        typical = r.totals
        typical.cycles = int(r.cycles)
    rest = typical
    if r.truncated_iterations and r.iterations:
        extrapolated = max(iters_total - len(r.iterations), 0)
        # the unsimulated iterations at the mean over whole periods (the median where no period is whole)
        rest = _period_mean(r.iterations, grid) or typical
        cycles += extrapolated * rest.cycles
    clock = chip.clock_hz
    util = _utilization(typical, machine)
    bound = max(util, key=lambda k: util[k])
    prologue = (r.first_wait_end or 0) / clock * 1e6
    epilogue = max(r.cycles - (r.last_compute if r.last_compute is not None else r.cycles), 0) / clock * 1e6
    vinfo = vmem.get("hlo_breakdowns", {}).get(hlo.name, {})
    vmem_cap = int(vmem.get("global_info", {}).get("vmem_capacity", chip.vmem_bytes))
    # The bundles are one TensorCore's: on a megacore device each core runs its share.
    share = cores if split else 1
    flops = share * (r.totals.flops + (extrapolated * rest.flops if extrapolated else 0.0))
    hbm = share * (r.totals.hbm_bytes + (extrapolated * rest.hbm_bytes if extrapolated else 0.0))
    return KernelEstimate(
        kernel=name,
        hlo=hlo.name,
        chip=chip.name,
        time_us=cycles / clock * 1e6,
        steps=steps,
        steps_per_core=steps_per_core,
        step_us=typical.cycles / clock * 1e6,
        step_cycles=float(typical.cycles),
        step_bundles=typical.bundles,
        bound=bound,
        utilization=util,
        mxu_cycles_per_step=max(typical.mxu_busy.values(), default=0.0),
        stall_cycles={k: v for k, v in (("dma", typical.stall_dma), ("mxu", typical.stall_mxu), ("other", typical.stall_other)) if v},
        prologue_us=prologue,
        epilogue_us=epilogue,
        vmem_bytes=int(vinfo["total_size"]) if "total_size" in vinfo else None,
        vmem_capacity=vmem_cap,
        smem_bytes=_smem_bytes(module_text, text),
        smem_capacity=chip.smem_bytes,
        bundles=hlo.total_bundles or len(blist),
        overlays=size.overlays if size is not None else None,
        flops=flops,
        hbm_bytes=hbm,
        unknown_branches=r.unknown_branches,
        extrapolated_steps=extrapolated,
        grid=grid,
        cores=cores,
        prefetch_known=len(operands or {}),
        timeline=r.timeline,
    )  # fmt: skip


def estimate(f, *args, chip: str = "v5e", **kwargs) -> Estimate:
    """Estimates the time of ``jax.jit(f)(*args, **kwargs)`` on a TPU of generation ``chip``,
    on any machine: libtpu compiles it for a compile-only device of that chip (no TPU
    needed) and its final bundles are run through a model of the TensorCore.

    Args:
      f: a function of JAX arrays holding TPU kernels (``pallas_call``).
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct``. Shapes and dtypes make the
        kernels; values count only where they make a kernel's scalar-prefetch operands
        (lengths, page tables, group sizes): those are evaluated on the host's CPU from the
        concrete arguments (and the trace's constants, such as a block mask's tables) and
        the simulated scalar unit reads them, so data-dependent loops and DMAs run as on the
        chip. Given as ``ShapeDtypeStruct`` they are unknown: a branch on them is taken as
        not taken (``KernelEstimate.unknown_branches``).
      chip: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"`` or ``"7x"`` (``CHIPS``).
      **kwargs: its keyword arguments.

    Returns:
      An ``Estimate``: per kernel a ``KernelEstimate`` (time, steps, time per step, what
      bounds a step, VMEM and SMEM, prologue and epilogue, overlays), the XLA ops around
      them, the total. ``print()`` it for a table; ``.plot("k.png")`` for a picture.

    Raises:
      EstimateError: an unknown chip, libtpu missing (``pip install "jax[tpu]"``), a
        function that holds no TPU kernel or does not lower for TPU.
      MosaicCompileError: libtpu refused a kernel.
    """
    facts = chip_facts(chip)
    if not cc.libtpu_available():
        raise EstimateError(
            'estimate needs libtpu, which compiles for TPUs on any machine: pip install "jax[tpu]"'
        )
    prog = _compile(f, args, kwargs, chip)
    values = prefetch_lib.prefetch_values(f, args, kwargs, cc._traced_for(chip, (args, kwargs)))
    try:
        return _report(prog, facts, values if len(values) == len(prog.kernels) else [])
    finally:
        if prog.files:
            shutil.rmtree(os.path.dirname(prog.files[0]), ignore_errors=True)


def _report(prog: _Program, facts: Chip, values: list | None = None) -> Estimate:
    if not prog.kernels:
        raise EstimateError(
            f"estimate: the function holds no TPU kernel (no pallas_call lowered to Mosaic for TPU {facts.name}); "
            "estimate reports Pallas TPU kernels"
        )
    order, hlos = _hlo_ops(prog.files)
    module_names = [code_size_lib.module_name(t) for _, t in prog.kernels]
    sizes = code_size_lib.program_code_sizes(prog.files, module_names)
    vmem = _vmem_report(prog.files)
    # Which HLO custom call is which kernel: the one whose Mosaic bytecode names its module.
    calls = [n for n in order if hlos[n].body]
    taken: dict[int, str] = {}
    for call in calls:
        cands = [
            i for i, m in enumerate(module_names) if i not in taken and m and m.encode() in hlos[call].body
        ]
        if not cands and len(calls) == len(prog.kernels) == 1:
            cands = [0]
        if cands:
            taken[max(cands, key=lambda j: (len(module_names[j] or ""), -j))] = call
    if not taken:
        raise EstimateError(
            f"estimate: libtpu compiled the function's {len(prog.kernels)} kernel(s) for TPU {facts.name} "
            "but its dump names none of them (no final bundles to read)"
        )
    kernels = []
    for i, (name, text) in enumerate(prog.kernels):
        if i in taken:
            known = values[i] if values else None
            kernels.append(
                _kernel_estimate(name, text, hlos[taken[i]], facts, prog.cores, vmem, sizes[i], known)
            )
    machine = facts.machine(prog.cores)
    xla = []
    for n in order:
        bundles_file = hlos[n].bundles_file
        if n in taken.values() or bundles_file is None:
            continue
        _, r = _simulate(_read(bundles_file), machine, budget=200_000)
        xla.append(
            XlaOpEstimate(
                n,
                r.cycles / facts.clock_hz * 1e6 + facts.xla_op_us,
                hlos[n].total_bundles or 0,
                r.totals.hbm_bytes,
            )
        )
    total = sum(k.time_us for k in kernels) + sum(x.time_us for x in xla)
    return Estimate(facts.name, kernels, xla, total)


# --- the picture ----------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EstimateError(
            "estimate's picture needs matplotlib (an optional dependency): pip install jax-pallas-tpu[plot]"
        ) from None
    return plt


_ROW_ORDER = ["scalar", "vector", "load", "store", "eup", "xlu", "mxu", "dma", "sync"]


def plot_kernel(k: KernelEstimate, path: str) -> str:
    """``KernelEstimate.plot``: a typical step's timeline and the roofline, as a PNG."""
    plt = _pyplot()
    chip = CHIPS[k.chip]
    fig, (ax, rf) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2.2, 1]})
    rows: dict[str, list] = {}
    for cycle, unit, dur, _ in k.timeline:
        rows.setdefault(unit, []).append((cycle, max(dur, 1)))

    def rank(u):
        head = u.split()[0]
        return (_ROW_ORDER.index(head) if head in _ROW_ORDER else len(_ROW_ORDER), u)

    names = sorted(rows, key=rank)
    colors = plt.get_cmap("tab10")
    for y, unit in enumerate(names):
        spans = sorted(rows[unit])
        merged: list[list[int]] = []
        for s, d in spans:
            if merged and s <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], s + d - merged[-1][0])
            else:
                merged.append([s, d])
        color = "tab:red" if unit.startswith("stall") else colors(y % 10)
        ax.broken_barh([tuple(m) for m in merged], (y - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([{"eup": "EUP (transcendental)", "xlu": "XLU (cross-lane)"}.get(n, n) for n in names])
    ax.set_xlabel("cycle within the step")
    ax.set_title(f"one grid step of {k.hlo} on TPU {k.chip}: {k.step_cycles:.0f} cycles, bound by {k.bound}")
    ax.invert_yaxis()
    # Roofline: the device's peak and HBM bandwidth.
    cores = k.cores
    peak = chip.core_peak_flops() * cores / 1e12
    bw = chip.hbm_bytes_per_s * cores / chip.tensorcores / 1e12  # TB/s
    xs = [2.0**i for i in range(-2, 14)]
    rf.plot(
        xs,
        [min(peak, bw * x) for x in xs],
        "k-",
        label=f"roofline ({peak:.0f} TFLOP/s, {bw * 1000:.0f} GB/s)",
    )
    if k.hbm_bytes and k.flops:
        ai = k.flops / k.hbm_bytes
        rf.plot([ai], [k.tflops], "o", color="tab:red", label=f"this kernel: {k.tflops:.1f} TFLOP/s")
    rf.set_xscale("log", base=2)
    rf.set_yscale("log")
    rf.set_xlabel("FLOPs per HBM byte")
    rf.set_ylabel("TFLOP/s")
    rf.set_title("against the chip's roofline")
    rf.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@functools.cache
def chips_table() -> str:
    """The chip constants as a Markdown table, with their sources (for the docs)."""
    fields = ["clock_hz", "tensorcores", "mxus", "mxu_width", "mxu_rows_per_cycle", "peak_bf16_flops",
              "hbm_bytes_per_s", "vmem_bytes", "smem_bytes", "granule_bytes", "delay_slots", "hbm_efficiency", "xla_op_us",
              "dma_latency_us"]  # fmt: skip
    lines = ["| chip | " + " | ".join(fields) + " |", "|---" * (len(fields) + 1) + "|"]
    for c in CHIPS.values():
        lines.append(f"| {c.name} | " + " | ".join(f"{getattr(c, f):g}" for f in fields) + " |")
    return "\n".join(lines)
