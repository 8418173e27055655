"""Will a kernel compile on a TPU? libtpu's Mosaic compiler, on any machine.

libtpu (``pip install "jax[tpu]"``, never a dependency of ours) gives compile-only
TPU devices on machines without a TPU: ``jax.experimental.topologies``. A
function jitted for one of them goes through XLA's TPU compiler and, for every
``tpu_custom_call``, Mosaic's own pipeline down to LLO (the TPU's instructions):
the compiler a TPU user's program meets. ``compile_check`` runs it per chip and
reports per kernel: its code size in bundles and whether libtpu had to split it into
overlays (``code_size``: a kernel larger than the core's instruction memory, which
compiles but is fetched from HBM as it runs), and with ``llo=True`` the LLO ops Mosaic
emitted. Both come from libtpu's dumps (``LIBTPU_INIT_ARGS=--xla_jf_dump_to`` and
``--xla_mosaic_dump_to``), which libtpu reads once per process: the compile is then done
again in a child process unless this one was started with them.

It does not run the kernel and says nothing of speed beyond instruction counts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax

from pallas_tpu._src.language import tpu_info
from pallas_tpu._src.mosaic import code_size as code_size_lib
from pallas_tpu._src.mosaic import modules
from pallas_tpu._src.mosaic.code_size import CodeSizeWarning  # noqa: F401 (re-exported)

# Google's PCI device ids of TPU chips (JAX's jax._src.hardware_utils lists the same).
_TPU_PCI_IDS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076", "0x007c", "0x0083"}


def _quiet_libtpu_without_a_tpu() -> None:
    """libtpu installed for its compiler (``compile_check``) on a machine with no TPU attached
    asks the absent cloud metadata for the worker hostnames and host bounds when JAX starts
    its backends, and prints an ``E0000 ... unexpected worker hostname`` block at every start.
    Where neither is set, tell it it is one host alone: read when JAX starts its backends, so
    this quiets every program that imports pallas_tpu before its first computation.
    Compile-only devices are unaffected; on a TPU (``/dev/accel*``, or a TPU on the PCI bus,
    as JAX checks) nothing is set. noxfile.py and tests/conftest.py do the same."""
    if glob.glob("/dev/accel*"):
        return
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
                if f.read().strip() == "0x1ae0" and g.read().strip() in _TPU_PCI_IDS:
                    return
        except OSError:
            continue
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


if importlib.util.find_spec("libtpu") is not None:
    _quiet_libtpu_without_a_tpu()

# A chip name -> the smallest topology libtpu knows for it (one host).
# "7x": TPU7x, compile-only in libtpu 0.0.42.1 and 0.0.48.1 (its MXU ops: tests/tpu/test_mxu_fifo.py).
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "7x": "tpu7x:2x2x1"}
DUMP_FLAG = "--xla_mosaic_dump_to"


class CompileCheckError(RuntimeError):
    """libtpu is missing, or a chip it does not know."""


@dataclasses.dataclass(frozen=True)
class KernelCompile:
    """What Mosaic made of one kernel for one chip.

    Attributes:
      kernel: the kernel's name.
      chip: the TPU generation (``"v5e"``...).
      compiled: whether libtpu compiled the function holding it.
      error: Mosaic's message (with the kernel's file and line) when it did not.
      llo_ops: LLO ops Mosaic emitted for the kernel (``llo=True``), else None.
      llo_loop_ops: of those, the ops inside its innermost loop (0 with no loop).
      bundles: the kernel's code in bundles (VLIW instruction words) as libtpu scheduled
        it (``code_size=True``), else None.
      overlays: the overlays its code lies in: 1 when it fits the TensorCore's instruction
        memory; more when libtpu split it into pieces fetched from HBM as it runs (a
        ``CodeSizeWarning`` says so). None where not read.
    """

    kernel: str
    chip: str
    compiled: bool
    error: str | None = None
    llo_ops: int | None = None
    llo_loop_ops: int | None = None
    bundles: int | None = None
    overlays: int | None = None


def libtpu_available() -> bool:
    """Whether libtpu is installed (``pip install "jax[tpu]"``)."""
    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def tpu_devices(chip: str) -> tuple:
    """The compile-only devices of ``chip``'s one-host topology (``TOPOLOGIES``)."""
    if chip not in TOPOLOGIES:
        raise CompileCheckError(f"compile_check: unknown TPU chip {chip!r}; known: {', '.join(TOPOLOGIES)}")
    if not libtpu_available():
        raise CompileCheckError(
            'compile_check needs libtpu, which compiles for TPUs on any machine: pip install "jax[tpu]"'
        )
    from jax.experimental import topologies

    # Compiling needs no TPU: don't let libtpu's one-process-per-machine lock refuse a second
    # process (read when libtpu starts; a process that started it already keeps its setting).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return tuple(topologies.get_topology_desc(TOPOLOGIES[chip], "tpu").devices)


