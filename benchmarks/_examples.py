"""The examples' kernels, for the benchmarks: one source per kernel (examples/),
run with our Pallas or with JAX's as the reference to beat.

``load(name, pallas)`` is ``examples/<name>.py`` as a module; with ``pallas="jax"``
its Pallas imports are rewritten to JAX's (``import pallas as pl`` ->
``from jax.experimental import pallas as pl``, and the TPU and Triton backends'),
the reverse of the migration the examples show. ``which(pl)`` says which Pallas a
``pl`` module is.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_TO_JAX = {
    r"^import pallas as pl$": "from jax.experimental import pallas as pl",
    r"^import pallas_tpu as pltpu$": "from jax.experimental.pallas import tpu as pltpu",
    r"^import pallas_gpu as plgpu$": "from jax.experimental.pallas import triton as plgpu",
}


def which(pl) -> str:
    """``"jax"`` for JAX's ``jax.experimental.pallas`` (or a module of it), else ``"ours"``."""
    return "jax" if pl.__name__.startswith("jax.") else "ours"


@functools.cache
def load(name: str, pallas: str = "ours"):
    """``examples/<name>.py`` as a module, with our Pallas (``"ours"``) or JAX's (``"jax"``)."""
    assert pallas in ("ours", "jax"), pallas
    src = (EXAMPLES / f"{name}.py").read_text()
    if pallas == "jax":
        for ours, theirs in _TO_JAX.items():
            src = re.sub(ours, theirs, src, flags=re.M)
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # the examples import their _common helpers
    spec = importlib.util.spec_from_loader(f"_example_{name}_{pallas}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, str(EXAMPLES / f"{name}.py"), "exec"), mod.__dict__)
    return mod


@dataclasses.dataclass(frozen=True)
class Calls:
    """What the examples' kernels take as ``backend`` (``call_kwargs(**gpu_params)``, as
    examples/_common.py's ``Backend``), for either Pallas: ``interpret`` (any value
    ``pallas_call`` takes, e.g. ``plgpu.InterpretParams()``) and the GPU backend's
    ``CompilerParams`` class, built from the kernel's ``num_warps``/``num_stages`` (or
    ``compiler_params`` given whole)."""

    interpret: Any = False
    compiler_params_cls: Any = None
    compiler_params: Any = None  # given whole: the kernel's own num_warps/num_stages are not used

    def call_kwargs(self, **gpu_params) -> dict[str, Any]:
        kw = {"interpret": self.interpret} if self.interpret is not False else {}
        if self.compiler_params is not None:
            kw["compiler_params"] = self.compiler_params
        elif gpu_params and self.compiler_params_cls is not None:
            kw["compiler_params"] = self.compiler_params_cls(**gpu_params)
        return kw


INTERPRET = Calls(interpret=True)
