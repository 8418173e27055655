"""``pl.core_map``: run a function of no arguments once per point of a mesh
(e.g. once per TPU core), on the Refs it closes over.

JAX 0.11 keeps it (deprecated in favour of ``pl.kernel``); kernels written
against it use it inside ``pl.run_state``. Built here on ``pallas_call`` with the
mesh's named grid, as ``pl.kernel`` is: the closed-over Refs become operands in
the mesh's memory space, those the function writes (a Ref write or DMA
effect) each aliased to an output, as JAX's ``core_map`` passes them, and their
final values are written back to the Refs after the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pallas._src import compat
from pallas._src import core as pallas_core
from pallas._src.pallas_call import pallas_call


def core_map(
    mesh: pallas_core.Mesh,
    *,
    compiler_params: Any = None,
    interpret: Any = False,
    debug: bool = False,
    cost_estimate: pallas_core.CostEstimate | None = None,
    name: str | None = None,
    metadata: dict[str, str] | None = None,
    scratch_shapes: Any = (),
) -> Callable[[Callable[[], None]], None]:
    """Runs ``f()`` once per point of ``mesh``, as a decorator: ``@pl.core_map(mesh)``
    over ``def f(): ...`` runs it at once and binds the name to ``None``.

    ``f`` takes no arguments and returns nothing; it reads and writes the Refs it
    closes over (those of ``pl.run_state``, say). Inside it ``lax.axis_index(name)``
    is the position along a mesh axis and ``lax.psum(1, name)`` the axis size.

    Args:
      mesh: a ``pl.Mesh`` such as ``pltpu.TensorCoreMesh(axis_name="x")``.
      compiler_params, interpret, debug, cost_estimate, name, metadata: as for
        ``pallas_call``.
      scratch_shapes: scratch buffers; ``f`` gets them as arguments (a
        sequence positionally, a dict as keyword arguments).
    Returns:
      A decorator that runs its function and returns ``None``.
    """
    if not isinstance(mesh, pallas_core.Mesh):
        raise TypeError(
            f"pl.core_map: mesh must be a pl.Mesh (e.g. pltpu.TensorCoreMesh(axis_name='x')), got {mesh!r}"
        )
    grid = tuple(mesh.shape.items())

    def wrapped(f: Callable[..., None]) -> None:
        fname = name or getattr(f, "__name__", "core_map")
        flat_scratch, scratch_tree = jax.tree.flatten(scratch_shapes, is_leaf=_is_scratch)
        scratch_avals = [s.get_ref_aval() for s in flat_scratch]

        def flat_f(*scratch_refs):
            scratch = jax.tree.unflatten(scratch_tree, scratch_refs)
            out = f(**scratch) if isinstance(scratch, dict) else f(*scratch)
            if out is not None:
                raise TypeError(
                    f"pl.core_map: the function {fname} must return None, got {type(out).__name__}"
                )
            return []

        # Traced once to find the Refs (and values) ``f`` closes over: they come
        # back as the leading inputs of the jaxpr.
        with compat.extend_axis_env(grid):
            jaxpr, consts = compat.trace_to_closed_jaxpr(
                flat_f, scratch_avals, compat.make_debug_info("core_map", f, flat_scratch)
            )
        is_ref = [compat.is_ref_aval(compat.get_aval(c)) for c in consts]
        refs = [c for c, r in zip(consts, is_ref) if r]
        ref_index = {i: k for k, i in enumerate(i for i, r in enumerate(is_ref) if r)}  # input -> ref
        writes = (compat.WriteEffect, compat.AccumEffect)
        effects = compat.jaxpr_effects_on_inputs(jaxpr)
        # The Refs ``f`` writes (a store or a DMA into them) become outputs, as in JAX.
        written = sorted({ref_index[i] for t, i in effects if t in writes and i in ref_index})
        values = [r[...] for r in refs]

        def body(*kernel_refs):
            in_refs, out_refs = kernel_refs[: len(refs)], kernel_refs[len(refs) : len(refs) + len(written)]
            scratch_refs = kernel_refs[len(refs) + len(written) :]
            ref_for = dict(enumerate(in_refs)) | dict(zip(written, out_refs))
            args = [ref_for[ref_index[i]] if r else c for i, (c, r) in enumerate(zip(consts, is_ref))]
            compat.jaxpr_as_fun(jaxpr)(*args, *scratch_refs)

        spec = pallas_core.BlockSpec(memory_space=mesh.default_memory_space)
        outs = pallas_call(
            body,
            out_shape=tuple(jax.ShapeDtypeStruct(values[k].shape, values[k].dtype) for k in written),
            grid=grid,
            in_specs=[spec] * len(values),
            out_specs=[spec] * len(written),
            scratch_shapes=flat_scratch,
            input_output_aliases={k: j for j, k in enumerate(written)},
            compiler_params=mesh.compiler_params(compiler_params),
            interpret=interpret,
            cost_estimate=cost_estimate,
            debug=debug,
            name=fname,
            metadata=metadata,
        )(*values)
        for k, out in zip(written, outs):
            refs[k][...] = out
        return None

    return wrapped


def _is_scratch(x) -> bool:
    return hasattr(x, "get_ref_aval")