def _placed(args, chip: str):
    """``args`` as ShapeDtypeStructs on ``chip``'s first device; those already on
    compile-only TPU devices (a ``shard_map`` over a mesh of them) as they are."""
    device = tpu_devices(chip)[0]

    def place(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sharding = getattr(x, "sharding", None)
        if sharding is not None and {d.platform for d in sharding.device_set} == {"tpu"}:
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))

    return jax.tree.map(place, args)


def _jit_for(fn, placed, chip: str):
    """``jax.jit(fn)`` that runs on ``chip``: its placed arguments say where, and
    without any (a kernel of no inputs) its outputs go to the chip's first device;
    otherwise jit would lower for the default backend, the CPU."""
    on_tpu = any(
        {d.platform for d in getattr(getattr(x, "sharding", None), "device_set", ())} == {"tpu"}
        for x in jax.tree.leaves(placed)
    )
    if on_tpu:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=jax.sharding.SingleDeviceSharding(tpu_devices(chip)[0]))


def _traced_for(chip: str, placed):
    """Traced as for ``chip``: ``pltpu.get_tpu_info()`` (an op's block sizes, emit_pipeline's
    tiling) describes it while ``fn`` is traced, as under an abstract mesh of its device (part
    of JAX's trace cache key, so an inner ``jax.jit`` traces again for another chip); left as
    it is inside one that already names a TPU, and for arguments sharded over a mesh of
    TPU devices (a ``shard_map``: the lowering reads the chip off its devices)."""
    current = tpu_info.compat.abstract_device()
    if current is not None and tpu_info.chip_version_from_device_kind(current.device_kind) is not None:
        return contextlib.nullcontext()
    if any(len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in jax.tree.leaves(placed)):
        return contextlib.nullcontext()
    dev = tpu_devices(chip)[0]
    kind = jax.sharding.AbstractDevice(
        device_kind=dev.device_kind, num_cores=getattr(dev, "num_cores", 1) or 1, platform="tpu"
    )
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=kind))


def compile_for(fn, args: Sequence, chip: str, kwargs=None):
    """``jax.jit(fn)`` lowered for ``chip`` and compiled by libtpu (XLA and
    Mosaic); raises ``MosaicCompileError`` where Mosaic refuses a kernel."""
    placed = _placed(tuple(args), chip)
    kwargs = _placed(kwargs or {}, chip)
    with modules.collect_kernels() as kernels, _traced_for(chip, (placed, kwargs)):
        # A fresh wrapper: jit caches lowerings, and a cached one would not collect the kernels.
        lowered = _jit_for(lambda *a, **k: fn(*a, **k), (placed, kwargs), chip).lower(*placed, **kwargs)
    key = _reuse_key(lowered, chip)
    if key is not None and key in _REUSED:
        _REUSED.move_to_end(key)
        outcome = _REUSED[key]
    else:
        try:
            outcome = lowered.compile()
        except Exception as e:  # JaxRuntimeError: INTERNAL: Mosaic failed to compile ...
            outcome = RuntimeError(str(e))  # its message only: no traceback's frames kept
        if key is not None:
            _REUSED[key] = outcome
            while len(_REUSED) > _reuse_limit:
                _REUSED.popitem(last=False)
    if isinstance(outcome, RuntimeError):
        raise MosaicCompileError.from_libtpu(outcome, chip, kernels) from None
    return outcome, kernels


