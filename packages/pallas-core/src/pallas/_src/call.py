"""The call record: what one ``pallas_call`` binds, read by every layer.

``pallas_call`` builds one ``PallasCall`` per traced kernel and binds its
fields as the parameters of ``pallas_call_p`` (so a jaxpr's equation shows
them one by one: ``eqn.params["grid_mapping"]``). The lowering rule rebuilds
the record from them (no work: the facts travel with it), and backends
receive the record, never loose keyword arguments.

``KernelFacts`` are what the layers below ask of the kernel ("does it use
semaphores? remote DMAs?"): found by one walk of the kernel jaxpr when
``pallas_call`` traces it, and again only when ``jax.vmap`` or ``jax.jvp``
make a new kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import tree_util
from jax.extend.core import Primitive, jaxprs_in_params

from pallas._src import compat
from pallas._src import core as pallas_core
from pallas._src.ref_padding import PadTransform


@dataclasses.dataclass(frozen=True)
class KernelFacts:
    """What a kernel jaxpr uses, in its sub-jaxprs (loops, conds, scopes) too.

    Attributes:
      primitives: every primitive of the kernel.
      remote: an equation addresses another device (its params, or its
        ``layout``, carry a ``device_id_tree``: a remote DMA or semaphore signal).
      signals_cores: a semaphore signal addresses another core (``core_index``).
      undischarged: an equation reads or writes Refs through a primitive state
        discharge has no rule for (a backend's DMA: pallas-core's interpret mode
        cannot run it).
    """

    primitives: frozenset[Primitive] = frozenset()
    remote: bool = False
    signals_cores: bool = False
    undischarged: bool = False

    def __repr__(self) -> str:  # short in printed jaxprs (a pallas_call_p parameter)
        names = ", ".join(sorted(p.name for p in self.primitives))
        return f"KernelFacts(primitives=[{names}], remote={self.remote}, signals_cores={self.signals_cores})"

    def uses(self, *prims: Primitive) -> bool:
        """Whether the kernel uses any of ``prims``."""
        return any(p in self.primitives for p in prims)


def kernel_facts(jaxpr: Any) -> KernelFacts:
    """The facts of a (closed) kernel jaxpr: one walk over its equations."""
    prims: set[Primitive] = set()
    remote = signals_cores = undischarged = False
    stack = [getattr(jaxpr, "jaxpr", jaxpr)]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive not in prims and eqn.effects and not compat.has_discharge_rule(eqn.primitive):
                undischarged = undischarged or any(_is_state_effect(e) for e in eqn.effects)
            undischarged = undischarged or _has_undischargeable_transform(eqn)
            prims.add(eqn.primitive)
            params = eqn.params
            if (
                params.get("device_id_tree") is not None
                or getattr(params.get("layout"), "device_id_tree", None) is not None
            ):
                remote = True
            signals_cores = signals_cores or bool(params.get("has_core_index"))
            stack += [getattr(s, "jaxpr", s) for s in jaxprs_in_params(params)]
    return KernelFacts(frozenset(prims), remote, signals_cores, undischarged)


def _has_undischargeable_transform(eqn: Any) -> bool:
    """Whether ``eqn`` reads or writes a Ref through a transform of ours (``pl.pad_ref``)
    that this JAX's state discharge cannot apply: JAX 0.10's applies its own transforms
    only; JAX 0.11 on apply any transform through its ``transform_array``/``undo``."""
    if jax.__version_info__ >= (0, 11) or eqn.params.get("tree") is None:
        return False
    tree = eqn.params["tree"]
    flat = list(eqn.invars[len(eqn.invars) - tree.num_leaves :])  # after the Ref (and a swap's value)
    return any(isinstance(t, PadTransform) for t in tree_util.tree_unflatten(tree, flat))


def _is_state_effect(effect: Any) -> bool:
    """A read, write or accumulation of a Ref (JAX's state effects)."""
    return type(effect).__name__ in ("ReadEffect", "WriteEffect", "AccumEffect")


@dataclasses.dataclass(frozen=True)
class PallasCall:
    """One ``pallas_call``: the kernel, its grid mapping and every option.

    Attributes:
      jaxpr: the kernel, a closed jaxpr over (grid indices, dynamic grid sizes,
        scalar-prefetch Refs, input Refs, output Refs, scratch Refs).
      grid_mapping: the grid and the operands' block mappings.
      input_output_aliases: ``(input, output)`` pairs in JAX's convention, as the
        user passed them: inputs count the scalar-prefetch operands (not the dynamic
        grid sizes, which precede them as operands of ``pallas_call_p``);
        ``block_aliases`` counts the inputs' block mappings instead.
      interpret: ``False`` (lower for the hardware), ``True`` or a
        ``pl.InterpretParams`` (pallas-core's interpret mode, or the backend
        interpreter a kernel needs) or a backend's interpret params. The process-wide
        default (``pltpu.force_tpu_interpret_mode``) is already applied.
      debug: print the kernel and what it lowers to.
      compiler_params: None, a backend's ``CompilerParams`` or a tuple of them
        (autotuning).
      cost_estimate: a ``pl.CostEstimate`` or None.
      backend: the backend name ``pallas_call(backend=...)`` selected, or None.
      metadata: sorted ``(key, value)`` pairs of ``pallas_call(metadata=...)``, or None.
      facts: what the kernel uses (``kernel_facts(jaxpr)``).
    """

    jaxpr: Any
    grid_mapping: pallas_core.GridMapping
    input_output_aliases: tuple[tuple[int, int], ...] = ()
    interpret: Any = False
    debug: bool = False
    compiler_params: Any = None
    cost_estimate: Any = None
    backend: str | None = None
    metadata: tuple[tuple[str, Any], ...] | None = None
    facts: KernelFacts = KernelFacts()

    @classmethod
    def of(cls, jaxpr: Any, grid_mapping: pallas_core.GridMapping, **options: Any) -> PallasCall:
        """A record for a new kernel: its facts found by one walk."""
        return cls(jaxpr, grid_mapping, facts=kernel_facts(jaxpr), **options)

    def params(self) -> dict[str, Any]:
        """The fields as ``pallas_call_p``'s parameters (``PallasCall(**params)`` inverts it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> PallasCall:
        return dataclasses.replace(self, **changes)

    def with_kernel(self, jaxpr: Any, grid_mapping: pallas_core.GridMapping, **changes: Any) -> PallasCall:
        """The record of a transformed kernel (vmap, jvp): its facts found again."""
        return self.replace(jaxpr=jaxpr, grid_mapping=grid_mapping, facts=kernel_facts(jaxpr), **changes)

    @property
    def where(self) -> str:
        """``pallas_call 'name' at file.py:12``: how errors name the kernel."""
        return self.grid_mapping.where

    @property
    def all_compiler_params(self) -> tuple[Any, ...]:
        """Every config of the call: none, the one, or the several to autotune over."""
        cp = self.compiler_params
        return () if cp is None else cp if isinstance(cp, tuple) else (cp,)

    @property
    def first_compiler_params(self) -> Any:
        """The one config, or the first of several (they are of one backend's type):
        what selects the backend and what the configs share; None when none was given."""
        return next(iter(self.all_compiler_params), None)

    @property
    def block_aliases(self) -> tuple[tuple[int, int], ...]:
        """``(input block mapping, output)`` pairs: inputs counted after the
        scalar-prefetch operands, as ``grid_mapping.block_mappings`` are."""
        nsp = self.grid_mapping.num_scalar_prefetch
        return tuple((i - nsp, o) for i, o in self.input_output_aliases)

    @property
    def needs_backend_interpreter(self) -> bool:
        """Whether the kernel uses what pallas-core's interpret mode does not
        model (backend memory spaces, semaphores, a named grid, scalar prefetch,
        Ref primitives with no state discharge rule such as a backend's DMAs):
        then a backend's interpreter (pallas-tpu's) runs it."""
        from pallas._src import semaphores

        gm = self.grid_mapping
        if gm.num_scalar_prefetch or gm.grid_names:
            return True
        avals = [bm.ref_aval() for bm in gm.block_mappings] + list(gm.scratch_avals)
        if any(getattr(a, "memory_space", None) is not None for a in avals):
            return True
        return self.facts.undischarged or self.facts.uses(
            semaphores.semaphore_signal_p, semaphores.semaphore_wait_p, semaphores.semaphore_read_p
        )
