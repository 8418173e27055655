"""The ``mosaic`` way: our Mosaic lowering of a kernel, exported for a TPU and run by
``run_mosaic`` (pallas-tpu's executor of Mosaic modules) on the CPU.

A ``pallas_call`` (or a function of them: ``way.jit``) is traced under the abstract TPU it is
written for (a v5e; a megacore chip with ``num_cores=2``; ``chip``'s generation), its kernels
checked for a TPU (``tpu_check``: a kernel no TPU runs skips the way), and the trace evaluated
with each kernel replaced by ``run_mosaic`` of the module exported for that kernel alone (the
module of the equation itself: no pairing of modules with kernels by their order). The outputs
are compared with the test's plain-``jnp`` reference at the host's arithmetic, so the way checks
our lowering against the executor's reading of Mosaic's semantics. Kernels under ``vmap`` or
``grad`` skip (``run_mosaic`` takes concrete arrays; the interpret ways cover transformations).

The machinery here serves every engine that runs Mosaic modules (``jax_mosaic``, ``compiled``,
``jax_beside``, ``chip``) and the tests of ``run_mosaic`` itself: ``tpu_modules(f, *args)`` (the
modules ``f`` exports), ``run_with_mosaic(f, *args)`` (its flat outputs by ``run_mosaic``),
``run_sharded_with_mosaic`` (one kernel over a mesh of devices), ``abstract_mesh`` and
``DEVICE_KINDS`` (the TPU a kernel is exported for).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import export
from jax.extend.core import jaxprs_in_params

from . import tpu_check
from .engine import Engine, whole_function

# The device kind of each chip generation a test names (``Way.with_params(chip=...)``).
DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite", "7x": "TPU7x"}


def abstract_mesh(num_cores, chip=None):
    """The abstract TPU a kernel is exported for (JAX's lowering asks the device for its TPU
    generation for some ops): ``chip``'s generation, or a v5e (a v4, a megacore chip, with
    ``num_cores=2``)."""
    chip = chip or ("v5e" if num_cores == 1 else "v4")
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KINDS[chip], num_cores=num_cores, platform="tpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


TPU_V5E = abstract_mesh(1)


def _bodies(txt: str) -> list[bytes]:
    from pallas_tpu._src.executor import run as executor

    return executor.custom_call_bodies(txt)


def tpu_modules(f, *args, num_cores=1, chip=None) -> list[bytes]:
    """The serialized Mosaic modules of ``f(*args)`` exported for TPU (a chip
    with ``num_cores`` TensorCores: TPU v5e for one, TPU v4 for two; or ``chip``), in program order."""
    with jax.sharding.use_abstract_mesh(abstract_mesh(num_cores, chip)):
        txt = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    return _bodies(txt)


def trace(f, args, num_cores=1, chip=None):
    """``f(*args)`` traced for the TPU it is exported for: its closed jaxpr and output shapes."""
    with jax.sharding.use_abstract_mesh(abstract_mesh(num_cores, chip)):
        return tpu_check.trace(f, args)


def run_with_mosaic(f, *args, num_cores=1, chip=None) -> list:
    """The flat outputs of ``f(*args)``, each kernel replaced by ``run_mosaic`` of the module
    it exports for TPU (``chip``'s generation where given)."""
    closed, _ = trace(f, args, num_cores, chip)
    return run_traced(closed, args, num_cores, chip)


# The primitives of a kernel: ours and JAX's ``pallas_call``; JAX's ``mpmd_map`` (its
# ``pl.kernel`` over a TensorCoreMesh). Their operands count the scalar-prefetch ones, as
# run_mosaic's do.
_KERNELS = ("pallas_call", "mpmd_map")
# The primitives whose jaxpr runs once, in place: evaluated here, their kernels by run_mosaic.
_CALLS = ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat")


def run_traced(closed, args, num_cores=1, chip=None) -> list:
    """The flat outputs of a trace (``trace``) evaluated on ``args``, each kernel run by
    ``run_mosaic``; every kernel of the trace must be reached (one under ``cond`` or ``while``
    is not: the trace would run it in interpret mode, not as a TPU does)."""
    reached = []
    outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), num_cores, chip, reached)
    count = _count_kernels(closed.jaxpr)
    assert len(reached) == count, f"{count - len(reached)} of the {count} kernels were not reached"
    return outs


def _count_kernels(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _KERNELS:
            n += 1
        elif eqn.primitive.name == "run_state":  # counted as _eval runs it: discharged
            from pallas._src import compat

            n += _count_kernels(compat.discharge(compat.close_jaxpr(eqn.params["jaxpr"])).jaxpr)
        else:  # a kernel under any other primitive counts: one under cond or while is not reached
            n += sum(_count_kernels(getattr(s, "jaxpr", s)) for s in jaxprs_in_params(eqn.params))
    return n


def module_of(eqn, num_cores=1, chip=None) -> bytes:
    """The Mosaic module of one kernel equation, exported for a TPU on its own."""
    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
        for v in eqn.invars
    ]
    (body,) = tpu_modules(
        lambda *a: eqn.primitive.bind(*a, **eqn.params), *avals, num_cores=num_cores, chip=chip
    )
    return body