# compile_for's outcomes kept by reuse_compiles(): (chip, digest of the lowered module's text
# with its locations) -> the compiled executable or libtpu's refusal; the least recent dropped.
_REUSED: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
_reuse_limit = 0


def reuse_compiles(limit: int = 64) -> None:
    """From now on in this process, ``compile_for`` compiles a module it compiled for the same
    chip before (the same text, locations included) only once: the outcome of the last
    ``limit`` ones (0: none, the default) is kept. A test suite compiles one kernel for many
    tests that differ only in their data (a parametrized index, a seed); the compile is the
    same. Never where libtpu dumps its passes (``llo``, code size): a kept compile writes no dump."""
    global _reuse_limit
    _reuse_limit = limit
    while len(_REUSED) > limit:
        _REUSED.popitem(last=False)


def _reuse_key(lowered, chip: str) -> tuple[str, str] | None:
    if not _reuse_limit or _dump_dir() is not None or code_size_lib.dump_dir() is not None:
        return None
    text = lowered.as_text(debug_info=True)
    return chip, hashlib.sha256(text.encode()).hexdigest()


class MosaicCompileError(RuntimeError):
    """Mosaic (libtpu) refused a kernel: its message, the kernel and the user's line."""

    def __init__(self, message: str, chip: str, kernel: str | None, source: str | None):
        super().__init__(message)
        self.chip, self.kernel, self.source = chip, kernel, source

    @classmethod
    def from_libtpu(cls, e: Exception, chip: str, kernels) -> MosaicCompileError:
        text = str(e)
        m = re.search(r'at location: loc\((?:"[^"]*"\()?"([^"]+)":(\d+):\d+', text)
        source = f"{os.path.basename(m.group(1))}:{m.group(2)}" if m else None
        kernel = _kernel_of(text, kernels, source)
        reason = re.search(r"Mosaic failed to compile TPU kernel[^:]*: (.*)", text)
        op = re.search(r"The MLIR operation involved:\s*\n\s*(.*)", text)
        where = f"{kernel or 'a TPU kernel'} for TPU {chip}"
        if source:
            where += f", at the kernel's line {source}"
        if reason is None:
            return cls(f"libtpu could not compile for {chip}: {text}", chip, kernel, source)
        msg = f"Mosaic (libtpu) refused {where}: {reason.group(1).strip()}"
        if op:
            msg += f"\n  operation: {op.group(1).strip()}"
        msg += f"\n(libtpu's message follows)\n{text}"
        return cls(msg, chip, kernel, source)


def _kernel_of(text: str, kernels, source: str | None) -> str | None:
    """Which collected kernel a Mosaic error is about: the one whose module names
    the error's file and line, or the only one."""
    if source:
        file, line = source.rsplit(":", 1)
        for name, _, module_text in kernels:
            if re.search(rf'{re.escape(file)}":{line}:', module_text):
                return name
    return kernels[0][0] if len(kernels) == 1 else None


