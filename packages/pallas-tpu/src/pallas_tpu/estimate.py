"""``python -m pallas_tpu.estimate``: a TPU kernel's estimated speed, on any machine.

    python -m pallas_tpu.estimate pallas_tpu.ops.matmul:matmul "bf16[4096,4096]" "bf16[4096,4096]"
    python -m pallas_tpu.estimate examples/tpu_matmul.py:matmul "f32[1024,1024]" "f32[1024,1024]" \\
        --chip v6e --kw block_m=256 --json out.json --plot step.png

The function (``module:function``, the module dotted or a ``.py`` file) is called with
arguments of those shapes and dtypes (``ShapeDtypeStruct``: ``bf16``, ``f32``, ``f16``,
``s8``/``int8``, ``s32``/``int32``, ``u32``..., or any ``jnp`` dtype name) and static keyword
arguments ``--kw name=value`` (a Python literal, bound with ``functools.partial``), compiled for the chip by libtpu and
estimated (``pallas_tpu.estimate``). Needs libtpu (``pip install "jax[tpu]"``); the picture
needs matplotlib.

``import pallas_tpu as pltpu; pltpu.estimate(f, *args, chip="v5e")`` is the same from Python
(this module, once imported, is callable as that function).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import json
import os
import re
import sys
import types

from pallas_tpu._src.estimate import CHIPS as CHIPS
from pallas_tpu._src.estimate import Chip as Chip
from pallas_tpu._src.estimate import Estimate as Estimate
from pallas_tpu._src.estimate import EstimateError as EstimateError
from pallas_tpu._src.estimate import KernelEstimate as KernelEstimate
from pallas_tpu._src.estimate import XlaOpEstimate as XlaOpEstimate
from pallas_tpu._src.estimate import enable_dumps as enable_dumps
from pallas_tpu._src.estimate import estimate as estimate

_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "s8": "int8", "u8": "uint8",
           "s16": "int16", "s32": "int32", "u32": "uint32", "s64": "int64", "pred": "bool"}  # fmt: skip


def parse_arg(spec: str):
    """``"bf16[1024,512]"`` (or ``"float32[8]"``, ``"s32[]"``) as a ``jax.ShapeDtypeStruct``."""
    import jax
    import jax.numpy as jnp

    m = re.fullmatch(r"\s*(\w+)\s*\[([\d,\s]*)\]\s*", spec)
    if not m:
        raise EstimateError(f"estimate: an argument is DTYPE[SHAPE] (e.g. bf16[1024,1024]), not {spec!r}")
    name = _DTYPES.get(m.group(1), m.group(1))
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        raise EstimateError(f"estimate: unknown dtype {m.group(1)!r} in {spec!r}") from None
    shape = tuple(int(d) for d in m.group(2).split(",") if d.strip())
    return jax.ShapeDtypeStruct(shape, dtype)


def load_function(spec: str):
    """``"package.module:function"`` or ``"path/file.py:function"``: the function."""
    if ":" not in spec:
        raise EstimateError(f"estimate: name the function as MODULE:FUNCTION, not {spec!r}")
    mod_name, _, attr = spec.rpartition(":")
    if mod_name.endswith(".py") or os.path.sep in mod_name:
        path = os.path.abspath(mod_name)
        sys.path.insert(0, os.path.dirname(path))
        name = os.path.splitext(os.path.basename(path))[0]
        loader = importlib.util.spec_from_file_location(name, path)
        if loader is None or loader.loader is None:
            raise EstimateError(f"estimate: cannot load {mod_name}")
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pallas_tpu.estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("function", help="MODULE:FUNCTION (dotted module or path/to/file.py)")
    ap.add_argument("args", nargs="*", help="the arguments' DTYPE[SHAPE], e.g. bf16[1024,1024]")
    ap.add_argument("--chip", default="v5e", choices=sorted(CHIPS), help="TPU generation (default v5e)")
    ap.add_argument(
        "--kw", action="append", default=[], metavar="NAME=VALUE", help="a keyword argument (Python literal)"
    )
    ap.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    ap.add_argument(
        "--plot", metavar="FILE.png", help="also save the first kernel's picture (needs matplotlib)"
    )
    a = ap.parse_args(argv)
    enable_dumps()  # before anything starts libtpu: compile in this process
    try:
        fn = load_function(a.function)
        args = [parse_arg(s) for s in a.args]
        kwargs = {}
        for kv in a.kw:
            k, _, v = kv.partition("=")
            try:
                kwargs[k] = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                kwargs[k] = v
        # Keyword arguments are static (block sizes...): bound, not traced.
        report = estimate(functools.partial(fn, **kwargs) if kwargs else fn, *args, chip=a.chip)
    except EstimateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    if a.plot:
        try:
            print(f"picture: {report.plot(a.plot)}")
        except EstimateError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


class _CallableModule(types.ModuleType):
    """``import pallas_tpu.estimate`` replaces ``pltpu.estimate`` (the function) by this
    module: calling the module calls the function."""

    def __call__(self, f, *args, chip: str = "v5e", **kwargs):
        return estimate(f, *args, chip=chip, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
