"""The compiled way for downstream TPU kernels: every TPU ``pallas_call`` a run
traces, lowered by the side's Pallas (JAX's or ours) and compiled by libtpu's
Mosaic for compile-only v5e and v6e devices (``pallas_tpu._src.mosaic.compile_check``).

The kernels run in TPU interpret mode as before (a CPU runs nothing else); this
module only watches: ``record(side)`` notes the parameters and argument shapes of
each ``pallas_call_p`` that the side binds (its own record, the kernel jaxpr and
grid mapping as the side made them), and ``compile_recorded()`` binds each again
under ``jax.jit`` for a compile-only TPU device with ``interpret`` off, lowers it
(the side's Mosaic lowering) and compiles it (libtpu: XLA and Mosaic down to the
chip's instructions). Outcomes per kernel and chip:

``compiled``
    lowered and compiled;
``refused by Mosaic``
    lowered, but libtpu refused the module (Mosaic's message);
``refused by lowering``
    the side's lowering raised before any module existed;
``not traced``
    (``trace_and_compile``) tracing the caller raised: no kernel to compile.

Pallas Triton and Mosaic GPU kernels are not recorded.
"""

from __future__ import annotations

import os
import threading

CHIPS = ("v5e", "v6e")
OUTCOMES = ("compiled", "refused by Mosaic", "refused by lowering", "not traced")

_recorded: list[tuple] = []  # (kernel name, primitive, params, argument avals)
_seen: set = set()
_state = threading.local()  # .replaying: the compile's own binds are not recorded


def _primitive(side: str):
    if side == "jax":
        from jax._src.pallas.pallas_call import pallas_call_p
    else:
        from pallas._src.pallas_call_rules import pallas_call_p
    return pallas_call_p


def _is_tpu(params) -> bool:
    """Not a Pallas Triton or Mosaic GPU kernel (no compiler params: the TPU's default)."""
    cp = params.get("compiler_params")
    if isinstance(cp, tuple) and cp:
        cp = cp[0]
    marks = [str(params.get("backend") or "")]
    if isinstance(cp, dict):
        marks += list(cp)
    elif cp is not None:
        marks.append(f"{type(cp).__module__}.{type(cp).__name__}")
    return not any(("triton" in m or "gpu" in m.lower()) for m in marks)


def kernel_name(side: str, params) -> str:
    if side == "ours":
        gm = params["grid_mapping"]
        return f"{gm.kernel_name} at {gm.source}"
    dbg = getattr(params["jaxpr"], "debug_info", None)
    name = params.get("name") or getattr(dbg, "func_name", None) or "kernel"
    src = getattr(dbg, "func_src_info", None) or ""
    src = src.rpartition(" at ")[2] if " at " in src else src
    return f"{name} at {os.path.basename(src.rpartition(':')[0])}:{src.rpartition(':')[2]}" if src else name


def record(side: str) -> None:
    """From now on, note every TPU ``pallas_call_p`` that ``side``'s Pallas binds."""
    import jax

    prim = _primitive(side)
    if getattr(prim, "_downstream_recording", False):
        return
    bind = prim.bind

    def recording_bind(*args, **params):
        if not getattr(_state, "replaying", False) and _is_tpu(params):
            try:
                avals = tuple(jax.typeof(a) for a in args)
                key = (id(params["jaxpr"]), id(params["grid_mapping"]), avals)
                if key not in _seen:
                    _seen.add(key)
                    _recorded.append((kernel_name(side, params), prim, dict(params), avals))
            except Exception:  # noqa: BLE001  (watching must never change the run)
                pass
        return bind(*args, **params)

    prim.bind = recording_bind
    prim._downstream_recording = True


def _chip_context(chip: str):
    """An abstract mesh of ``chip``'s device kind: JAX's lowering reads the TPU
    generation from the context (without one it sees the CPU)."""
    import jax

    from pallas_tpu._src.mosaic import compile_check

    dev = compile_check.tpu_devices(chip)[0]
    kind = jax.sharding.AbstractDevice(
        device_kind=dev.device_kind, num_cores=getattr(dev, "num_cores", 1) or 1, platform="tpu"
    )
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=kind))


def _no_forced_interpret(side: str):
    """The forced TPU interpret mode lifted (it wins over a call's ``interpret=``, ours as JAX's)."""
    if side == "jax":
        from jax.experimental.pallas import tpu as jpltpu

        return jpltpu.force_tpu_interpret_mode(None)
    import pallas_tpu as pltpu

    return pltpu.force_tpu_interpret_mode(None)


def _first_line(e: BaseException) -> str:
    text = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def compile_one(side: str, prim, params, avals, chip: str) -> tuple[str, str]:
    """(outcome, message) of one recorded kernel lowered and compiled for ``chip``."""
    import jax

    from pallas_tpu._src.mosaic import compile_check

    params = dict(params, interpret=False)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals]

    def fn(*a):
        return prim.bind(*a, **params)

    _state.replaying = True
    try:
        with _chip_context(chip), _no_forced_interpret(side):
            compile_check.compile_for(fn, args, chip)
        return "compiled", ""
    except compile_check.MosaicCompileError as e:
        msg = str(e).split("\n(libtpu's message follows)")[0].replace("\n", " ")
        return "refused by Mosaic", msg[:400]
    except Exception as e:  # noqa: BLE001  (the side's lowering refused it)
        return "refused by lowering", _first_line(e)
    finally:
        _state.replaying = False


def compile_recorded(side: str, chips=CHIPS) -> list[list[str]]:
    """Lowers and compiles every kernel recorded since the last call, for each chip:
    ``[[kernel, chip, outcome, message], ...]``; the record is emptied."""
    from pallas_tpu._src.mosaic import compile_check

    kernels = list(_recorded)
    _recorded.clear()
    _seen.clear()
    if not kernels:
        return []
    if not compile_check.libtpu_available():
        return [
            [k[0], c, "refused by lowering", 'no libtpu: pip install "jax[tpu]"']
            for k in kernels
            for c in chips
        ]
    rows = []
    for name, prim, params, avals in kernels:
        for chip in chips:
            outcome, msg = compile_one(side, prim, params, avals, chip)
            rows.append([name, chip, outcome, msg])
    return rows


def trace_and_compile(side: str, fn, args, kwargs, chips=CHIPS) -> list[list[str]]:
    """For each chip: ``fn(*args, **kwargs)`` traced (``jax.eval_shape``, nothing runs)
    with the chip's device kind in context, so that kernels which pick their tiling or
    refuse by the TPU generation (``get_tpu_info``) are traced as for that chip; then
    every TPU kernel it bound lowered and compiled for that chip. A trace that raises
    gives one row ``[-, chip, "not traced", message]``."""
    import jax

    rows = []
    _recorded.clear()
    _seen.clear()
    for chip in chips:
        try:
            with _chip_context(chip):
                jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)
        except Exception as e:  # noqa: BLE001  (the library or the side refused to trace it)
            rows.append(["-", chip, "not traced", _first_line(e)])
        rows += [r for r in compile_recorded(side, (chip,))]
    return rows


def counts(rows) -> dict[str, dict[str, int]]:
    """{chip: {outcome: kernels}} of ``compile_recorded``'s rows."""
    out: dict[str, dict[str, int]] = {}
    for _, chip, outcome, _ in rows:
        out.setdefault(chip, dict.fromkeys(OUTCOMES, 0))[outcome] += 1
    return out