def compile_check(
    fn,
    *args,
    chips: Sequence[str] = ("v5e", "v6e"),
    llo: bool = False,
    code_size: bool = True,
    **kwargs,
) -> list[KernelCompile]:
    """Compiles ``jax.jit(fn)(*args)`` for each TPU generation in ``chips`` with
    libtpu's Mosaic compiler (no TPU needed) and reports per kernel.

    Args:
      fn: a function of JAX arrays that calls TPU kernels (``pallas_call``).
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct``, placed on
        one compile-only device of each chip; for a ``jax.shard_map`` over several
        chips, build the mesh from ``compile_check.tpu_devices(chip)`` and pass
        ``ShapeDtypeStruct`` objects sharded over it (kept as they are).
      **kwargs: its keyword arguments, likewise.
      chips: of ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``.
      llo: also count the LLO ops (TPU instructions) Mosaic emits per kernel.
      code_size: also read each kernel's code size (``bundles``) and the overlays
        libtpu split it into (``overlays``), warning (``CodeSizeWarning``) of a kernel
        that does not fit the TensorCore's instruction memory. Read from libtpu's dump:
        unless this process was started with ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR``,
        a child process compiles the function again (not for arguments sharded over
        several devices: None there).
    Returns:
      One ``KernelCompile`` per kernel and chip, in program order; a kernel of a
      function that did not compile carries Mosaic's message, which names the
      kernel's file and line.
    Raises:
      CompileCheckError: libtpu is not installed, or a chip is unknown.
    """
    for chip in chips:
        tpu_devices(chip)  # clear errors first
    out: list[KernelCompile]
    sizes: list
    if llo and _dump_dir() is None:
        out, sizes = _in_child(fn, args, kwargs, tuple(chips), llo=True, code_size=code_size)
        _warn(out, sizes)
        return out
    dump = _dump_dir() if llo else None
    jf_dump = code_size_lib.dump_dir() if code_size else None
    # Chips whose code size a child process reads: the function exported for each first (a
    # fresh trace; a kernel that caches what it made in an earlier trace may not export).
    exported = {}
    if code_size and jf_dump is None:
        for chip in chips:
            if not _sharded(_placed(tuple(args), chip)):
                try:
                    exported[chip] = export_for(fn, args, kwargs, chip)
                except Exception:  # noqa: BLE001 (the compile below reports a kernel that fails)
                    pass
    out = []
    sizes = []
    later = []
    for chip in chips:
        before = set(_llo_files(dump)) if dump else set()
        jf_before = code_size_lib.dump_files(jf_dump)
        try:
            _, kernels = compile_for(fn, args, chip, kwargs)
        except MosaicCompileError as e:
            names = [e.kernel] if e.kernel else [n for n, _, _ in _kernels_of(fn, args, kwargs, chip)]
            out += [KernelCompile(n, chip, False, str(e)) for n in names]
            sizes += [None] * len(names)
            continue
        counts = _llo_counts(sorted(set(_llo_files(dump)) - before)) if dump else []
        code: Sequence[code_size_lib.CodeSize | None] = [None] * len(kernels)
        if jf_dump:
            new = sorted(code_size_lib.dump_files(jf_dump) - jf_before)
            code = code_size_lib.program_code_sizes(
                new, [code_size_lib.module_name(t) for _, t, _ in kernels]
            )
        elif chip in exported:
            later.append(chip)
        for i, (name, _, _) in enumerate(kernels):
            ops, loop = counts[i] if i < len(counts) else (None, None)
            c = code[i]
            out.append(KernelCompile(name, chip, True, None, ops, loop, *_size_fields(c)))
            sizes.append(c)
    if later:
        try:
            done = compile_in_child([exported[chip] for chip in later], llo=False, code_size=True)
        except CompileCheckError:  # the child failed: sizes unread, None
            done = []
        flat = [row for rows in done for row in rows]
        rows, child_sizes = [r for r, _ in flat], [c for _, c in flat]
        for chip in later:
            mine = [i for i, r in enumerate(out) if r.chip == chip]
            theirs = [(r, c) for r, c in zip(rows, child_sizes) if r.chip == chip and r.compiled]
            if len(mine) != len(theirs):
                continue  # another trace: kernels that do not line up stay unread
            for i, (r, c) in zip(mine, theirs):
                out[i] = dataclasses.replace(out[i], bundles=r.bundles, overlays=r.overlays)
                sizes[i] = c
    _warn(out, sizes)
    return out


def _size_fields(c) -> tuple:
    return (c.bundles, c.overlays) if c is not None else (None, None)


def _sharded(placed) -> bool:
    return any(
        len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in jax.tree.leaves(placed)
    )


def _warn(rows: Sequence[KernelCompile], sizes: Sequence) -> None:
    for r, c in zip(rows, sizes):
        if c is not None:
            code_size_lib.warn_if_split(r.kernel, r.chip, c, stacklevel=4)


def _kernels_of(fn, args, kwargs, chip):
    placed, kwargs = _placed(tuple(args), chip), _placed(kwargs, chip)
    with modules.collect_kernels() as kernels, _traced_for(chip, (placed, kwargs)):
        _jit_for(lambda *a, **k: fn(*a, **k), (placed, kwargs), chip).lower(*placed, **kwargs)
    return kernels


