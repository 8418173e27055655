"""libtpu's final bundles of a TPU program, read and run cycle by cycle.

libtpu's dump (``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR``, see ``code_size``) writes each
compiled HLO instruction's ``*-<hlo name>-NN-final_bundles.txt``: the VLIW instruction
words (bundles) of the TensorCore in issue order, each with its ops (scalar, vector,
load/store, MXU, transcendental, cross-lane, DMA), its loop depth (``>``) and the regions
branches jump to. ``parse`` reads them; ``simulate`` runs them:

* the scalar unit exactly, where it can: the grid loop's indices, ``pl.when`` predicates,
  the pipeline's slot and guard logic (``s*``, ``p*``, ``scalar_*`` ops, scalar memory and
  its spill slots), so the path each grid step takes and the number of iterations of every
  loop come from the program itself. The scalar-prefetch operands' values, where the caller
  knows them (``simulate``'s ``operands``: the custom call's operands by index), are written
  into scalar memory by the DMAs that copy those operands there, so the loops and DMAs that
  depend on them (page tables, lengths, group offsets) run as on the chip. A value it cannot
  know (an operand not given, popped from a vector) is unknown: a branch on an unknown
  predicate is taken as not taken (a forward branch runs the code it guards; a backward one
  leaves its loop), and counted (``SimResult.unknown_branches``);
* one bundle a cycle (the core issues in order), plus stalls where a bundle waits:
  ``dma.done.wait`` until its DMA completed (DMAs through one HBM pipe at the chip's
  bandwidth, each starting a fixed latency after its issue (``Machine.dma_latency_cycles``)
  and adding its granules to its sync flag when done), a result pop from an
  MXU until the pass that produced it is through (each MXU a queue of passes: a pushed
  vreg of rows at ``rows_per_cycle``), ``vwait``/``vdelay``;
* counts per unit (MXU passes and weight pushes, vector ALU, loads, stores,
  transcendental (EUP), cross-lane (XLU), scalar, DMA bytes), per iteration of the
  outermost loop (the grid loop of a Pallas kernel), and one iteration's events for a
  timeline.

What it does not model: VMEM bank conflicts, HBM latency beyond the fixed one and refresh, the DMA engine's
queue limits, contention with the other core of a megacore chip, ICI. ``Machine`` carries
the chip's constants (``pallas_tpu._src.estimate.CHIPS``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

# --- parsing ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Op:
    """One op of a bundle: ``dst = name args``, guarded by ``guard`` (a predicate register,
    ``negate`` for ``!%p``); ``select``: ``(pred, fallback)`` of ``smov (%p, %s), imm``
    (``select_negate`` for ``smov (!%p, %s), imm``: the value where ``%p`` is false)."""

    name: str
    dst: str | None
    args: list[str]
    guard: str | None = None
    negate: bool = False
    select: tuple[str, str] | None = None
    text: str = ""
    select_negate: bool = False


@dataclasses.dataclass
class Bundle:
    addr: int
    depth: int  # loop nesting ('>' marks)
    ops: list[Op]
    text: str
    label: str = ""  # LB (loop body), PF (fallthrough), ...


_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(LB|LH|LE|PB|PF|CT)?:\s*(>*)\s*\{")
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_REGION = re.compile(r"(Start|Start/End empty) region (\d+)")
_GUARD = re.compile(r"\((!?)(%p\w+)\)")
_SELECT = re.compile(r"\((!?)(%p\w+),\s*(%\w+)\)")
_OP = re.compile(r"^(?:(%[\w#]+)\s*=\s*)?([a-z_][\w.\-]*)(.*)$", re.S)


def _split_args(rest: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in rest:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return [a for a in out if a]


def parse_op(part: str) -> Op | None:
    m = _OP.match(part.strip())
    if not m:
        return None
    dst, name, rest = m.group(1), m.group(2), m.group(3)
    select, select_negate = None, False
    s = _SELECT.search(rest)
    if s:
        select, select_negate = (s.group(2), s.group(3)), s.group(1) == "!"
        rest = rest[: s.start()] + rest[s.end() :]
    guard, negate = None, False
    g = _GUARD.search(rest)
    if g:
        guard, negate = g.group(2), g.group(1) == "!"
        rest = rest[: g.start()] + rest[g.end() :]
    rest = re.sub(r"\[thread:\$\d+\]", "", rest)
    return Op(name, dst, _split_args(rest), guard, negate, select, part.strip(), select_negate)


def parse(text: str) -> tuple[list[Bundle], dict[int, int]]:
    """The bundles of a ``final_bundles`` dump and ``{region: the index of its first bundle}``."""
    raw: list[list] = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            addr = int(m.group(1), 16) if m.group(1).startswith("0x") else int(m.group(1))
            raw.append([addr, len(m.group(3)), m.group(2) or "", line])
        elif raw:
            raw[-1][3] += "\n" + line
    bundles: list[Bundle] = []
    regions: dict[int, int] = {}
    for addr, depth, label, full in raw:
        for _, num in _REGION.findall(full):
            regions.setdefault(int(num), len(bundles))
        body = _COMMENT.sub("", full)
        body = body.split("{", 1)[1].rsplit("}", 1)[0] if "}" in body else body.split("{", 1)[-1]
        ops = [op for part in body.split(";;") if part.strip() and (op := parse_op(part))]
        bundles.append(Bundle(addr, depth, ops, full, label))
    return bundles, regions


# --- what each op is ----------------------------------------------------------------------------

EUP_OPS = ("vpow2", "vexp", "vtanh", "vrcp", "vrsqrt", "vlog2", "vlog", "vsqrt", "vsin", "vcos", "verf")
DTYPE_BITS = {
    "bf16": 16,
    "f16": 16,
    "f32": 32,
    "s8": 8,
    "u8": 8,
    "s4": 4,
    "u4": 4,
    "f8": 8,
    "e4m3": 8,
    "e5m2": 8,
}


def unit_of(name: str) -> str:
    """The unit an op occupies a slot of: scalar, vector (ALU), load, store, eup
    (transcendental), xlu (cross-lane), mxu, dma, sync or misc."""
    if name.startswith(("vmatmul", "vmatpush", "vmatprep", "vdwg")) or re.match(
        r"vpop\.\w+\.(mrf|mrb)", name
    ):
        return "mxu"
    if name.startswith("dma."):
        return "dma"
    if name.startswith(("vsync", "vwait", "vdelay", "sfence", "cfence")):
        return "sync"
    if name.startswith("vld") or name == "cld":
        return "load"
    if name.startswith("vst") or name == "cst":
        return "store"
    if name.startswith(EUP_OPS):
        return "eup"
    if ".xlu" in name or name.startswith(
        ("vpop.xlane", "vpop.trf", "vpop.permute", "vxpose", "vperm", "vrot", "vbcast")
    ):
        return "xlu"
    if name.startswith("v"):
        return "vector"
    if name.startswith(("s", "p", "scalar_", "int_to_ptr")) and name not in ("sbr.rel",):
        return "scalar"
    return "misc"


def _mxu_id(name: str) -> str | None:
    m = re.search(r"\.(mxu\d+)", name)
    return m.group(1) if m else None


def rows_per_vreg(name: str, sublanes: int = 8) -> int:
    """Rows of the left operand one pushed vreg holds (packed: 16 of bf16, 32 of int8)."""
    for part in name.split("."):
        if part in DTYPE_BITS:
            return sublanes * max(1, 32 // DTYPE_BITS[part])
    return sublanes


# --- the machine --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Machine:
    """What ``simulate`` needs of a chip (one TensorCore)."""

    mxu_width: int = 128  # a pass: rows x width x width MACs
    mxu_rows_per_cycle: float = 1.0
    hbm_bytes_per_cycle: float = 546.0  # the DMA pipe to HBM
    local_bytes_per_cycle: float = 4096.0  # VMEM <-> VMEM/SMEM DMAs
    dma_latency_cycles: int = 0
    granule_bytes: int = 32  # DMA sizes are given in granules
    delay_slots: int = 4  # bundles after a branch that run before it takes effect
    sublanes: int = 8


@dataclasses.dataclass
class IterationStats:
    """One iteration of the outermost loop (a grid step of a kernel)."""

    start: int = 0
    cycles: int = 0
    bundles: int = 0
    stall_dma: int = 0
    stall_mxu: int = 0
    stall_other: int = 0
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    mxu_busy: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # cycles per MXU
    mxu_passes: int = 0
    flops: float = 0.0
    dma_bytes: float = 0.0
    hbm_bytes: float = 0.0


@dataclasses.dataclass
class SimResult:
    cycles: float  # the program's, start to end
    bundles_issued: int
    iterations: list[IterationStats]  # of the outermost loop
    loop_start: int | None  # cycle the outermost loop was entered
    loop_end: int | None  # cycle it was left
    first_wait_end: int | None  # cycle the first stalling DMA wait ended
    last_compute: int | None  # cycle of the last MXU or vector store op
    totals: IterationStats  # the whole program
    unknown_branches: int  # branches taken on an unknown predicate (as not taken)
    truncated_iterations: int  # outermost-loop iterations not simulated (extrapolated)
    timeline: list[tuple[int, str, int, str]]  # (cycle, unit, duration, op) of one iteration
    timeline_iteration: int | None
    stalls_total: dict[str, int] = dataclasses.field(default_factory=dict)


class _Unknown:
    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()
_M32 = 0xFFFFFFFF


def _s32(x: int) -> int:
    x &= _M32
    return x - (1 << 32) if x & 0x80000000 else x


_ALLOC = re.compile(r"^\[?#(allocation\d+(?:_spill)?)(?:\s*\+\s*\$?(0x[0-9a-f]+|\d+))?\]?$")


_PHYS = re.compile(r"^%\w*?_([spv]\d+)$")


def reg_key(tok: str) -> str:
    """The physical register of an SSA name (``%s8036_s20`` -> ``s20``): the machine's state,
    which a loop's ``sphi`` (always of one register) leaves as it is."""
    m = _PHYS.match(tok)
    return m.group(1) if m else tok


