"""TPU interpret mode: a Pallas TPU kernel run as plain (jitted) JAX on a CPU.

The kernel jaxpr is *interpreted while tracing*: each equation is evaluated
with JAX ops on traced values, and every Ref is a cell of a state dictionary
(HBM arrays, VMEM/SMEM buffers, scratch, semaphore counters). Loops and
conds that touch Refs are re-emitted as ``lax`` control flow carrying the
whole state, so the result is one jitted program: fast (no callback per
memory access), yet it models what matters on a TPU:

* the pipeline of a blocked ``BlockSpec``: an input block is copied from HBM
  into its VMEM buffer when its block index changes; an output buffer is
  written back to HBM when its block index changes and at the end (a revisit
  on consecutive steps keeps accumulating in VMEM, as on the TPU);
* grid order: lexicographic; ``parallel`` axes may be shuffled
  (``random_seed``); ``core_parallel`` axes are split over
  ``num_cores_or_threads`` cores, each with its own scratch and semaphores;
* DMAs and semaphores (``dma.py``): a DMA goes where its ``start``
  said; a wait takes its byte count off the semaphore, whatever descriptor it
  is given. ``dma_execution_mode="eager"`` copies at ``start``; ``"on_wait"``
  (the default, as JAX's) lands a copy into VMEM/SMEM when a wait on its
  semaphore comes, so reading a destination before waiting shows its old
  contents. A wait that nothing can satisfy, and a kernel that ends with a
  semaphore not back at zero, are errors;
* uninitialized memory (outputs, scratch) is NaN or zero (``uninitialized_memory``);
* every dynamic Ref access and DMA is bounds-checked: an out-of-bounds index
  raises an error naming the kernel, the user's line, the Ref and the index.

Errors found while the jitted program runs are recorded in a hidden error
code and raised (as a Python exception) when the kernel finishes.

Kernels that talk to other devices (remote DMAs, remote semaphore signals,
barrier semaphores) and race detection need the multi-device interpreter
(``multi.py``), which subclasses ``Interpreter`` and overrides its hooks.
The rules of the primitives are in ``core_rules.py`` (JAX's and pallas-core's),
``dma.py`` and the ``language`` modules, all registered in ``rules.py``'s tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import facts
from pallas_tpu._src.interpret import rules as interpret_rules
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import tpu_info


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterpretParams:
    """Options of TPU interpret mode (JAX's ``pltpu.InterpretParams`` fields).

    Attributes:
      dma_execution_mode: ``"on_wait"`` (a copy into VMEM/SMEM lands when a
        wait on its semaphore comes, one into HBM when it starts) or
        ``"eager"`` (every copy when it starts). Either way the data goes where
        ``start`` said, whatever descriptor the wait is given.
      detect_races: find data races (DMAs in flight against kernel accesses,
        cores and devices touching the same memory unsynchronized); a race
        raises an error naming both accesses.
      out_of_bounds_reads: ``"raise"`` or ``"uninitialized"`` (read garbage-marker values).
      skip_floating_point_ops: accepted for compatibility; ignored.
      uninitialized_memory: ``"nan"`` or ``"zero"``: the contents of outputs
        and scratch before the kernel writes them.
      num_cores_or_threads: TensorCores per device (``core_parallel`` axes
        and ``pltpu.TensorCoreMesh`` are split over them).
      vector_clock_size, logging_mode: accepted for compatibility.
      random_seed: shuffle the order of ``parallel`` grid axes with this seed.
      grid_point_recorder: called as ``f(grid_point, core_id)`` for every step.
      allow_hbm_allocation_in_run_scoped: allow ``pl.run_scoped(pltpu.HBM(...))``.
      buffer_bounds: ``"logical"`` (bounds are the array's shape) or ``"padded"``.
      chip_version: the TPU generation modelled (tiling for ``emit_pipeline``,
        ``get_tpu_info``); JAX's interpret mode asks a real device instead.
    """

    dma_execution_mode: Literal["eager", "on_wait"] = "on_wait"
    detect_races: bool = False
    out_of_bounds_reads: Literal["raise", "uninitialized"] = "raise"
    skip_floating_point_ops: bool = False
    uninitialized_memory: Literal["nan", "zero"] = "nan"
    num_cores_or_threads: int = 1
    vector_clock_size: int | None = None
    logging_mode: Any = None
    random_seed: int | None = None
    grid_point_recorder: Callable[..., Any] | None = None
    allow_hbm_allocation_in_run_scoped: bool = False
    buffer_bounds: Literal["logical", "padded"] = "logical"
    chip_version: str = "v5e"

    def __post_init__(self):
        if self.dma_execution_mode not in ("eager", "on_wait"):
            raise ValueError(
                f"InterpretParams: dma_execution_mode must be 'eager' or 'on_wait', got {self.dma_execution_mode!r}"
            )
        if self.uninitialized_memory not in ("nan", "zero"):
            raise ValueError(
                f"InterpretParams: uninitialized_memory must be 'nan' or 'zero', got {self.uninitialized_memory!r}"
            )
        if self.out_of_bounds_reads not in ("raise", "uninitialized"):
            raise ValueError(
                "InterpretParams: out_of_bounds_reads must be 'raise' or 'uninitialized', "
                f"got {self.out_of_bounds_reads!r}"
            )
        plb.check_bool_fields(
            "pltpu.InterpretParams",
            self,
            ("detect_races", "skip_floating_point_ops", "allow_hbm_allocation_in_run_scoped"),
        )
        tpu_info._as_chip(self.chip_version)  # an unknown generation fails here, naming the known ones
        if not isinstance(self.num_cores_or_threads, int) or self.num_cores_or_threads < 1:
            raise ValueError(
                f"InterpretParams: num_cores_or_threads must be a positive int, got {self.num_cores_or_threads!r}"
            )

    @property
    def num_cores_per_device(self) -> int:
        return self.num_cores_or_threads

    def tracing_context(self):
        """Entered while pallas_call traces the kernel: ``get_tpu_info()`` (and
        so ``emit_pipeline``'s tiling) describes ``chip_version``."""
        return tpu_info.modeled_chip(self.chip_version)


# ---------------------------------------------------------------------------
# Refs as views of state cells.


@dataclasses.dataclass(frozen=True)
class RefView:
    """A Ref seen by the kernel: a state cell and the transforms applied to it."""

    cell: int
    transforms: tuple[Any, ...] = ()

    def with_transforms(self, more: Sequence[Any]) -> RefView:
        return RefView(self.cell, self.transforms + tuple(more))


class KernelError(Exception):
    """Raised when an interpreted TPU kernel does something a TPU would not do
    (out-of-bounds access, a wait that never completes, a race). Raised in a host
    callback as the kernel runs: recorded, so that the pallas_call raises it as it
    was, message first, rather than inside XLA's "CpuCallback error" wrapper."""

    def __init__(self, *args):
        super().__init__(*args)
        plb.record_runtime_error(self)


def _is_slice(x) -> bool:
    return hasattr(x, "start") and hasattr(x, "size") and hasattr(x, "stride")


def _traced_sizes(transform) -> bool:
    """True if ``transform`` is an indexer with a slice whose size is traced."""
    return any(_is_slice(ix) and not _static_int(ix.size) for ix in getattr(transform, "indices", ()))


def _static_int(x) -> bool:
    return isinstance(x, (int, np.integer))


def _index_value(x):
    """An index as a Python int when it is known while tracing, else traced int32:
    static indices need no bounds check and no dynamic slice in the program."""
    if _static_int(x):
        return int(x)
    if isinstance(x, np.ndarray) and x.shape == () and np.issubdtype(x.dtype, np.integer):
        return int(x)
    return jnp.asarray(x, jnp.int32)


def _clip(x, lo: int, hi: int):
    if _static_int(x):
        return min(max(int(x), lo), hi)
    return lax.clamp(np.int32(lo), jnp.asarray(x, jnp.int32), np.int32(hi))


def _on_chip(space) -> bool:
    """VMEM (the default of kernel scratch), SMEM: buffers small enough to
    shadow, where on_wait DMAs land at their wait (see dma.py)."""
    return space is None or space in (tpu_core.VMEM, tpu_core.SMEM, tpu_core.VMEM_SHARED)


def _oob(what: str) -> str:
    """JAX's interpreter's words first ("Out-of-bounds read"/"Out-of-bounds write"),
    so code matching JAX's messages matches ours; then what the access was."""
    kind = "write" if "write" in what else "read"
    return f"Out-of-bounds {kind}" + (f" ({what})" if what != kind else "")


def _uninit(shape, dtype, mode: str):
    if mode == "zero":
        return jnp.zeros(shape, dtype)
    return plb.uninitialized_value(shape, dtype)


def drain(gen):
    """Runs a generator that yields nothing to its end; returns its value."""
    try:
        next(gen)
    except StopIteration as e:
        return e.value
    raise AssertionError("the TPU interpreter paused with no pause condition")


# Call-like primitives and the parameter holding the jaxpr they call (inlined).
CALL_PARAMS = dict(compat.call_primitives())


# ---------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Hidden:
    """The traced values besides the cells that the interpreter carries through
    loops, conds and grid steps (a pytree: its leaves are part of every carry)."""

    err: jax.Array | None = None  # the code of the first failed check, 0 while none failed (``check``)
    errvals: jax.Array | None = None  # int32[8]: the values recorded with that check
    tok: jax.Array | None = None  # orders host callbacks (``ordered_callback``)
    # (operand, core slot) -> where that core's block of the operand started at the
    # grid step before (the pipeline: fetch or write back when it moves).
    block_starts: dict[tuple[int, int], jax.Array] = dataclasses.field(default_factory=dict)
    # State of extension rules, by name (``rules.HIDDEN_STATE``): the PRNG state.
    named: dict[str, jax.Array] = dataclasses.field(default_factory=dict)


tree_util.register_dataclass(
    Hidden, data_fields=["err", "errvals", "tok", "block_starts", "named"], meta_fields=[]
)


class Interpreter:
    """Evaluates kernel jaxprs against a state of cells (see the module docstring)."""

    def __init__(self, params: InterpretParams, gm, kernel_desc: str):
        self.params = params
        self.gm = gm
        self.kernel_desc = kernel_desc
        self.state: dict[int, jax.Array] = {}
        self.cell_names: dict[int, str] = {}
        self.cell_spaces: dict[int, Any] = {}
        self.hidden = Hidden()
        self.checks: list[str] = []
        self.grid_env: dict[str, jax.Array] = {}  # named grid axis -> index
        self.barrier_cell: int | None = None  # the barrier semaphore (multi.py allocates it)
        # dma_execution_mode="on_wait": cell -> (shadow cell, pending cell); see dma.py.
        self.dma_shadows = False
        self.shadows: dict[int, tuple[int, int]] = {}
        self.dma_sites: list[tuple[int, int]] = []  # (semaphore cell, destination cell) of started DMAs
        self._unchecked = 0
        self._dma_memo: dict = {}  # facts.dma_destinations of the jaxprs seen
        self._where_memo: dict = {}  # id(eqn) -> (eqn, where(eqn))
        # (trace, index, extent, size) of the traced bounds checks made so far (see _bounds_checked).
        self._bounds_seen: dict[tuple[int, int, int, int], tuple[Any, Any]] = {}
        self._next_cell = 0
        self.progress = None  # (grid step, number of steps), traced, while a grid step runs

    # -- lifecycle (the multi-device interpreter extends these) ----------------

    def setup(self, jaxpr, compiler_params) -> None:
        """Called once before the grid starts."""

    def finish(self) -> None:
        """Called once after the last grid step."""

    def snapshot(self):
        """The cells' values as a list and the hidden state (a loop carry);
        ``restore`` takes it back."""
        self._keys = sorted(self.state)
        return [self.state[k] for k in self._keys], self.hidden

    def restore(self, vals, hidden: Hidden) -> None:
        self.state = dict(zip(self._keys, vals))
        self.hidden = hidden

    # -- cells ---------------------------------------------------------------

    def new_cell(self, value, name: str, space=None, dma_target: bool = True) -> int:
        """A new cell holding ``value``. ``dma_target=False``: no DMA writes it
        (``facts.dma_destinations``), so it needs no on_wait shadow."""
        c = self._next_cell
        self._next_cell += 1
        self.state[c] = value
        self.cell_names[c] = name
        self.cell_spaces[c] = space
        if self.dma_shadows and dma_target and _on_chip(space):
            # on_wait DMAs land here first (what landed, and which semaphore's wait commits it).
            shadow = self.new_cell_plain(jnp.zeros_like(value), f"{name} (DMA in flight)", space)
            pending = self.new_cell_plain(
                jnp.zeros(jnp.shape(value), jnp.int32), f"{name} (DMA pending)", space
            )
            self.shadows[c] = (shadow, pending)
        elif self.dma_shadows and isinstance(space, plb.SemaphoreSpace):
            # Per semaphore: elements of started DMAs its waits have not landed yet.
            count = self.new_cell_plain(
                jnp.zeros(jnp.shape(value), jnp.int32), f"{name} (pending elements)", space
            )
            self.shadows[c] = (count,)
        return c

    def dma_targets(self, jaxpr) -> frozenset[int]:
        """Positions of ``jaxpr``'s inputs that a DMA may write (all of them when
        on_wait shadows are off: then it does not matter)."""
        if not self.dma_shadows:
            return frozenset(range(len(getattr(jaxpr, "jaxpr", jaxpr).invars)))
        return facts.dma_destinations(jaxpr, self._dma_memo)

    def new_cell_plain(self, value, name: str, space=None) -> int:
        c = self._next_cell
        self._next_cell += 1
        self.state[c] = value
        self.cell_names[c] = name
        self.cell_spaces[c] = space
        return c

    def free_cell(self, c: int) -> None:
        self.check_dmas_landed(c, "when its scope ends")
        del self.state[c]
        for companion in self.shadows.pop(c, ()):
            del self.state[companion]

    # -- checks: errors found at run time -------------------------------------

    def init_checks(self) -> None:
        self.hidden.err = jnp.zeros((), jnp.int32)
        self.hidden.errvals = jnp.zeros((8,), jnp.int32)
        self.hidden.tok = jnp.zeros((), jnp.int32)

    def check(self, ok, message: str, values: Sequence[Any] = ()) -> None:
        """Records ``message`` (with up to 8 int values, shown where the message
        has ``{0}``...) as the kernel's error if ``ok`` is false."""
        if self._unchecked or (isinstance(ok, (bool, np.bool_)) and ok):
            return
        self.checks.append(message)
        code = len(self.checks)
        err = self.hidden.err
        # lax, not jnp (no jitted helpers): a large kernel makes hundreds of checks, and
        # every op here is traced, lowered and compiled with it.
        first = lax.bitwise_and(lax.eq(err, np.int32(0)), lax.bitwise_not(jnp.asarray(ok, jnp.bool_)))
        self.hidden.err = lax.select(first, np.int32(code), err)
        if values:  # no values: errvals still holds zeros wherever this is the first error
            vals = [jnp.asarray(v, jnp.int32).reshape(()) for v in values][:8]
            row = jnp.concatenate([jnp.stack(vals), np.zeros(8 - len(vals), np.int32)])
            errvals = self.hidden.errvals
            self.hidden.errvals = lax.select(lax.broadcast(first, errvals.shape), row, errvals)

    def _bounds_checked(self, index, extent: int, size: int) -> bool:
        """True if ``[index, index + extent)`` was checked against ``size`` before, in
        the jaxpr being traced now: that check runs whenever this one would, and an
        error it records comes first, so a second one adds only ops. (DMAs, semaphores
        and their companion cells index the same Refs with the same traced index many
        times; a check made in a ``lax.cond`` branch or loop body, another trace, does
        not count outside it.) Records this one otherwise."""
        if self._unchecked:
            return False
        trace = compat.current_trace()
        key = (id(trace), id(index), extent, size)
        if key in self._bounds_seen:
            return True
        self._bounds_seen[key] = (trace, index)  # keeps both alive, so their ids stay theirs
        return False

    @contextlib.contextmanager
    def unchecked(self):
        """Records no errors inside: for views a TPU never touches (the
        descriptor of a DMA wait only gives a byte count)."""
        self._unchecked += 1
        try:
            yield
        finally:
            self._unchecked -= 1

    def check_dmas_landed(self, cell: int, when: str) -> None:
        """on_wait DMAs: an error if data started into ``cell`` has not landed
        though no semaphore is owed it any more (a wait consumed its bytes but
        the interpreter could not tell where that DMA went)."""
        if cell not in self.shadows or len(self.shadows[cell]) != 2:
            return
        pending = self.state[self.shadows[cell][1]]
        self.check(
            jnp.logical_not(jnp.any(pending != 0)),
            f"{self.kernel_desc}: a DMA into {self.describe_ref(RefView(cell))} was waited for but never "
            f"landed {when}: its wait named another buffer than the one the DMA went to, and the TPU "
            "interpreter had not seen that buffer used by a DMA on the semaphore before the wait; "
            "run with dma_execution_mode='eager', or wait with the descriptor the DMA was started with",
        )

    def ordered_callback(self, fn, *args) -> None:
        """Calls ``fn(*args)`` on the host, in program order: each call takes
        and returns a token kept in ``self.hidden``, so XLA keeps the order."""
        from jax.experimental import io_callback

        if self.hidden.tok is None:
            raise RuntimeError("ordered_callback needs init_checks() first")

        def call(tok, *a):
            fn(*a)
            return tok

        self.hidden.tok = io_callback(call, jax.ShapeDtypeStruct((), jnp.int32), self.hidden.tok, *args)

    def raise_checks(self) -> None:
        """Emits the callback that raises the first recorded error, if any."""
        if not self.checks:
            return
        messages = list(self.checks)

        def report(err, vals):
            errs = np.asarray(err).reshape(-1)
            err = int(errs.max())
            if err:  # under vmap: the values recorded with the reported error
                vals = np.asarray(vals).reshape(-1, 8)[int(errs.argmax())]
                raise KernelError(messages[err - 1].format(*[int(v) for v in vals]))

        jax.debug.callback(report, self.hidden.err, self.hidden.errvals)

    # -- jaxpr evaluation ----------------------------------------------------

    def eval_jaxpr(self, jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        return drain(self.iter_jaxpr(jaxpr, consts, args, None))

    def iter_jaxpr(self, jaxpr, consts, args, pause):
        """``eval_jaxpr`` as a generator that yields before each equation for
        which ``pause(eqn)`` holds, also inside ``pl.run_scoped`` and inlined
        calls (not inside control flow: that is traced as one ``lax`` op).
        Cores that signal each other run as such generators in turn (see
        ``pallas_call.run``)."""
        env: dict[Any, Any] = {}

        def read(v):
            if isinstance(v, compat.Literal):
                return v.val
            return env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if pause is None:
                outs = self.eval_eqn(eqn, invals)
            else:
                if pause(eqn):
                    yield eqn
                if eqn.primitive in interpret_rules.ITER_RULES:
                    outs = yield from interpret_rules.ITER_RULES[eqn.primitive](self, eqn, invals, pause)
                elif eqn.primitive in CALL_PARAMS:
                    sub = eqn.params[CALL_PARAMS[eqn.primitive]]
                    if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                        outs = yield from self.iter_jaxpr(sub.jaxpr, sub.consts, invals, pause)
                    else:
                        outs = yield from self.iter_jaxpr(sub, (), invals, pause)
                else:
                    outs = self.eval_eqn(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eval_closed(self, closed, args):
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args)

    def where(self, eqn) -> str:
        hit = self._where_memo.get(id(eqn))
        if hit is None or hit[0] is not eqn:  # the user's frame: a walk of the traceback, once per equation
            src = compat.eqn_user_source(eqn)
            hit = self._where_memo[id(eqn)] = (eqn, f"{self.kernel_desc}{' at ' + src if src else ''}")
        return hit[1]

    def eval_eqn(self, eqn, invals):
        prim = eqn.primitive
        rule = interpret_rules.STATE_RULES.get(prim)
        if rule is not None:
            return rule(self, eqn, *invals)
        if any(isinstance(v, RefView) for v in invals):
            raise NotImplementedError(
                f"{self.where(eqn)}: the TPU interpreter has no rule for '{prim.name}' on Refs"
            )
        return prim.bind(*invals, **eqn.params)

    # -- memory access -------------------------------------------------------

    def describe_ref(self, view: RefView) -> str:
        return self.cell_names.get(view.cell, f"ref#{view.cell}")

    def _index_parts(self, shape, indexer, eqn, view, what):
        """(starts, sizes, strides, squeezed dims, advanced index arrays) of one NDIndexer."""
        starts, sizes, strides, squeeze, arrays = [], [], [], [], {}
        raw = [ix.start if _is_slice(ix) else ix for ix in indexer.indices]
        for d, (n, ix) in enumerate(zip(shape, indexer.indices)):
            if _is_slice(ix):
                starts.append(_index_value(ix.start))
                sizes.append(int(ix.size))
                strides.append(int(ix.stride))
            else:
                if _static_int(ix):
                    starts.append(int(ix))
                    sizes.append(1)
                    strides.append(1)
                    squeeze.append(d)
                    continue
                ix = jnp.asarray(ix)
                if ix.shape == ():
                    starts.append(ix.astype(jnp.int32))
                    sizes.append(1)
                    strides.append(1)
                    squeeze.append(d)
                else:
                    arrays[d] = ix.astype(jnp.int32)
                    starts.append(jnp.zeros((), jnp.int32))
                    sizes.append(n)
                    strides.append(1)
        if self.params.out_of_bounds_reads == "raise" or what != "read":
            for d, n in enumerate(shape):
                if d in arrays:
                    a = arrays[d]
                    ok = jnp.logical_and(jnp.all(a >= 0), jnp.all(a < n))
                    lo = jnp.min(a) if a.size else 0
                    hi = jnp.max(a) if a.size else 0
                    self.check(
                        ok,
                        f"{self.where(eqn)}: {_oob(what)} of {self.describe_ref(view)}: index array "
                        f"with values in [{{0}}, {{1}}] along dimension {d} of size {n}",
                        [lo, hi],
                    )
                    continue
                extent = (sizes[d] - 1) * strides[d] + 1 if sizes[d] else 0
                st = starts[d]
                if _static_int(st):  # known while tracing: no check in the program
                    if 0 <= st and st + extent <= n:
                        continue
                    ok = False
                elif self._bounds_checked(raw[d], extent, n):
                    continue
                else:  # lax, not jnp's operators: each of those is a jitted call to trace
                    ok = lax.bitwise_and(
                        lax.ge(st, np.int32(0)), lax.le(lax.add(st, np.int32(extent)), np.int32(n))
                    )
                self.check(
                    ok,
                    f"{self.where(eqn)}: {_oob(what)} of {self.describe_ref(view)} "
                    f"(shape {tuple(shape)}): dimension {d} reads [{{0}}, {{0}} + {extent}) "
                    f"but its size is {n}",
                    [starts[d]],
                )
        return starts, sizes, strides, squeeze, arrays

    def _read1(self, x, indexer, eqn, view, what):
        if not hasattr(indexer, "indices"):
            return self._transform_other(x, indexer, eqn)
        starts, sizes, strides, squeeze, arrays = self._index_parts(x.shape, indexer, eqn, view, what)
        ext = [(s - 1) * k + 1 if s else 0 for s, k in zip(sizes, strides)]
        starts_c = [_clip(s, 0, max(n - e, 0)) for s, n, e in zip(starts, x.shape, ext)]
        if not x.ndim:
            y = x
        elif all(_static_int(s) for s in starts_c):
            y = x if tuple(ext) == x.shape else lax.slice(x, starts_c, [s + e for s, e in zip(starts_c, ext)])
        else:
            y = lax.dynamic_slice(x, starts_c, ext, allow_negative_indices=False)  # clipped above
        if any(k != 1 for k in strides):
            y = lax.slice(y, [0] * y.ndim, y.shape, strides)
        if arrays:
            idx = tuple(arrays.get(d, slice(None)) if d not in squeeze else 0 for d in range(x.ndim))
            return y[idx]
        if squeeze:
            y = lax.squeeze(y, squeeze)
        return y

    def _write1(self, x, indexer, val, eqn, view):
        if isinstance(indexer, compat.ReshapeTransform):  # ``ref.reshape(...)``: row-major, as the array
            return jnp.asarray(val, x.dtype).reshape(x.shape)
        if not hasattr(indexer, "indices"):
            raise NotImplementedError(
                f"{self.where(eqn)}: writing through a {type(indexer).__name__} view is not supported "
                "by the TPU interpreter yet"
            )
        starts, sizes, strides, squeeze, arrays = self._index_parts(x.shape, indexer, eqn, view, "write")
        if arrays:
            idx = []
            for d in range(x.ndim):
                if d in arrays:
                    idx.append(arrays[d])
                elif d in squeeze:
                    idx.append(jnp.clip(starts[d], 0, x.shape[d] - 1))
                else:
                    idx.append(jnp.clip(starts[d], 0, x.shape[d] - 1) + strides[d] * jnp.arange(sizes[d]))
            # Basic dims become broadcastable aranges, as numpy's mixed indexing.
            return x.at[tuple(idx)].set(val.astype(x.dtype), mode="drop")
        ext = [(s - 1) * k + 1 if s else 0 for s, k in zip(sizes, strides)]
        starts_c = [_clip(s, 0, max(n - e, 0)) for s, n, e in zip(starts, x.shape, ext)]
        blk_shape = [s for d, s in enumerate(sizes)]
        val = jnp.asarray(val, x.dtype).reshape(blk_shape)
        if tuple(ext) == x.shape and all(_static_int(s) and s == 0 for s in starts_c):
            if all(k == 1 for k in strides):
                return val  # the whole buffer
        if any(k != 1 for k in strides):
            old = lax.dynamic_slice(x, starts_c, ext, allow_negative_indices=False)
            idx = tuple(slice(None, None, k) for k in strides)
            val = old.at[idx].set(val)
        if not x.ndim:
            return val.reshape(())
        return lax.dynamic_update_slice(x, val, starts_c, allow_negative_indices=False)

    def _transform_other(self, x, t, eqn):
        if isinstance(t, compat.ReshapeTransform):  # JAX's class has no transform_array
            return x.reshape(t.shape)
        try:
            return t.transform_array(x)
        except Exception as e:
            raise NotImplementedError(
                f"{self.where(eqn)}: the TPU interpreter cannot apply the Ref transform {t!r}: {e}"
            ) from None

    def read_view(self, view: RefView, eqn, what="read"):
        x = self.state[view.cell]
        self.on_access(view, eqn, write=False)
        for t in view.transforms:
            x = self._read1(x, t, eqn, view, what)
        return x

    def flat_index(self, view: RefView, eqn):
        """The flat position of the one element a view selects (semaphores)."""
        x = jnp.arange(math.prod(self.state[view.cell].shape), dtype=jnp.int32).reshape(
            self.state[view.cell].shape
        )
        for t in view.transforms:
            x = self._read1(x, t, eqn, view, "read")
        return x.reshape(())

    def view_indices(self, view: RefView, eqn, what: str):
        """(flat element indices of the cell that ``view`` covers, the view's
        shape). A slice whose size is traced (``pl.ds(i, n)``, in DMAs) takes
        the dimension's whole length; its positions past ``n`` hold the cell's
        size (out of range, so a scatter drops them), and its entry of the
        shape is ``n`` (traced)."""
        x = self.state[view.cell]
        idx = jnp.arange(max(x.size, 1), dtype=jnp.int32)[: x.size].reshape(x.shape)
        valid, shape = None, list(x.shape)
        for t in view.transforms:
            if valid is None and not _traced_sizes(t):
                idx = (
                    self._read1(idx, t, eqn, view, what)
                    if hasattr(t, "indices")
                    else self._transform_other(idx, t, eqn)
                )
                shape = list(idx.shape)
            elif hasattr(t, "indices"):
                idx, valid, shape = self._index_traced(idx, valid, shape, t, eqn, view, what)
            else:
                raise NotImplementedError(
                    f"{self.where(eqn)}: the TPU interpreter cannot apply {type(t).__name__} after a slice "
                    "whose size is traced (pl.ds(start, n) with n traced); apply it before that slice"
                )
        if valid is not None:
            idx = jnp.where(valid, idx, x.size)
        return idx, tuple(shape)

    def _index_traced(self, idx, valid, shape, indexer, eqn, view, what):
        """``view_indices`` of one NDIndexer when a size is traced."""
        if valid is None:
            valid = jnp.ones(idx.shape, jnp.bool_)
        out_shape, squeeze = [], []
        for d, ix in enumerate(indexer.indices):
            n, bound = shape[d], idx.shape[d]
            if not _is_slice(ix) and jnp.ndim(ix) > 0:
                raise NotImplementedError(
                    f"{self.where(eqn)}: a DMA view with a traced size cannot also be indexed with an "
                    "array of indices"
                )
            if _is_slice(ix):
                start, size, stride = jnp.asarray(ix.start, jnp.int32), ix.size, int(ix.stride)
            else:
                start, size, stride = jnp.asarray(ix, jnp.int32), 1, 1
                squeeze.append(d)
            static = _static_int(size)
            count = int(size) if static else -(-bound // stride)
            out_shape.append(count if static else jnp.asarray(size, jnp.int32))
            size = jnp.asarray(size, jnp.int32)
            ok = jnp.logical_and(size >= 0, start >= 0)
            ok = jnp.logical_and(ok, jnp.logical_or(size == 0, start + (size - 1) * stride < n))
            self.check(
                ok,
                f"{self.where(eqn)}: {_oob(what)} of {self.describe_ref(view)}: dimension {d} "
                f"takes {{1}} elements from {{0}} (stride {stride}) but its size is {{2}}",
                [start, size, n],
            )
            pos = jnp.clip(start + stride * jnp.arange(count, dtype=jnp.int32), 0, max(bound - 1, 0))
            idx, valid = jnp.take(idx, pos, axis=d), jnp.take(valid, pos, axis=d)
            if not static:
                inside = (jnp.arange(count) < size).reshape([-1 if k == d else 1 for k in range(idx.ndim)])
                valid = jnp.logical_and(valid, inside)
        keep = [d for d in range(idx.ndim) if d not in squeeze]
        idx, valid = jnp.squeeze(idx, squeeze), jnp.squeeze(valid, squeeze)
        return idx, valid, [out_shape[d] for d in keep]

    def write_view(self, view: RefView, val, eqn):
        self.on_access(view, eqn, write=True)

        def go(x, ts):
            if not ts:
                return jnp.asarray(val, x.dtype).reshape(x.shape)
            inner = self._read1(x, ts[0], eqn, view, "write") if len(ts) > 1 else None
            new_inner = go(inner, ts[1:]) if len(ts) > 1 else val
            return self._write1(x, ts[0], new_inner, eqn, view)

        self.state[view.cell] = go(self.state[view.cell], list(view.transforms))

    # -- hooks (the multi-device / race-detecting interpreter overrides them) --

    def on_access(self, view: RefView, eqn, write: bool) -> None:
        pass

    def on_dma_start(self, eqn, views) -> None:
        pass

    def on_dma_wait(self, eqn, views) -> None:
        pass

    def remote_dma_start(self, eqn, parts, layout) -> None:
        raise NotImplementedError(f"{self.where(eqn)}: remote DMAs need the multi-device TPU interpreter")

    def remote_dma_wait(self, eqn, parts, layout, which) -> None:
        """``.wait_send()`` of a remote DMA."""
        raise NotImplementedError(f"{self.where(eqn)}: remote DMAs need the multi-device TPU interpreter")

    def dma_receive(self, eqn, sem: RefView, dst: RefView, nbytes, remote: bool) -> None:
        """Before a DMA wait on ``sem`` takes ``nbytes``: remote DMAs sent to
        this device land and add their bytes to ``sem`` (multi-device interpreter)."""
        if remote:
            raise NotImplementedError(f"{self.where(eqn)}: remote DMAs need the multi-device TPU interpreter")

    def remote_signal(self, eqn, view, inc, device_id, core_index) -> None:
        raise NotImplementedError(
            f"{self.where(eqn)}: remote semaphore signals need the multi-device interpreter"
        )

    # -- semaphores ----------------------------------------------------------

    def sem_add(self, view: RefView, amount, eqn) -> None:
        cur = self.read_view(view, eqn)
        self.write_view(view, lax.add(cur, jnp.asarray(amount, cur.dtype)), eqn)

    def sem_wait(self, view: RefView, amount, eqn, decrement=True, what="semaphore") -> None:
        cur = self.read_view(view, eqn)
        amount = jnp.asarray(amount, cur.dtype)
        self.check(
            lax.ge(cur, amount),
            f"{self.where(eqn)}: waiting on {what} {self.describe_ref(view)} for {{1}} but it holds {{0}} "
            "and nothing else can signal it: on a TPU this wait never returns (deadlock)",
            [cur, amount],
        )
        if decrement:
            self.write_view(view, lax.sub(cur, amount), eqn)


# ---------------------------------------------------------------------------
# Forcing TPU interpret mode on every pallas_call (JAX's API).


class force_tpu_interpret_mode:  # noqa: N801  (JAX's name; a context manager)
    """Runs every ``pallas_call`` in the ``with`` block (that does not pass
    ``interpret`` itself) in TPU interpret mode with ``params``."""

    def __init__(self, params: InterpretParams | None = None):
        self.params = params or InterpretParams()

    def __enter__(self):
        plb.forced_interpret().append(self.params)
        return self

    def __exit__(self, *exc):
        plb.forced_interpret().pop()


def set_tpu_interpret_mode(params: InterpretParams | None = None) -> None:
    """Makes TPU interpret mode (with ``params``) the default from now on."""
    stack = plb.forced_interpret()
    stack.clear()
    stack.append(params or InterpretParams())