def _dump_dir() -> str | None:
    """Where this process's libtpu dumps Mosaic's passes (None: it does not)."""
    found = re.findall(rf"{DUMP_FLAG}=(\S+)", os.environ.get("LIBTPU_INIT_ARGS", ""))
    return found[-1] if found else None  # libtpu takes the last


def _llo_files(dump: str) -> list[str]:
    return glob.glob(os.path.join(dump, "*-post-finalize-llo.txt"))


def compile_counting_llo(fn, args: Sequence, chip: str):
    """``compile_for``, and the (LLO ops, innermost-loop LLO ops) of each kernel
    it compiled, or None where this process's libtpu does not dump its passes."""
    dump = _dump_dir()
    before = set(_llo_files(dump)) if dump else set()
    compiled, kernels = compile_for(fn, args, chip)
    counts = _llo_counts(sorted(set(_llo_files(dump)) - before)) if dump else None
    return compiled, kernels, counts


def _llo_counts(files: Sequence[str]) -> list[tuple[int, int]]:
    """(ops, ops in the innermost loop) of each kernel's final LLO, in the order
    Mosaic compiled them (the dump files' serial numbers)."""
    return [llo_op_counts(open(f).read()) for f in sorted(files, key=os.path.basename)]


_OP = re.compile(r"^\s*(?:%[\w#:, %]+=\s*)?\"?((?:llo|scf|arith|func)\.[\w.]+)")


def llo_op_counts(text: str) -> tuple[int, int]:
    """(LLO ops of the kernel's main function, of them the ops inside its
    innermost loop) in a ``*-post-finalize-llo.txt`` dump. Loop structure is read
    from the ``scf.for``/``scf.while`` regions still around the LLO ops."""
    total = 0
    main = False
    stack: list[list] = []  # open regions: [is_loop, ops directly inside, max depth loop ops]
    best = (0, 0)  # (loop depth, ops) of the innermost loop seen
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("func.func"):
            main = "tpu.main" in s or "window_params" in s or "iteration_bounds" in s
            stack = []
            continue
        if not main:
            continue
        m = _OP.match(line)
        if m and m.group(1).startswith("llo."):
            total += 1
            for frame in stack:
                if frame[0]:
                    frame[1] += 1
        opens = s.endswith("{")
        closes = s.startswith("}")
        if closes and stack:
            frame = stack.pop()
            if frame[0]:
                depth = sum(1 for f in stack if f[0]) + 1
                if depth > best[0] or (depth == best[0] and frame[1] > best[1]):
                    best = (depth, frame[1])
        if opens:
            stack.append([bool(re.search(r"\bscf\.(for|while)\b|llo\.loop|\bloop\b", s)), 0])
    return total, best[1]


def _in_child(fn, args, kwargs, chips, llo: bool, code_size: bool):
    """``fn`` compiled per chip by ``compile_in_child``: the ``KernelCompile`` rows and the
    ``CodeSize`` of each (None where not read)."""
    done = compile_in_child(
        [export_for(fn, args, kwargs, chip) for chip in chips], llo=llo, code_size=code_size
    )
    flat = [row for rows in done for row in rows]
    return [r for r, _ in flat], [c for _, c in flat]


def export_for(fn, args: Sequence, kwargs, chip: str) -> tuple:
    """``jax.jit(fn)`` exported (``jax.export``) as traced for ``chip``, with its kernels'
    names: what ``compile_in_child`` compiles."""
    from jax import export

    placed = _placed(tuple(args), chip)
    placed_kwargs = _placed(kwargs or {}, chip)
    with modules.collect_kernels() as kernels, _traced_for(chip, (placed, placed_kwargs)):
        exp = export.export(jax.jit(lambda *a, **k: fn(*a, **k)), platforms=["tpu"])(*placed, **placed_kwargs)
    names = [n for n, _, _ in kernels]
    return chip, names, [code_size_lib.module_name(t) for _, t, _ in kernels], exp.serialize()


