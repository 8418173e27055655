"""The framework of ``run_mosaic`` (see ``run.py``), cut as XLA's MLIR
interpreter is: the op registry, the preparation of a module's regions, and
the walk that runs them. The rules themselves are in ``dialects/``, one module
per dialect, each registering its ops with ``@rule``.

A rule is ``rule(ex, op, vals, env) -> list of results`` (or ``None`` for an
op without results): ``ex`` the core's ``Executor``, ``op`` the op (its
``OpView``: attributes and named operands), ``vals`` its operands' values and
``env`` the values in scope (``ir.Value`` to value). A rule registered with
``regions=True`` (``scf.if``, ``scf.for``...) also gets the op's regions,
prepared, and runs them with ``ex.run(region, args, env)``.

A module is prepared once per ``run_mosaic`` call (``Program``), before any
grid point runs: each region becomes a list of steps, each step an op with
its rule looked up, its operands and results, and its own regions prepared.
The walk itself then touches no MLIR binding (but ``ir.Value`` keys of the
environment); rules read an op's attributes, result types and named operands
where they need them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from pallas_tpu._src.executor.errors import MosaicError, where
from pallas_tpu._src.executor.mesh import Mesh
from pallas_tpu._src.executor.values import Buffer, allocate

Rule = Callable[..., list[Any] | None]
RULES: dict[str, Rule] = {}  # op name -> rule
_TAKES_REGIONS: set[str] = set()  # ops whose rule gets the op's prepared regions
TERMINATORS = frozenset({"func.return", "scf.yield", "tpu.yield", "scf.condition"})


def rule(*names: str, regions: bool = False):
    """Registers the decorated function as the rule of the ops ``names``."""

    def register(fn: Rule) -> Rule:
        for n in names:
            RULES[n] = fn
            if regions:
                _TAKES_REGIONS.add(n)
        return fn

    return register


# -- preparation ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """One op of a prepared region."""

    op: Any  # the op's OpView
    rule: Rule | None  # None: no rule (an error if the op is reached)
    operands: tuple[Any, ...]  # ir.Values
    results: tuple[Any, ...]
    regions: tuple[Region, ...] | None  # for the rules registered with regions=True


@dataclasses.dataclass(frozen=True)
class Region:
    """A region's entry block, prepared: its arguments, its ops up to the
    terminator, and the terminator's operands (what running it gives back)."""

    args: tuple[Any, ...]
    steps: tuple[Step, ...]
    returns: tuple[Any, ...]


def prepare(region) -> Region:
    """An MLIR region (its entry block) as a ``Region``; an empty region
    (``scf.if`` without ``else``) runs nothing and gives nothing back."""
    if not len(region.blocks):
        return Region((), (), ())
    block = region.blocks[0]
    steps = []
    returns: tuple[Any, ...] = ()
    for op in block.operations:
        operation = op.operation
        name = operation.name
        if name in TERMINATORS:
            returns = tuple(operation.operands)
            break
        steps.append(
            Step(
                op=op,
                rule=RULES.get(name),
                operands=tuple(operation.operands),
                results=tuple(operation.results),
                regions=tuple(prepare(r) for r in operation.regions) if name in _TAKES_REGIONS else None,
            )
        )
    return Region(tuple(block.arguments), tuple(steps), returns)


class Program:
    """A module's functions (``func.func`` by name), prepared once and shared
    by every core of a ``run_mosaic`` call; ``mxu_rounding``: float matmuls
    round their operands as the MXU does (``run_mosaic``'s argument)."""

    def __init__(self, funcs: dict[str, Any], mxu_rounding: bool = False):
        self.funcs = {name: prepare(f.regions[0]) for name, f in funcs.items()}
        self.mxu_rounding = mxu_rounding


# -- the walk -------------------------------------------------------------------


class Executor:
    """Runs one core's kernel: ``device`` is its unit of ``mesh`` (device id
    ``chip``, core ``core``)."""

    def __init__(self, program: Program, mesh: Mesh, device: int, iteration_bounds: list[int]):
        self.program = program
        self.mesh = mesh
        self.device = device
        self.chip, self.core = divmod(device, mesh.num_cores)
        self.allocations: dict[Any, int] = {}
        self.iteration_bounds = (
            iteration_bounds  # the grid (dynamic sizes filled in), for tpu.iteration_bound
        )
        self.prng_state = None  # the hardware PRNG's state (see dialects/tpu_vector.py)

    def allocate(self, op) -> Buffer:
        """A buffer for an alloca op; its key is the op and how many times this
        device ran it (so devices running the same code agree on keys)."""
        site = (str(op.location), str(op.operation.results[0].type))
        n = self.allocations.get(site, 0)
        self.allocations[site] = n + 1
        buf = allocate(op.operation.results[0].type, ("alloca", site, n))
        self.mesh.register(self.device, buf.key, cast(np.ndarray, buf.root))  # allocate sets root
        return buf

    def call(self, name: str, args) -> list[Any]:
        """Runs the function ``@name``; its results."""
        with np.errstate(all="ignore"):
            return self.run(self.program.funcs[name], args, {})

    def run(self, region: Region, args, env) -> list[Any]:
        """Runs a prepared region in ``env`` (the values in scope); the values
        its terminator gives back."""
        for a, v in zip(region.args, args):
            env[a] = v
        for step in region.steps:
            vals = [env[v] for v in step.operands]
            if step.rule is None:
                raise MosaicError(f"run_mosaic: op {where(step.op)} is not supported")
            if step.regions is None:
                outs = step.rule(self, step.op, vals, env)
            else:
                outs = step.rule(self, step.op, vals, env, step.regions)
            for r, v in zip(step.results, outs or ()):
                env[r] = v
        return [env[v] for v in region.returns]
