"""``pl.kernel``: run a body once per point of a mesh (e.g. once per TPU core),
on whole-array Refs. Built on ``pallas_call`` with a named grid."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax import tree_util

from pallas._src import core as pallas_core
from pallas._src.pallas_call import pallas_call


def kernel(
    body: Callable[..., None] | None = None,
    out_type: Any = (),
    *,
    mesh: pallas_core.Mesh,
    scratch_types: Any = (),
    compiler_params: Any = None,
    interpret: Any = False,
    cost_estimate: pallas_core.CostEstimate | None = None,
    debug: bool = False,
    name: str | None = None,
    metadata: dict[str, str] | None = None,
):
    """Runs ``body(*in_refs, *out_refs, *scratch_refs)`` once per mesh point.

    The Refs come as JAX's ``pl.kernel`` passes them: one argument per operand
    (pytree operands as pytrees of Refs), one per element of a sequence
    ``out_type`` (else the output pytree as one argument), the scratch Refs in
    ``scratch_types``' structure (``None`` entries as ``None``; a dict as keyword
    arguments). An operand passed through ``pltpu.with_memory_space_constraint``
    inside the traced function comes as a Ref in that memory space (e.g. SMEM);
    the others in the mesh's default space.

    Args:
      body: the kernel body; omit it to use ``pl.kernel(...)`` as a decorator.
      out_type: a pytree of ``jax.ShapeDtypeStruct`` (the outputs).
      mesh: a ``pl.Mesh`` such as ``pltpu.TensorCoreMesh(axis_name="core")``;
        ``lax.axis_index(name)`` gives the position along each mesh axis.
      scratch_types: a pytree of scratch shapes (``pltpu.VMEM(...)``, semaphores).
      compiler_params, interpret, cost_estimate, debug, name, metadata: as for
        ``pallas_call``.
    Returns:
      A function of the inputs returning a pytree like ``out_type``.
    """
    if body is None:
        return lambda fn: kernel(
            fn,
            out_type,
            mesh=mesh,
            scratch_types=scratch_types,
            compiler_params=compiler_params,
            interpret=interpret,
            cost_estimate=cost_estimate,
            debug=debug,
            name=name,
            metadata=metadata,
        )
    grid = _mesh_grid(mesh)
    flat_scratch, scratch_tree = tree_util.tree_flatten(scratch_types, is_leaf=_is_scratch)
    ms = mesh.default_memory_space
    out_leaves, out_tree = tree_util.tree_flatten(out_type)
    spec = pallas_core.BlockSpec(memory_space=ms)

    def run(*args):
        in_paths, in_tree = tree_util.tree_flatten_with_path(args)
        in_leaves = [leaf for _, leaf in in_paths]
        in_specs = [_operand_spec(path, leaf, spec) for path, leaf in in_paths]
        call = pallas_call(
            _body_on_flat_refs(body, out_type, in_tree, out_tree, scratch_tree),
            out_shape=tuple(out_leaves),
            grid=grid,
            in_specs=in_specs,
            out_specs=[spec] * len(out_leaves),
            scratch_shapes=flat_scratch,
            compiler_params=mesh.compiler_params(compiler_params),
            interpret=interpret,
            cost_estimate=cost_estimate,
            debug=debug,
            name=name or getattr(body, "__name__", None),
            metadata=metadata,
        )
        outs = call(*in_leaves)
        return tree_util.tree_unflatten(out_tree, list(outs))

    run.__name__ = getattr(body, "__name__", "kernel")
    return run


def _mesh_grid(mesh) -> tuple[tuple[str, int], ...]:
    """The named grid of ``mesh``: one ``(axis name, size)`` per mesh axis."""
    if not isinstance(mesh, pallas_core.Mesh):
        raise TypeError(f"pl.kernel: mesh must be a pl.Mesh (e.g. pltpu.TensorCoreMesh), got {mesh!r}")
    return tuple((n, s) for n, s in mesh.shape.items())


def _is_scratch(x) -> bool:
    return hasattr(x, "get_ref_aval")


def _body_on_flat_refs(body, out_type, in_tree, out_tree, scratch_tree) -> Callable[..., None]:
    """A kernel of the flat Refs (inputs, outputs, scratch) that calls ``body``
    with them as JAX's ``pl.kernel`` passes them."""
    n_in, n_out = in_tree.num_leaves, out_tree.num_leaves

    def refs_as_jax_passes_them(*refs):
        # JAX's pl.kernel: one argument per operand (a pytree of Refs like the
        # operand), the outputs one per element of a sequence out_type (else one
        # pytree), the scratch Refs in scratch_types' structure, a None entry
        # passed as None (tokamax's gmm_v2 keeps unused slots so); a dict of
        # scratch types is passed as keyword arguments.
        ins = tree_util.tree_unflatten(in_tree, refs[:n_in])
        outs = tree_util.tree_unflatten(out_tree, refs[n_in : n_in + n_out])
        scratch = tree_util.tree_unflatten(scratch_tree, refs[n_in + n_out :])
        positional = [*ins, *outs] if isinstance(out_type, Sequence) else [*ins, outs]
        if isinstance(scratch, Mapping):
            return body(*positional, **scratch)
        return body(*positional, *scratch)

    return refs_as_jax_passes_them


def _operand_spec(path, leaf, default: pallas_core.BlockSpec) -> pallas_core.BlockSpec:
    """The operand's BlockSpec: in the memory space ``with_memory_space_constraint``
    asked for (as JAX's ``pl.kernel`` takes it from the operand's type), else the
    mesh's default space."""
    ms = pallas_core.constrained_memory_space(leaf)
    if ms is None:
        return default
    if not pallas_core.is_memory_space(ms):
        raise TypeError(
            f"pl.kernel: operand args{tree_util.keystr(path)} is constrained to memory space {ms!r},"
            " which is not a memory space (use e.g. pltpu.SMEM, pltpu.VMEM, pltpu.HBM or pl.ANY)"
        )
    return pallas_core.BlockSpec(memory_space=ms)