def compile_in_child(
    exported: Sequence[tuple], *, llo: bool = False, code_size: bool = True, keep_dump: str | None = None
) -> list[list[tuple]]:
    """Compiles functions (``export_for``'s) in one child process started with libtpu's dump
    flags (LLO for ``llo``, bundles and overlays for ``code_size``); per function, its
    kernels' ``(KernelCompile, CodeSize or None)``. ``keep_dump``: a folder where the child's
    libtpu dump (final bundles, overlays, VMEM report) is left (``pltpu.estimate`` reads it)."""
    with tempfile.TemporaryDirectory() as tmp:
        blobs = []
        for i, (chip, names, module_names, blob) in enumerate(exported):
            path = os.path.join(tmp, f"{i}.bin")
            with open(path, "wb") as f:
                f.write(blob)
            blobs.append(dict(chip=chip, kernels=names, modules=module_names, path=path))
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump(dict(blobs=blobs, code_size=code_size or bool(keep_dump), keep=bool(keep_dump)), f)
        env = dict(os.environ)
        flags = env.get("LIBTPU_INIT_ARGS", "")
        if llo:
            flags += f" {DUMP_FLAG}={os.path.join(tmp, 'dump')}"
        if code_size or keep_dump:
            flags += " " + code_size_lib.dump_args(keep_dump or os.path.join(tmp, "jf"))
        env["LIBTPU_INIT_ARGS"] = flags.strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cached executable: libtpu would dump nothing
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # this process holds libtpu's lock file too
        proc = subprocess.run(
            [sys.executable, "-m", "pallas_tpu._src.mosaic.compile_check", spec],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise CompileCheckError(f"compile_check's libtpu process failed:\n{proc.stderr[-4000:]}")
        groups = json.loads(proc.stdout.strip().splitlines()[-1])
    out = []
    for rows in groups:
        mine = []
        for r in rows:
            c = r.pop("code", None)
            mine.append((KernelCompile(**r), code_size_lib.CodeSize(**c) if c else None))
        out.append(mine)
    return out


def _child_main(spec_path: str) -> None:
    from jax import export

    with open(spec_path) as f:
        spec = json.load(f)
    dump = _dump_dir()
    jf_dump = code_size_lib.dump_dir() if spec.get("code_size") else None  # ours: a temporary one
    groups = []
    for blob in spec["blobs"]:
        rows: list[dict] = []
        groups.append(rows)
        chip, names = blob["chip"], blob["kernels"]
        with open(blob["path"], "rb") as f:
            exp = export.deserialize(bytearray(f.read()))
        shardings = [jax.sharding.SingleDeviceSharding(tpu_devices(chip)[0])] * len(exp.in_avals)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exp.in_avals, shardings)]
        before = set(_llo_files(dump)) if dump and os.path.isdir(dump) else set()
        jf_before = code_size_lib.dump_files(jf_dump)
        try:
            _jit_for(exp.call, args, chip).lower(*args).compile()
        except Exception as e:
            err = MosaicCompileError.from_libtpu(e, chip, [(n, "", "") for n in names])
            rows += [
                dict(dataclasses.asdict(KernelCompile(n, chip, False, str(err))), code=None) for n in names
            ]
            continue
        counts = _llo_counts(sorted(set(_llo_files(dump)) - before)) if dump else []
        code: Sequence[code_size_lib.CodeSize | None] = [None] * len(names)
        if jf_dump:
            new = sorted(code_size_lib.dump_files(jf_dump) - jf_before)
            code = code_size_lib.program_code_sizes(new, blob["modules"])
            for path in new if not spec.get("keep") else ():  # the final bundles: ~200 bytes a bundle
                os.remove(path)
        for i, n in enumerate(names):
            ops, loop = counts[i] if i < len(counts) else (None, None)
            c = code[i]
            row = dataclasses.asdict(KernelCompile(n, chip, True, None, ops, loop, *_size_fields(c)))
            rows.append(dict(row, code=dataclasses.asdict(c) if c is not None else None))
    print(json.dumps(groups))


if __name__ == "__main__":
    _child_main(sys.argv[1])