_SCALAR_OPERAND = re.compile(r"inlined_call_operand\.<no memory space>\s*\[.*?index:\s*(\d+)")
_OPERAND_INDEX = re.compile(r"inlined_call_operand\.\w+\s*\[.*?index:\s*(\d+)")


def operand_of(bundles: list[Bundle], reg: str) -> int | None:
    """The custom call's operand index whose address the SSA register ``reg`` holds: its
    definitions followed back (moves, shifts, pointer casts) to an ``inlined_call_operand``."""
    defs = {op.dst: op for bd in bundles for op in bd.ops if op.dst}
    seen = set()
    while reg in defs and reg not in seen:
        seen.add(reg)
        op = defs[reg]
        m = _OPERAND_INDEX.search(op.text)
        if m:
            return int(m.group(1))
        if not op.name.startswith(("int_to_ptr", "sshll", "sshrl", "smov")):
            return None
        regs = [r for a in op.args for r in re.findall(r"%s\w+", a)]  # int_to_ptr [resolvable:$true] %s
        if not regs:
            return None
        reg = regs[0]
    return None


def smem_words(value) -> list[int] | None:
    """An operand's value as the 32-bit words scalar memory holds (ints and bools widened,
    32-bit floats as their bits), in its layout there: an array of two or more dimensions in
    tiles of 8 x 128 words (its last two dimensions padded to them), tile after tile, as
    libtpu's bundles show (a 7 x 23 table is copied as 128 granules of 32 B, 8 x 128 words,
    and read at ``row * 128 + column``); None for what does not fit in 32-bit words."""
    import numpy as np

    a = np.asarray(value)
    if a.dtype.kind in "biu" and a.dtype.itemsize <= 4:
        w = a.astype(np.int64) & _M32
    elif a.dtype == np.float32:
        w = a.view(np.uint32).astype(np.int64)
    else:
        return None
    if w.ndim >= 2:
        r, c = w.shape[-2:]
        pr, pc = -(-r // 8) * 8, -(-c // 128) * 128
        w = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pr - r), (0, pc - c)])
        w = w.reshape(*w.shape[:-2], pr // 8, 8, pc // 128, 128).swapaxes(-3, -2)
    return [int(x) for x in w.ravel()]


class _Sim:
    def __init__(
        self,
        bundles,
        regions,
        machine: Machine,
        budget: int,
        record_iteration: int | None,
        operands: dict[int, Any] | None = None,
    ):
        self.b, self.regions, self.m = bundles, regions, machine
        self.operands = operands or {}
        self.operand_words: dict[str, list[int] | None] = {}
        self.budget = budget
        self.reg: dict[str, object] = {}
        self.mem: dict[object, object] = {}
        self.flags: dict[Any, list] = {}  # key -> [base value, [(time, delta)...]]
        self.mxu_free: dict[str, float] = collections.defaultdict(float)
        self.mxu_results: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.mxu_of_prep: collections.deque = collections.deque()
        self.dma_free = {"hbm": 0.0, "local": 0.0}
        self.unknown_branches = 0
        self.record_iteration = record_iteration
        self.timeline: list[tuple[int, str, int, str]] = []

    # values
    def val(self, tok: str):
        tok = tok.strip()
        if tok.startswith("%"):
            return self.reg.get(reg_key(tok), UNKNOWN)
        m = _ALLOC.match(tok)
        if m:
            return (m.group(1), int(m.group(2), 0) if m.group(2) else 0)
        tok = tok.lstrip("$")
        try:
            return int(tok, 0)
        except ValueError:
            return UNKNOWN

    def truth(self, op: Op):
        if op.guard is None:
            return True
        v = self.reg.get(reg_key(op.guard), UNKNOWN)
        if v is UNKNOWN:
            return UNKNOWN
        return (not v) if op.negate else bool(v)

    def addr(self, tok: str):
        """A scalar-memory address: ``[smem:[#allocation3]]``, ``[smem:[%s + $0x4]]``."""
        m = re.match(r"\[\w+:\[(.*)\]\]", tok.strip())
        inner = m.group(1) if m else tok
        parts = [p.strip() for p in inner.split("+")]
        base = self.val(parts[0]) if parts[0].startswith("%") else self.val(f"[{parts[0]}]")
        off = 0
        for p in parts[1:]:
            v = self.val(p)
            if not isinstance(v, int):
                return UNKNOWN
            off += v
        if isinstance(base, tuple) and isinstance(base[1], int):
            return (base[0], base[1] + off)
        if isinstance(base, int):
            return base + off
        return UNKNOWN

    # flags (sync flags: DMA completion counters, semaphores)
    def _flag_key(self, tok: str):
        v = self.val(tok)
        return v if isinstance(v, tuple) else UNKNOWN

    def flag_add(self, key, t, delta):
        if key is UNKNOWN:
            return
        self.flags.setdefault(key, [0, []])[1].append((t, delta))

    def flag_ready(self, key, t, pred) -> float | None:
        """The earliest time >= t at which ``pred(value)`` holds, or None if never (by what is known)."""
        entries = [
            v
            for k, v in self.flags.items()
            if key is UNKNOWN or k == key or (k[0] == key[0] and key[1] is UNKNOWN)
        ]
        if not entries:
            return None
        base = 0
        events = []
        for e in entries:
            past = [d for tt, d in e[1] if tt <= t]
            e[0] += sum(past)
            e[1] = [(tt, d) for tt, d in e[1] if tt > t]
            base += e[0]
            events += e[1]
        if pred(base):
            return t
        for tt, d in sorted(events):
            base += d
            if pred(base):
                return tt
        return None

    def run(self):  # noqa: C901 (one interpreter loop)
        b, m = self.b, self.m
        n = len(b)
        t = 0
        pc = 0
        pending: list[int] | None = None  # [target, countdown]
        outer_head = next((i for i, x in enumerate(b) if x.depth == 1), None)
        outer_last = None
        if outer_head is not None:
            outer_last = outer_head
            while outer_last + 1 < n and b[outer_last + 1].depth >= 1:
                outer_last += 1
            outer_exit = outer_last + max(m.delay_slots, 0) + 1
        iters: list[IterationStats] = []
        totals = IterationStats()
        cur: IterationStats | None = None
        loop_start = loop_end = first_wait_end = last_compute = None
        visits = 0
        truncated = 0
        stalls_total = collections.Counter()
        cycles_per_pass_cache: dict[str, float] = {}
        while pc < n:
            bundle = b[pc]
            if outer_head is not None and pc == outer_head:
                if cur is not None:
                    cur.cycles = t - cur.start
                    iters.append(cur)
                else:
                    loop_start = t
                cur = IterationStats(start=t)
                if visits > self.budget and len(iters) >= 3:
                    truncated = -1  # filled in by the caller from the loop bound
                    break
            elif outer_head is not None and cur is not None and loop_end is None and pc >= outer_exit:
                cur.cycles = t - cur.start
                iters.append(cur)
                cur = None
                loop_end = t
            visits += 1
            recording = (
                self.record_iteration is not None and cur is not None and len(iters) == self.record_iteration
            )
            # --- stalls: the bundle issues when every op it holds can
            ready = t
            why = None
            for op in bundle.ops:
                name = op.name
                if name == "dma.done.wait" or name.startswith("vwait"):
                    if self.truth(op) is False:
                        continue
                    args = op.args
                    if name == "dma.done.wait":
                        key, need = self._flag_key(args[0]), self.val(args[1])
                        pred = (
                            (lambda v, need=need: v >= need) if isinstance(need, int) else (lambda v: v > 0)
                        )
                    else:
                        key, need = self._flag_key(args[0]), self.val(args[1]) if len(args) > 1 else 0
                        if not isinstance(need, int):
                            continue
                        need = _s32(need)
                        cmp = name.split(".")[1]
                        pred = {
                            "ge": lambda v, n_=need: _s32(v) >= n_,
                            "ne": lambda v, n_=need: _s32(v) != n_,
                            "eq": lambda v, n_=need: _s32(v) == n_,
                            "lt": lambda v, n_=need: _s32(v) < n_,
                            "gt": lambda v, n_=need: _s32(v) > n_,
                            "le": lambda v, n_=need: _s32(v) <= n_,
                        }.get(cmp, lambda v: True)
                    r = self.flag_ready(key, t, pred)
                    if r is not None and r > ready:
                        ready, why = r, "dma"
                elif name.startswith("vpop") and (".mrf" in name or ".mrb" in name):
                    unit = _mxu_id(name) or "mrb"
                    q = self.mxu_results[unit]
                    if q:
                        done, left = q[0]
                        if done > ready:
                            ready, why = done, "mxu"
                        if left <= 1:
                            q.popleft()
                        else:
                            q[0] = (done, left - 1)
                elif name == "vdelay":
                    v = self.val(op.args[0]) if op.args else 1
                    if isinstance(v, int) and t + v > ready:
                        ready, why = t + v, "other"
            stall = int(math.ceil(ready - t))
            if stall > 0:
                kind = why or "other"
                stalls_total[kind] += stall
                for st in (cur, totals):
                    if st is not None:
                        setattr(st, f"stall_{kind}", getattr(st, f"stall_{kind}") + stall)
                if recording:
                    self.timeline.append((t - cur.start, "stall " + kind, stall, ""))
                t += stall
                if kind == "dma" and first_wait_end is None:
                    first_wait_end = t
            # --- effects
            writes = []
            branch = None
            for op in bundle.ops:
                name = op.name
                unit = unit_of(name)
                for st in (cur, totals):
                    if st is not None:
                        st.ops[unit] += 1
                if recording and unit not in ("misc",):
                    self.timeline.append((t - cur.start, unit, 1, name))
                ok = self.truth(op)
                if name == "sbr.rel":
                    target = re.search(r"\$region(\d+)", op.text)
                    if target is None or int(target.group(1)) not in self.regions:
                        continue
                    if ok is UNKNOWN:
                        self.unknown_branches += 1
                        ok = False
                    if ok:
                        branch = self.regions[int(target.group(1))]
                    continue
                if unit == "mxu":
                    if name.startswith("vmatprep.mubr"):
                        self.mxu_of_prep.append(_mxu_id(name))
                    if name.startswith("vmatmul") and ok is not False:
                        mid = _mxu_id(name)
                        if mid is None:
                            mid = self.mxu_of_prep.popleft() if self.mxu_of_prep else "mrb"
                        rows = rows_per_vreg(name, m.sublanes)
                        c = cycles_per_pass_cache.get(name)
                        if c is None:
                            c = cycles_per_pass_cache[name] = rows / m.mxu_rows_per_cycle
                        start = max(t, self.mxu_free[mid])
                        self.mxu_free[mid] = start + c
                        # results: rows of f32, one vreg (sublanes rows) a pop
                        unit_q = _mxu_id(name) or "mrb"
                        self.mxu_results[unit_q].append((start + c, max(1, rows // m.sublanes)))
                        flops = 2.0 * rows * m.mxu_width * m.mxu_width
                        for st in (cur, totals):
                            if st is not None:
                                st.mxu_busy[mid] += c
                                st.mxu_passes += 1
                                st.flops += flops
                        if recording:
                            self.timeline.append((int(start) - cur.start, "MXU " + mid, int(c), name))
                        last_compute = t
                    continue
                if unit == "store":
                    last_compute = t
                if ok is False:
                    continue
                if unit == "dma" and name != "dma.done.wait":
                    self._dma(op, t, cur, totals, recording)
                    continue
                if name.startswith("vsyncadd"):
                    a = [x for x in op.args]
                    if len(a) >= 2:
                        d = self.val(a[-1])
                        if isinstance(d, int):
                            self.flag_add(self._flag_key(a[0]), t, _s32(d))
                    continue
                if name.startswith("vsyncpa"):
                    if len(op.args) >= 2:
                        key, v = self._flag_key(op.args[0]), self.val(op.args[1])
                        if key is not UNKNOWN and isinstance(v, int):
                            self.flags[key] = [v, []]
                    continue
                if name == "sst":
                    if ok is True:
                        self._store(op)
                    elif ok is UNKNOWN:
                        a = self.addr(op.args[0].split()[0]) if op.args else UNKNOWN
                        if a is not UNKNOWN:
                            self.mem[a] = UNKNOWN
                    continue
                if name.startswith("inlined_call_operand") and op.dst is not None and self.operands:
                    writes.append((reg_key(op.dst), self._eval(op)))
                    continue
                if unit != "scalar" or op.dst is None or not op.dst.startswith(("%s", "%p")):
                    continue
                if name == "sphi":  # one register on both edges: nothing to do
                    continue
                v = self._eval(op)
                if ok is UNKNOWN:
                    v = UNKNOWN
                writes.append((reg_key(op.dst), v))
            for dst, v in writes:
                self.reg[dst] = v
            for st in (cur, totals):
                if st is not None:
                    st.bundles += 1
            t += 1
            if pending is not None:
                pending[1] -= 1
                if pending[1] < 0:
                    pc = pending[0]
                    pending = None
                    continue
            if branch is not None:
                if m.delay_slots <= 0:
                    pc = branch
                    continue
                pending = [branch, m.delay_slots - 1]
            pc += 1
        if cur is not None and truncated == 0:
            cur.cycles = t - cur.start
            iters.append(cur)
            loop_end = loop_end if loop_end is not None else t
        totals.cycles = t
        return SimResult(
            cycles=float(t),
            bundles_issued=totals.bundles,
            iterations=iters,
            loop_start=loop_start,
            loop_end=loop_end,
            first_wait_end=first_wait_end,
            last_compute=last_compute,
            totals=totals,
            unknown_branches=self.unknown_branches,
            truncated_iterations=truncated,
            timeline=self.timeline,
            timeline_iteration=self.record_iteration if self.timeline else None,
            stalls_total=dict(stalls_total),
        )

    def _dma(self, op: Op, t, cur, totals, recording):
        name, args = op.name, op.args
        m = self.m
        if name.startswith("dma.hbm_to_smem") or name.startswith("dma.vmem_to_smem"):
            size, flag = self.val(args[1]) if len(args) > 1 else UNKNOWN, args[3] if len(args) > 3 else None
        else:
            size, flag = (
                (self.val(args[1]) if len(args) > 1 else UNKNOWN),
                (args[3] if len(args) > 3 else None),
            )
        if not isinstance(size, int):
            size = 0
        if name.endswith("_to_smem") and self.operands and len(args) > 2:
            self._fill_smem(args[0], args[2])
        nbytes = size * m.granule_bytes
        pipe = "hbm" if ("hbm" in name or "cmem" in name) else "local"
        rate = m.hbm_bytes_per_cycle if pipe == "hbm" else m.local_bytes_per_cycle
        start = max(t + m.dma_latency_cycles, self.dma_free[pipe])
        done = start + nbytes / rate
        self.dma_free[pipe] = done
        if flag is not None:
            self.flag_add(self._flag_key(flag), done, size)
        for st in (cur, totals):
            if st is not None:
                st.dma_bytes += nbytes
                if pipe == "hbm":
                    st.hbm_bytes += nbytes
        if recording and cur is not None:
            self.timeline.append((int(start) - cur.start, "DMA " + pipe, max(1, int(done - start)), name))

    def _fill_smem(self, src: str, dst: str):
        """A DMA into scalar memory from a custom call's operand whose value is known: its
        words written at the destination."""
        if src not in self.operand_words:
            idx = operand_of(self.b, src)
            known = self.operands.get(idx) if idx is not None else None
            self.operand_words[src] = smem_words(known) if known is not None else None
        words = self.operand_words[src]
        at = self.val(dst)
        if words is None or not (isinstance(at, tuple) and isinstance(at[1], int)):
            return
        for i, w in enumerate(words):
            self.mem[(at[0], at[1] + i)] = w

    def _store(self, op: Op):
        m = re.match(r"(\[.*\])\s*,?\s*(\S+)$", " ".join(op.args).strip(), re.S)
        if not m:
            return
        a = self.addr(m.group(1))
        if a is not UNKNOWN:
            self.mem[a] = self.val(m.group(2))

    def _eval(self, op: Op):  # noqa: C901
        name, a = op.name, op.args
        if op.select is not None:  # smov (%p, %fallback), value: p ? value : fallback
            p = self.val(op.select[0])
            if p is UNKNOWN:
                return UNKNOWN
            if op.select_negate:  # smov (!%p, %fallback), value: p ? fallback : value
                p = not p
            return self.val(a[0]) if p else self.val(op.select[1])
        base = name.split(".")[0]
        if base == "inlined_call_operand":  # a scalar operand passed in a register: its value
            m = _SCALAR_OPERAND.search(op.text)
            words = (
                smem_words(self.operands[int(m.group(1))]) if m and int(m.group(1)) in self.operands else None
            )
            return words[0] if words and len(words) == 1 else UNKNOWN
        if base in ("smov", "int_to_ptr", "reloc"):
            return self.val(a[-1]) if a else UNKNOWN
        if name == "sld":
            addr = self.addr(a[0]) if a else UNKNOWN
            return self.mem.get(addr, UNKNOWN) if addr is not UNKNOWN else UNKNOWN
        if name == "scalar_select":
            p = self.val(a[0])
            if p is UNKNOWN:
                return UNKNOWN
            return self.val(a[1]) if p else self.val(a[2])
        if name.startswith("scalar_lea"):
            if not a:
                return UNKNOWN
            b0 = self.val(a[0])
            off = self.val(a[1]) if len(a) > 1 else 0
            if isinstance(b0, tuple):
                return (b0[0], b0[1] + off if isinstance(off, int) and isinstance(b0[1], int) else UNKNOWN)
            return UNKNOWN
        if name in ("pneg",):
            v = self.val(a[0])
            return UNKNOWN if v is UNKNOWN else (not v)
        if base in ("por", "pand", "pnand", "pnor", "pxor"):
            x, y = self.val(a[0]), self.val(a[1])
            if base == "por" and (x is True or y is True):
                return True
            if base in ("pand", "pnand") and (x is False or y is False):
                return base == "pnand"
            if x is UNKNOWN or y is UNKNOWN:
                return UNKNOWN
            return {
                "por": x or y,
                "pand": x and y,
                "pnand": not (x and y),
                "pnor": not (x or y),
                "pxor": bool(x) != bool(y),
            }[base]
        if base == "scmp":
            x, y = self.val(a[0]), self.val(a[1])
            if not (isinstance(x, int) and isinstance(y, int)) or isinstance(x, bool) or isinstance(y, bool):
                if (
                    isinstance(x, tuple)
                    and isinstance(y, tuple)
                    and x[0] == y[0]
                    and isinstance(x[1], int)
                    and isinstance(y[1], int)
                ):
                    x, y = x[1], y[1]
                else:
                    return UNKNOWN
            parts = name.split(".")
            cmp = parts[1]
            if len(parts) > 2 and parts[2].startswith("s"):
                x, y = _s32(x), _s32(y)
            else:
                x, y = x & _M32, y & _M32
            return {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y}.get(
                cmp, UNKNOWN
            )
        if len(a) == 2 and base in _ARITH:
            x, y = self.val(a[0]), self.val(a[1])
            if isinstance(x, tuple) and isinstance(y, int) and base in ("sadd",) and isinstance(x[1], int):
                return (x[0], x[1] + y)
            if isinstance(y, tuple) and isinstance(x, int) and base in ("sadd",) and isinstance(y[1], int):
                return (y[0], y[1] + x)
            if not (isinstance(x, int) and isinstance(y, int)):
                return UNKNOWN
            try:
                return _ARITH[base](int(x), int(y)) & _M32
            except ZeroDivisionError:
                return UNKNOWN
        return UNKNOWN


_ARITH = {
    "sadd": lambda x, y: x + y,
    "ssub": lambda x, y: x - y,
    "smul": lambda x, y: (x & _M32) * (y & _M32),
    "sand": lambda x, y: x & y,
    "sor": lambda x, y: x | y,
    "sxor": lambda x, y: x ^ y,
    "sshll": lambda x, y: (x & _M32) << (y & 31),
    "sshrl": lambda x, y: (x & _M32) >> (y & 31),
    "sshra": lambda x, y: _s32(x) >> (y & 31),
    "smin": lambda x, y: min(x & _M32, y & _M32),
    "smax": lambda x, y: max(x & _M32, y & _M32),
    "sdiv": lambda x, y: (x & _M32) // (y & _M32),
    "srem": lambda x, y: (x & _M32) % (y & _M32),
}


def simulate(
    bundles: list[Bundle],
    regions: dict[int, int],
    machine: Machine,
    *,
    budget: int = 400_000,
    record_iteration: int | None = None,
    operands: dict[int, Any] | None = None,
) -> SimResult:
    """Runs the program: see the module's docstring. ``budget``: bundles to run before the
    outermost loop's remaining iterations are left to the caller to extrapolate
    (``SimResult.truncated_iterations`` is then -1); ``record_iteration``: the outermost
    loop's iteration whose events make ``SimResult.timeline``; ``operands``: known values of
    the custom call's operands by index (arrays), those copied into scalar memory (scalar
    prefetch) read from there by the scalar unit."""
    return _Sim(bundles, regions, machine, budget, record_iteration, operands).run()


def loop_bound(bundles: list[Bundle]) -> int | None:
    """The outermost loop's iteration count, from its ``loop exit test`` (``scmp.ge i, N``)."""
    for bd in bundles:
        if bd.depth == 1 and "loop exit test" in bd.text:
            m = re.search(r"scmp\.ge\.s32\.totalorder %\w+, (\d+) /\* loop exit test", bd.text)
            if m:
                return int(m.group(1))
    return None
