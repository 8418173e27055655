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

The ``Interpreter`` is built from parts, each owning its state and handed the
other parts it needs (never the interpreter): the memory (``memory.py``: cells,
on_wait companions, the uninitialized policy), the run-time checks and
``KernelError`` (``errors.py``), Refs as views of cells and reads and writes
through them (``refs.py``), where the interpreter is (``cursor.py``: the core, the
grid step, the hidden carry), a transport (``transport.py`` for one device;
``multi.py`` for kernels that talk to other devices or cores, through remote DMAs,
remote semaphore signals, barrier semaphores, or that check races), the
semaphores (``semaphores.py``) and the DMA engine (``dma.py``, on the DMA ends of
``dma_views.py``). The rules of the primitives are in ``core_rules.py`` (JAX's and
pallas-core's), ``dma.py`` and the ``language`` modules, all registered in
``rules.py``'s tables. This module holds ``InterpretParams``, the ``Interpreter``
(its parts, jaxpr evaluation) and ``force_tpu_interpret_mode``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas import backend as plb
from pallas_tpu._src import compat
from pallas_tpu._src.interpret import facts
from pallas_tpu._src.interpret import rules as interpret_rules
from pallas_tpu._src.interpret.cursor import Cursor, Hidden
from pallas_tpu._src.interpret.dma import DmaEngine
from pallas_tpu._src.interpret.dma_views import DmaViews
from pallas_tpu._src.interpret.errors import Checks, count_true
from pallas_tpu._src.interpret.errors import KernelError as KernelError  # the public API imports it from here
from pallas_tpu._src.interpret.memory import Memory
from pallas_tpu._src.interpret.multi import DeviceTransport
from pallas_tpu._src.interpret.refs import RefAccess, RefView
from pallas_tpu._src.interpret.remote_dma import RemoteDMAs
from pallas_tpu._src.interpret.semaphores import LocalSemaphores, Semaphores
from pallas_tpu._src.interpret.session_link import SessionLink
from pallas_tpu._src.interpret.shared_scopes import SharedScopes
from pallas_tpu._src.interpret.transport import LocalTransport
from pallas_tpu._src.jaxpr_env import Env
from pallas_tpu._src.language import primitives as tpu_prims
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
        cores and devices touching the same memory unsynchronized), each named
        with both of its accesses.
      on_race: what a race found does: ``"raise"`` (an error, JAX 0.12's
        default) or ``"warn"`` (printed, ``races.races_found`` set, the kernel
        goes on: what JAX 0.11 and older do, which have no ``on_race``). Default
        None: as the installed JAX does.
      out_of_bounds_reads: ``"raise"`` or ``"uninitialized"`` (read garbage-marker values).
      skip_floating_point_ops: operations that compute only floating-point
        values (outside control flow) are not run; their results are
        infinities, as in JAX's interpret mode (for testing a kernel's memory
        traffic and synchronization quickly).
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
    on_race: Literal["raise", "warn"] | None = None
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
        if self.on_race not in (None, "raise", "warn"):
            raise ValueError(f"InterpretParams: on_race must be 'raise' or 'warn', got {self.on_race!r}")
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
        tpu_info.as_chip(self.chip_version)  # an unknown generation fails here, naming the known ones
        if not isinstance(self.num_cores_or_threads, int) or self.num_cores_or_threads < 1:
            raise ValueError(
                f"InterpretParams: num_cores_or_threads must be a positive int, got {self.num_cores_or_threads!r}"
            )

    @property
    def num_cores_per_device(self) -> int:
        return self.num_cores_or_threads

    @property
    def races_raise(self) -> bool:
        """Whether a race found raises (``on_race``, or the installed JAX's default)."""
        if self.on_race is None:
            return compat.races_raise_by_default()
        return self.on_race == "raise"

    def tracing_context(self):
        """Entered while pallas_call traces the kernel: ``get_tpu_info()`` (and
        so ``emit_pipeline``'s tiling) describes ``chip_version``."""
        return tpu_info.modeled_chip(self.chip_version)


# ---------------------------------------------------------------------------
# The interpreter's state and how it evaluates a jaxpr.


def _float_only(eqn) -> bool:
    """Whether ``eqn`` computes floating-point values only and holds no sub-jaxpr
    (control flow, whose body may touch Refs, always runs): what
    ``skip_floating_point_ops`` replaces with infinities, as JAX's interpret mode."""
    return (
        bool(eqn.outvars)
        and all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars)
        and not any(
            _is_jaxpr(p) or (isinstance(p, tuple) and any(map(_is_jaxpr, p))) for p in eqn.params.values()
        )
    )