def _eval(jaxpr, consts, args, num_cores, chip, reached):
    import pallas_tpu as pltpu
    from pallas._src import compat

    env = {}

    def read(v):
        return v.val if type(v).__name__ == "Literal" else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _KERNELS:
            out_shape = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
            aliases = dict(eqn.params.get("input_output_aliases", ()))
            module = module_of(eqn, num_cores, chip)
            reached.append(eqn)
            outs = pltpu.run_mosaic(
                module, *invals, out_shape=out_shape, input_output_aliases=aliases, num_cores=num_cores
            )
        elif name == "run_state":  # a core_map's Refs: discharged, its kernel's module run on their values
            sub = compat.discharge(compat.close_jaxpr(eqn.params["jaxpr"]))
            outs = _eval(sub.jaxpr, sub.consts, invals, num_cores, chip, reached)
        elif name in _CALLS:
            sub = next(eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params)
            if hasattr(sub, "consts"):
                outs = _eval(sub.jaxpr, sub.consts, invals, num_cores, chip, reached)
            else:
                outs = _eval(sub, (), invals, num_cores, chip, reached)
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def run_sharded_with_mosaic(f, x, mesh_shape, input_output_aliases=()):
    """``f`` (one ``pallas_call`` per device) ``shard_map``ped over a mesh of ``mesh_shape``
    on the leading axis of ``x`` (as ``way.run_sharded``), exported for TPU and its module run by
    ``run_mosaic`` on every device; the outputs concatenated along that axis."""
    from jax.sharding import PartitionSpec as P

    import pallas_tpu as pltpu

    shape = tuple(mesh_shape)
    n = int(np.prod(shape))
    names = ("x", "y", "z", "w")[: len(shape)]
    spec = P(names[0]) if len(shape) == 1 else P(names)
    mesh = jax.sharding.AbstractMesh(
        shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        abstract_device=TPU_V5E.abstract_device,
    )
    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    with jax.sharding.use_abstract_mesh(mesh):
        txt = export.export(jax.jit(g), platforms=["tpu"])(x).mlir_module()
        whole = jax.eval_shape(g, x)
    (body,) = _bodies(txt)
    out_shape = jax.ShapeDtypeStruct((whole.shape[0] // n, *whole.shape[1:]), whole.dtype)
    shards = x.reshape(*shape, x.shape[0] // n, *x.shape[1:])
    kw = dict(num_devices=n) if len(shape) == 1 else dict(mesh_shape=shape)
    per_device = pltpu.run_mosaic(
        body, shards, out_shape=out_shape, input_output_aliases=input_output_aliases, **kw
    )
    return per_device.reshape(n * out_shape.shape[0], *out_shape.shape[1:])


def skip_under_a_transformation(args):
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        pytest.skip(
            "a Mosaic way runs a pallas_call on concrete arrays (or a function of them: way.jit),"
            " not under vmap, grad or a jit of its own"
        )


class MosaicEngine(Engine):
    """Runs a kernel's Mosaic module by ``run_mosaic``: the base of every engine that lowers
    (``execute`` is what each does with a checked trace)."""

    name = "mosaic"
    tpu = True
    runs_ops = True

    def pallas_call(self, way, kernel, out_shape, **kwargs):
        kwargs.pop("interpret", None)
        f = self.modules(way)[0].pallas_call(kernel, out_shape, **kwargs)
        # Inside ``way.jit``'s function the call is lowered with it; alone it is run now.
        return lambda *args: f(*args) if whole_function.active else self.run(way, f, args)

    def jit(self, way, f):
        """Exports ``f`` whole for a TPU (a traced grid size, an enclosing function's arrays
        captured by a kernel: as a TPU gets them) and runs each of its kernels' modules."""

        def run(*args):
            with whole_function():
                return self.run(way, f, args)

        return run

    def op(self, way, op, *args, **kw):
        return self.jit(way, lambda *a: op(*a, **kw))(*args)

    def run_sharded(self, way, f, x, shape, names, spec, input_output_aliases):
        return run_sharded_with_mosaic(f, x, shape, input_output_aliases)

    def check(self, way, closed) -> None:
        tpu_check.check(self, way, closed)

    def run(self, way, f, args):
        """``f(*args)`` (a ``pallas_call``, or ``way.jit``'s function) run this way: traced for
        the way's TPU, its kernels checked, then ``execute``d."""
        skip_under_a_transformation(args)
        closed, shapes = trace(f, args, way.num_cores, way.chip)
        self.check(way, closed)
        return self.execute(way, f, args, closed, shapes)

    def execute(self, way, f, args, closed, shapes):
        """The outputs of the checked trace of ``f(*args)``: each kernel run by ``run_mosaic``."""
        outs = [jax.numpy.asarray(x) for x in run_traced(closed, args, way.num_cores, way.chip)]
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)
