"""The ``jax_mosaic`` way: the same kernel body traced by JAX's own Pallas
(``jax.experimental.pallas``, a test-only reference), lowered by JAX's Mosaic lowering, exported
for a TPU and run by ``run_mosaic`` on the CPU, as ``mosaic.py`` runs ours.

A kernel body takes ``pl, pltpu = way.modules()``: JAX's here. The outputs are compared with the
test's plain-``jnp`` reference, so beside the ``mosaic`` way this checks that ``run_mosaic``
follows Mosaic, not our lowering: a kernel both lowerings run to the same reference. Ours' TPU
check does not apply (JAX's lowering refuses what it refuses; a rule JAX's lowering lacks is a
``skip`` with its reason). Not for an op of ``pallas_tpu.ops`` (written against our modules).

JAX's Pallas as a reference: ``jax_namespaces()`` (its ``pl``, ``pltpu``), ``OLD_JAX`` (JAX 0.10,
the oldest supported, whose libtpu and Pallas lack some of what ours has), ``tensorcore_mesh``
(a chip's two TensorCores under either release's name) and ``load_example`` (an example with its
Pallas imports rewritten to JAX's).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import jax

from .mosaic import MosaicEngine

# JAX 0.10.2, the oldest supported (Python 3.11's, the lent v5e's), comes with libtpu 0.0.42.1,
# whose Mosaic compiler refuses some forms that of JAX 0.11.2 (libtpu 0.0.48.1) takes, and its
# Pallas lacks some of the features ours has.
OLD_JAX = jax.__version_info__ < (0, 11)


def jax_namespaces():
    """JAX's ``(pl, pltpu)``: ``jax.experimental.pallas`` and its ``tpu``."""
    from jax.experimental import pallas as jpl
    from jax.experimental.pallas import tpu as jtpu

    return jpl, jtpu


class JaxMosaicEngine(MosaicEngine):
    name = "jax_mosaic"
    jax_lowering = True
    runs_ops = False

    def modules(self, way):
        return jax_namespaces()


def tensorcore_mesh(pltpu, axis_name: str = "core", num_cores: int = 2):
    """A mesh of ``num_cores`` TensorCores (a chip's two by default) in ``pltpu`` (ours or
    JAX's): JAX 0.11 and later name its constructor ``TensorCoreMesh`` (0.12.1 removed
    ``create_tensorcore_mesh``), JAX 0.10 only ``create_tensorcore_mesh``."""
    if hasattr(pltpu, "TensorCoreMesh"):
        return pltpu.TensorCoreMesh(axis_name=axis_name, num_cores=num_cores)
    return pltpu.create_tensorcore_mesh(axis_name, num_cores=num_cores)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str, mode: str):
    """``examples/<name>.py`` as a module; for mode ``"jax"`` with its two Pallas
    imports rewritten to JAX's (the reverse of the migration the example shows)."""
    src = (EXAMPLES / f"{name}.py").read_text()
    if mode == "jax":
        src = re.sub(r"^import pallas as pl$", "from jax.experimental import pallas as pl", src, flags=re.M)
        src = re.sub(
            r"^import pallas_tpu as pltpu$",
            "from jax.experimental.pallas import tpu as pltpu",
            src,
            flags=re.M,
        )
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_loader(f"_example_{name}_{mode}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, str(EXAMPLES / f"{name}.py"), "exec"), mod.__dict__)
    return mod