def _is_jaxpr(p) -> bool:
    return hasattr(p, "eqns") or (hasattr(p, "jaxpr") and hasattr(p, "consts"))


def is_static_scalar(x) -> bool:
    """A scalar known while tracing (a Python or NumPy number, a concrete 0-d array)."""
    if isinstance(x, (bool, int, float, np.generic)):
        return True
    if isinstance(x, np.ndarray):
        return x.ndim == 0
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.ndim == 0


def drain(gen):
    """Runs a generator that yields nothing to its end; returns its value."""
    try:
        next(gen)
    except StopIteration as e:
        return e.value
    raise AssertionError("the TPU interpreter paused with no pause condition")


# Call-like primitives and the parameter holding the jaxpr they call (inlined).
CALL_PARAMS = dict(compat.call_primitives())


class Interpreter:
    """Evaluates kernel jaxprs against a state of cells (see the module docstring).
    Built from the call record (``pallas_call.run``: its params, grid mapping,
    ``kernel_facts``, jaxpr and compiler params), it holds its parts:

    * ``memory`` (``memory.Memory``): the cells, their names and spaces, the on_wait
      DMAs' companion cells, the uninitialized-memory policy;
    * ``checks`` (``errors.Checks``): the run-time checks (bounds, deadlocks, DMAs);
      their record is ``hidden.err``;
    * ``refs`` (``refs.RefAccess``): reads and writes through Ref views;
    * ``cursor`` (``cursor.Cursor``): the core being traced, the grid step, and the
      traced values carried besides the cells (``hidden``);
    * ``transport`` (``transport.LocalTransport``, or ``multi.DeviceTransport`` with
      ``multi_device``): what reaches other devices and cores (remote DMAs, shared
      semaphores, race detection), the latter over the device's link to the session the
      mesh's devices share (``session_link.SessionLink``);
    * ``semaphores`` (``semaphores.Semaphores``): the core's own semaphores and the
      transport's;
    * ``dma`` (``dma.DmaEngine``): the DMA engine, on the memory, the semaphores and
      the transport.

    Each part is handed the parts it needs, never the interpreter."""

    def __init__(
        self,
        params: InterpretParams,
        gm,
        kernel_desc: str,
        *,
        kernel_facts: plb.KernelFacts,
        jaxpr=None,
        compiler_params=None,
        multi_device: bool = False,
    ):
        self.params = params
        self.gm = gm
        self.kernel_desc = kernel_desc
        self.kernel_facts = kernel_facts
        self.compiler_params = compiler_params
        uses_dmas = kernel_facts.uses(tpu_prims.dma_start_p)
        self.memory = Memory(
            dma_shadows=params.dma_execution_mode == "on_wait" and uses_dmas,
            uninitialized=params.uninitialized_memory,
        )
        self.checks = Checks()
        # Static bounds of traced DMA sizes (RefAccess.view_indices).
        size_bounds = facts.dma_size_bounds(jaxpr) if uses_dmas and jaxpr is not None else {}
        self.refs = RefAccess(self.memory, self.checks, params, self.where, self.on_access, size_bounds)
        self.cursor = Cursor()
        self.grid_env: dict[str, jax.Array] = {}  # named grid axis -> index
        self._where_memo: dict = {}  # id(eqn) -> (eqn, where(eqn))
        self.scopes = SharedScopes()  # run_scoped buffers the cores of a device share
        # Cores in lockstep with static grid points: scalar operations on values known
        # while tracing (the core's grid indices) are computed then, so that a cond on
        # the core index (``pl.when(lax.axis_index("x") == 0)``) runs one branch, in
        # which a core may wait for another (see ``fold``).
        self.fold_static = False
        self.grid_sizes: list = list(gm.grid)  # a dynamic grid's sizes (ints and traced scalars)
        local_sems = LocalSemaphores(self.refs, self.checks, self.where)
        dma_views = DmaViews(self.memory, self.refs, self.checks, self.where)
        self.transport: LocalTransport | DeviceTransport = (
            DeviceTransport(
                self.memory,
                self.cursor,
                link := SessionLink(
                    self.memory,
                    self.refs,
                    self.scopes,
                    self.cursor,
                    where=self.where,
                    kernel_desc=kernel_desc,
                    kernel_name=gm.kernel_name,
                    detect_races=params.detect_races and ("raise" if params.races_raise else "warn"),
                    num_cores=params.num_cores_or_threads,
                ),
                RemoteDMAs(
                    self.memory, self.refs, self.checks, self.cursor, local_sems, dma_views, link, self.where
                ),
                where=self.where,
                kernel_desc=kernel_desc,
                kernel_facts=kernel_facts,
                num_cores=params.num_cores_or_threads,
                collective_id=getattr(compiler_params, "collective_id", None),
            )
            if multi_device
            else LocalTransport(self.where)
        )
        self.semaphores = Semaphores(local_sems, self.transport)
        self.dma = DmaEngine(
            dma_views,
            self.memory,
            self.refs,
            self.checks,
            self.semaphores,
            self.transport,
            on_wait=params.dma_execution_mode == "on_wait",
        )

    # -- the parts' state, as the rules read it --------------------------------

    @property
    def core_id(self) -> int:
        """The core whose kernel is being traced (``pallas_call._run_lanes`` moves it)."""
        return self.cursor.core_id

    @core_id.setter
    def core_id(self, value: int) -> None:
        self.cursor.core_id = value

    @property
    def progress(self):
        """(grid step, number of steps), traced, while a grid step runs; else None."""
        return self.cursor.progress

    @progress.setter
    def progress(self, value) -> None:
        self.cursor.progress = value

    @property
    def hidden(self) -> Hidden:
        return self.cursor.hidden

    @hidden.setter
    def hidden(self, value: Hidden) -> None:
        self.cursor.hidden = value

    @property
    def state(self) -> dict[int, jax.Array]:
        return self.memory.state

    @state.setter
    def state(self, value: dict[int, jax.Array]) -> None:
        self.memory.state = value

    @property
    def cell_names(self) -> dict[int, str]:
        return self.memory.cell_names

    @property
    def cell_spaces(self) -> dict[int, Any]:
        return self.memory.cell_spaces

    @property
    def shadows(self) -> dict[int, tuple[int, ...]]:
        return self.memory.shadows

    @property
    def barrier_cell(self) -> int | None:
        """The barrier semaphore's cell (the multi-device transport allocates it)."""
        return self.transport.barrier_cell

    # -- lifecycle -------------------------------------------------------------

    def setup(self) -> None:
        """Called once before the grid starts (after ``init_checks``)."""
        self.transport.start()

    def finish(self) -> None:
        """Called once after the last grid step."""
        self.transport.finish()

    def snapshot(self):
        """The cells' values as a list and the hidden state (a loop carry);
        ``restore`` takes it back."""
        self.flush_checks()
        return self.memory.snapshot(), self.hidden

    def restore(self, vals, hidden: Hidden) -> None:
        self.memory.restore(vals)
        self.hidden = hidden

    # -- cells ---------------------------------------------------------------

    def new_cell(self, value, name: str, space=None, dma_target: bool = True) -> int:
        return self.memory.new_cell(value, name, space, dma_target)

    def new_cell_plain(self, value, name: str, space=None) -> int:
        return self.memory.new_cell_plain(value, name, space)

    def dma_targets(self, jaxpr) -> frozenset[int]:
        return self.memory.dma_targets(jaxpr)

    def free_cell(self, c: int) -> None:
        self.check_dmas_landed(c, "when its scope ends")
        self.memory.free_cell(c)

    # -- Ref reads and writes (refs.RefAccess) ---------------------------------

    def describe_ref(self, view: RefView) -> str:
        return self.refs.describe_ref(view)

    def read_view(self, view: RefView, eqn, what="read"):
        if eqn is not None and eqn.primitive is plb.semaphore_read_p and self.transport.shares(view.cell):
            return self.transport.sem_read(view, eqn)
        return self.refs.read_view(view, eqn, what)

    def write_view(self, view: RefView, val, eqn) -> None:
        self.refs.write_view(view, val, eqn)

    def flat_index(self, view: RefView, eqn):
        return self.refs.flat_index(view, eqn)

    def view_indices(self, view: RefView, eqn, what: str):
        return self.refs.view_indices(view, eqn, what)

    # -- run-time checks (errors.Checks; the record is hidden.err) --------------

    def init_checks(self) -> None:
        self.hidden.err = Checks.new_record()
        self.hidden.tok = jnp.zeros((), jnp.int32)
        self.checks.drop()

    def check(self, ok, message: str, values: Sequence[Any] = ()) -> None:
        self.checks.check(ok, message, values)

    def flush_checks(self) -> None:
        self.hidden.err = self.checks.fold(self.hidden.err)

    def drop_checks(self) -> None:
        self.checks.drop()

    def unchecked(self):
        return self.checks.unchecked()

    def raise_checks(self) -> None:
        """Emits the callback that raises the first recorded error, if any."""
        self.flush_checks()
        self.checks.report(self.hidden.err)

    def check_dmas_landed(self, cell: int, when: str) -> None:
        """on_wait DMAs: an error if data started into ``cell`` has not landed
        though no semaphore is owed it any more (a wait consumed its bytes but
        the interpreter could not tell where that DMA went)."""
        if cell not in self.memory.shadows or len(self.memory.shadows[cell]) != 2:
            return
        pending = self.memory.state[self.memory.shadows[cell][1]]
        self.check(
            lax.eq(count_true(lax.ne(pending, np.int32(0))), np.int32(0)),
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

    # -- jaxpr evaluation ----------------------------------------------------

    def eval_jaxpr(self, jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        return drain(self.iter_jaxpr(jaxpr, consts, args, None))

    def iter_jaxpr(self, jaxpr, consts, args, pause):
        """``eval_jaxpr`` as a generator that yields before each equation for
        which ``pause(eqn)`` holds, also inside ``pl.run_scoped`` and inlined
        calls (not inside control flow: that is traced as one ``lax`` op).
        Cores that signal each other run as such generators in turn (see
        ``pallas_call.run``)."""
        env = Env(jaxpr, consts, args)
        read = env.read
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
            env.bind(eqn.outvars, outs if eqn.primitive.multiple_results else [outs])
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
        if self.params.skip_floating_point_ops and _float_only(eqn):
            outs = [jnp.full(v.aval.shape, jnp.inf, v.aval.dtype) for v in eqn.outvars]
            return outs if prim.multiple_results else outs[0]
        if self.fold_static and not eqn.effects and invals and all(map(is_static_scalar, invals)):
            with jax.ensure_compile_time_eval():
                outs = prim.bind(*invals, **eqn.params)
            if prim.multiple_results:
                return [np.asarray(o) for o in outs]
            return np.asarray(outs)
        return prim.bind(*invals, **eqn.params)

    # -- hooks (the transport's) ----------------------------------------------

    def on_access(self, view: RefView, eqn, write: bool) -> None:
        self.transport.on_access(view, eqn, write)

    def on_block_write(self, hbm_cell: int, starts, sizes, origin: str, when=True) -> None:
        """The pipeline writes an output block back to HBM (``when``: traced bool)."""
        self.transport.on_block_write(hbm_cell, starts, sizes, origin, when)

    def remote_signal(self, eqn, view, inc, device_id, core_index) -> None:
        self.transport.remote_signal(eqn, view, inc, device_id, core_index)

    # -- semaphores ----------------------------------------------------------

    def sem_add(self, view: RefView, amount, eqn) -> None:
        self.semaphores.add(view, amount, eqn)

    def sem_wait(self, view: RefView, amount, eqn, decrement=True, what="semaphore") -> None:
        self.semaphores.wait(view, amount, eqn, decrement=decrement, what=what)


# ---------------------------------------------------------------------------
# Forcing TPU interpret mode on every pallas_call (JAX's API).


_DEFAULT_PARAMS: Any = object()  # a call that names no params: InterpretParams()


@contextlib.contextmanager
def force_tpu_interpret_mode(params: InterpretParams | None = _DEFAULT_PARAMS):
    """Runs every ``pallas_call`` traced in the ``with`` block in TPU interpret mode
    with ``params``, whatever ``interpret`` the call passes (as JAX's) (default
    ``InterpretParams()``; None: none forced in the block). Part of the jit cache key, as
    in JAX: a function jitted outside the block is traced again inside it."""
    with plb.forced_interpret()(InterpretParams() if params is _DEFAULT_PARAMS else params):
        yield


def set_tpu_interpret_mode(params: InterpretParams | None = _DEFAULT_PARAMS) -> None:
    """Makes TPU interpret mode (with ``params``, default ``InterpretParams()``) the default
    from now on; None makes it no longer the default."""
    plb.forced_interpret().set_global(InterpretParams() if params is _DEFAULT_PARAMS else params)
