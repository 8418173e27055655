"""How much code a TPU kernel compiled to, and whether it fits the core's instruction memory.

A TensorCore runs its program from a small instruction memory. A program larger than that
is split by libtpu into overlays, pieces fetched from HBM as control reaches them; a kernel
whose grid loop crosses overlays fetches them again on every grid step (a splash attention
forward kernel of ~102k bundles, split so on the v5e, ran at a quarter of its speed). The
compile still succeeds: only libtpu's dump (``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR``, read
once per process) tells. Of it this module reads, per compiled program:

- ``*-<hlo name>-NN-schedule-analysis_final_bundles.txt``: each kernel's (each custom
  call's) ``total scheduled bundles`` (a bundle: one VLIW instruction word), and its HLO
  instruction, whose Mosaic module names the kernel;
- ``*-TLP-NN-final_bundles.txt``: the top-level program, where each kernel is an
  ``inlined_call`` at its place;
- ``*-TLP-NN-overlay-graph.txt``: the overlays (``#0`` the prelude, then ``#1``... in
  layout order) with their sizes in bundles and the jumps between them: one ``tlp`` overlay
  is a program that fits;
- ``*-TLP-NN-hlo-details.txt`` (libtpu 0.0.48 on; the last one is after overlaying): each
  instruction's ``emitted bundle range [TensorCoreSequencer:first overlay:offset,
  TensorCoreSequencer:last overlay:offset)``. Older libtpu (0.0.42.1) has no such file: a
  kernel's overlays are then estimated by laying its place in the flat program over the
  overlays' sizes (exact for a program of one piece; off by one at most at a split one's
  ends).

``--xla_jf_dump_llo_pass_label_regex`` keeps the dump to these files (the whole dump of one
large kernel is ~1 GB).
"""

from __future__ import annotations

import base64
import dataclasses
import glob
import os
import re
import warnings
from collections.abc import Sequence

DUMP_FLAG = "--xla_jf_dump_to"
# Only the passes read here (with their schedule analyses); without it libtpu dumps every pass.
PASS_FLAG = "--xla_jf_dump_llo_pass_label_regex=final_bundles|overlay-graph|hlo-details"


# A kernel's code in an overlay counts as a piece of it from this many bundles: less is its
# call's setup or exit, or a loop's latch, placed beside a neighbour's code.
PIECE = 256


class CodeSizeWarning(UserWarning):
    """A kernel's code is larger than the TensorCore's instruction memory: libtpu split it
    into overlays fetched from HBM while it runs."""


@dataclasses.dataclass(frozen=True)
class CodeSize:
    """One kernel's code as libtpu compiled it.

    bundles: its instruction bundles (libtpu's ``total scheduled bundles``).
    overlays: the overlays holding ``PIECE`` bundles of its code or more (1: it fits the
      instruction memory, or one overlay of a split program).
    exact: whether libtpu said where it lies (else estimated from the overlays' sizes).
    largest: the largest of those overlays, in bundles.
    loop_crosses: whether a jump goes back from one of the overlays its code lies in to an
      earlier one (its grid loop, or a loop around it, spans them: they are fetched again
      on every step).
    """

    bundles: int | None
    overlays: int | None
    exact: bool = False
    largest: int | None = None
    loop_crosses: bool = False


def dump_args(directory: str) -> str:
    """``LIBTPU_INIT_ARGS`` that make libtpu dump what this module reads into ``directory``."""
    return f"{DUMP_FLAG}={directory} {PASS_FLAG}"


def dump_dir(init_args: str | None = None) -> str | None:
    """Where this process's libtpu dumps its compiles (None: it does not)."""
    args = os.environ.get("LIBTPU_INIT_ARGS", "") if init_args is None else init_args
    found = re.findall(rf"{DUMP_FLAG}=(\S+)", args)
    return found[-1] if found else None


def dump_files(directory: str | None) -> set[str]:
    return set(glob.glob(os.path.join(directory, "*"))) if directory and os.path.isdir(directory) else set()


# --- the dump's files --------------------------------------------------------------------------

_NODE = re.compile(r'"#(\d+):(\w+) def:(?:#\d+|n/a) size:(\d+)[^"]*"')


def overlay_graph(text: str) -> tuple[dict[int, tuple[str, int]], list[tuple[int, int]]]:
    """``{overlay: (kind, bundles)}`` and the jumps ``(from, to)`` of an ``overlay-graph`` dump."""
    nodes: dict[int, tuple[str, int]] = {}
    edges = []
    for line in text.splitlines():
        found = _NODE.findall(line)
        for num, kind, size in found:
            nodes[int(num)] = (kind, int(size))
        if "->" in line and len(found) == 2:
            edges.append((int(found[0][0]), int(found[1][0])))
    return nodes, edges


def total_bundles(text: str) -> int | None:
    """``total scheduled bundles`` of a ``schedule-analysis_final_bundles`` dump."""
    m = re.search(r"total scheduled bundles:\s*(\d+)", text)
    return int(m.group(1)) if m else None


_INLINED = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s.*?=\s*inlined_call\b[^/]*/\*\s*(%[\w.\-]+|<[\w\-]+>)")


def inlined_calls(text: str) -> list[tuple[int, str]]:
    """``(address, name)`` of each ``inlined_call`` of a top-level ``final_bundles`` dump
    (``name``: the HLO instruction, or ``<late-initialization>``...), and ``(bundles, "")``
    last: the program's length."""
    calls, last = [], -1
    for line in text.splitlines():
        m = re.match(r"^\s*(0x[0-9a-f]+|0)\s", line)
        if not m:
            continue
        last = int(m.group(1), 16)
        c = _INLINED.match(line)
        if c:
            calls.append((last, c.group(2).lstrip("%")))
    return [*calls, (last + 1, "")]


_RANGE = re.compile(
    r"operation: %([\w.\-]+) = .*\n\s*emitted bundle range: \[\w+:(\d+):(0x[0-9a-f]+), \w+:(\d+):(0x[0-9a-f]+)\)"
)


def emitted_ranges(text: str) -> dict[str, tuple[int, int, int, int]]:
    """``{HLO name: (first overlay, offset, last overlay, end offset)}`` of a ``hlo-details``
    dump: the instruction's code runs from ``offset`` in the first to before ``end offset``
    in the last."""
    return {
        name: (int(first), int(start, 16), int(last), int(end, 16))
        for name, first, start, last, end in _RANGE.findall(text)
    }


def _exact_shares(rng: tuple[int, int, int, int], nodes) -> dict[int, int]:
    """``{overlay: the instruction's bundles in it}`` of an ``emitted_ranges`` entry."""
    first, start, last, end = rng
    if first == last:
        return {first: end - start}
    shares = {first: nodes.get(first, ("", 0))[1] - start}
    shares.update({k: nodes[k][1] for k in range(first + 1, last) if k in nodes})
    if end:
        shares[last] = end
    return {k: max(n, 0) for k, n in shares.items()}


def module_name(module_text: str) -> str | None:
    m = re.search(r'module @"?([^"\s{]+)"?', module_text)
    return m.group(1) if m else None


def _body(text: str) -> bytes:
    m = re.search(r'"body":"([A-Za-z0-9+/=]*)"', text)
    try:
        return base64.b64decode(m.group(1)) if m else b""
    except ValueError:
        return b""


# --- per program --------------------------------------------------------------------------------


def _pick(files: Sequence[str], suffix: str) -> str | None:
    """The last (by libtpu's pass number) of ``files`` ending in ``suffix``."""
    found = sorted((f for f in files if f.endswith(suffix)), key=os.path.basename)
    return found[-1] if found else None


def _read(path: str | None) -> str:
    if path is None:
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def program_code_sizes(files: Sequence[str], modules: Sequence[str | None]) -> list[CodeSize]:
    """The ``CodeSize`` of each kernel of a program, from the dump ``files`` of its one
    compile; ``modules``: the kernels' Mosaic module names (``module_name``), in program
    order. A kernel not found: ``CodeSize(None, None)``."""
    none = [CodeSize(None, None)] * len(modules)
    tlp = _read(_tlp(files, "-final_bundles.txt"))
    graph = _read(_tlp(files, "overlay-graph.txt"))
    if not tlp or not graph:
        return none
    nodes, edges = overlay_graph(graph)
    calls = inlined_calls(tlp)
    sizes = {}  # HLO name -> (bundles, Mosaic bytecode)
    for f in files:
        m = re.match(r"\d+-(.+)-\d+-schedule-analysis_final_bundles\.txt$", os.path.basename(f))
        if m and m.group(1) != "TLP":
            text = _read(f)
            sizes[m.group(1)] = (total_bundles(text), _body(text))
    exact = emitted_ranges(_read(_tlp(files, "hlo-details.txt")))
    spans = _estimated_spans(calls, sizes, nodes)
    # Which kernel each custom call is: the one whose module name its Mosaic bytecode holds
    # (the longest such name; among equal ones, the first not yet taken).
    names = [n or "" for n in modules]
    out = list(none)
    taken: set[int] = set()
    mosaic = [c for _, c in calls if sizes.get(c, (None, b""))[1]]  # the custom calls of Mosaic
    for call in mosaic:
        bundles, body = sizes[call]
        cands = [i for i, n in enumerate(names) if i not in taken and n and n.encode() in body]
        if not cands and len(mosaic) == len(modules) == 1:
            cands = [0]
        if not cands:
            continue
        i = max(cands, key=lambda j: (len(names[j]), -j))
        taken.add(i)
        shares = _exact_shares(exact[call], nodes) if call in exact else spans.get(call)
        if not shares:
            out[i] = CodeSize(bundles, None)
            continue
        # Pieces of fewer than PIECE bundles (the call's setup and exit, a loop's latch)
        # do not count as overlays of their own.
        mine = [k for k, n in shares.items() if n >= PIECE] or [max(shares, key=lambda k: shares[k])]
        first, last = min(shares), max(shares)
        back = any(first <= b < a <= last for a, b in edges)
        out[i] = CodeSize(
            bundles,
            len(mine),
            exact=call in exact,
            largest=max(nodes[k][1] for k in mine if k in nodes),
            loop_crosses=back and len(mine) > 1,
        )
    return out


def _tlp(files: Sequence[str], suffix: str) -> str | None:
    """The top-level program's dump file ending in ``suffix`` (the last such pass)."""
    return _pick([f for f in files if re.match(r"\d+-TLP-\d+-", os.path.basename(f))], suffix)


def _estimated_spans(calls, sizes, nodes) -> dict[str, dict[int, int]]:
    """``{HLO name: {overlay: its bundles in it}}``, estimated: each inlined call's place in
    the flat program (its address, plus the bundles the calls before it add) laid over the
    overlays in order, their sizes scaled to the flat program's length (each overlay adds a
    few bundles of its own)."""
    pieces = sorted((k, size) for k, (kind, size) in nodes.items() if kind != "prelude")
    if not pieces:
        return {}
    places, shift = [], 0
    for address, name in calls:
        if not name:
            flat_total = address + shift
            break
        n = sizes.get(name, (None, b""))[0] or 1
        places.append((name, address + shift, n))
        shift += n - 1
    else:
        return {}
    scale = flat_total / max(sum(s for _, s in pieces), 1)
    bounds, at = [], 0.0
    for k, size in pieces:
        bounds.append((k, at, at + size * scale))
        at += size * scale
    out = {}
    for name, start, n in places:
        if name in sizes:
            shares = {k: round(min(hi, start + n) - max(lo, start)) for k, lo, hi in bounds}
            out[name] = {k: v for k, v in shares.items() if v > 0}
    return out


def warn_if_split(kernel: str, chip: str, size: CodeSize, stacklevel: int = 3) -> None:
    """``CodeSizeWarning`` when ``kernel`` was split into overlays on ``chip`` and that costs:
    its loop crosses them, or it is larger than any of them. A small kernel that only
    straddles a cut of a large program (its overlays fetched once per call) is not warned of."""
    if not size.overlays or size.overlays <= 1 or size.bundles is None:
        return
    if not size.loop_crosses and size.bundles <= (size.largest or 0):
        return
    loop = (
        "; its grid loop crosses them, so they are fetched from HBM again on every grid step"
        if size.loop_crosses
        else "; they are fetched from HBM as it runs"
    )
    warnings.warn(
        f"{kernel} compiles for TPU {chip} to {size.bundles} bundles, more than the TensorCore's "
        f"instruction memory holds: libtpu split it into {size.overlays} overlays (the largest "
        f"{size.largest} bundles){loop}. Make its code smaller: smaller blocks, or fewer tiles "
        f"unrolled per grid step (a loop over them instead of straight-line code).",
        CodeSizeWarning,
        stacklevel=stacklevel,
    )
