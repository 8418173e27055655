"""The kernel frame: Triton function names made from any kernel name,
exceptions of lowering rules located at the user's line, and the one-way
imports of the lowering modules."""

from __future__ import annotations

import ast
import keyword
import pathlib

import jax
import jax.numpy as jnp
import pytest
from gpu_test_base import Runner, assert_close, lowered, random
from jax.extend.core import Primitive

import pallas as pl
import pallas_gpu as plgpu
from pallas_gpu._src.lowering import lowering

R = Runner()

NAMES = [
    "class",
    "None",
    "tl",
    "triton",
    "range",
    "_dot_operand",
    "my kernel",
    "ядро-核心",
    "x" * 300,
    "9lives",
    "",
]


def _add(name, call=R.call):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    return call(
        kernel,
        jax.ShapeDtypeStruct((100,), jnp.float32),
        grid=(2,),
        in_specs=[pl.BlockSpec((64,), lambda i: (i,))],
        out_specs=pl.BlockSpec((64,), lambda i: (i,)),
        name=name or None,
    )


@pytest.mark.parametrize("name", NAMES)
def test_any_kernel_name_generates_valid_code(name):
    x = random((100,), jnp.float32)
    assert_close(_add(name)(x), x + 1)
    lk = lowered(_add(name, call=pl.pallas_call), x)
    assert lk.name.isidentifier() and lk.name.isascii() and not keyword.iskeyword(lk.name)
    assert len(lk.name) <= 64 and lk.name not in ("tl", "triton", "range", "_dot_operand")


def test_kernel_name_in_messages_is_the_users():
    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.sort(x_ref[...])  # no Triton lowering

    f = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((16,), jnp.float32), name="my kernel", interpret=plgpu.InterpretParams()
    )
    with pytest.raises(NotImplementedError, match="kernel 'my kernel' at .*test_lowering_frame.py"):
        f(random((16,), jnp.float32))


# ---------------------------------------------------------------------------
# Exceptions raised inside a rule


class TwoArgError(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


boom_p = Primitive("boom")
boom_p.def_abstract_eval(lambda x, **_: x)
boom_p.def_impl(lambda x, **_: x)


@lowering.register_lowering(boom_p)
def _boom_rule(rc, x, *, exc):
    raise exc


def _boom_kernel(exc):
    def kernel(x_ref, o_ref):
        o_ref[...] = boom_p.bind(x_ref[...], exc=exc)  # the boom line

    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), interpret=plgpu.InterpretParams())


def test_rule_exception_keeps_type_and_cause_and_names_the_line():
    original = ValueError("the rule failed")
    with pytest.raises(ValueError) as info:
        _boom_kernel(original)(random((8,), jnp.float32))
    msg = str(info.value)
    assert "the rule failed" in msg and "primitive 'boom'" in msg and "boom" in msg
    assert "test_lowering_frame.py" in msg and "kernel 'kernel'" in msg
    assert info.value.__cause__ is original


def test_rule_exception_of_unusual_type_gets_a_note():
    original = TwoArgError("a", "b")
    with pytest.raises(TwoArgError) as info:
        _boom_kernel(original)(random((8,), jnp.float32))
    assert info.value is original
    assert any("test_lowering_frame.py" in n and "primitive 'boom'" in n for n in info.value.__notes__)


# ---------------------------------------------------------------------------
# Imports run one way: lowering.py <- rule modules <- kernel.py; the rules see the
# kernel frame through the KernelFrame protocol, never through kernel.py


SRC = pathlib.Path(lowering.__file__).parent
WING = "pallas_gpu._src.lowering"


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of the lowering wing imported anywhere in ``path`` (TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m[len(WING) + 1 :].split(".")[0] for m in found if m.startswith(WING + ".")}


def test_lowering_imports_run_one_way():
    rules = ["memory", "address", "control", "math", "shapes"]
    assert _imports(SRC / "lowering.py") <= {"lowering"}
    for r in rules:
        assert "kernel" not in _imports(SRC / f"{r}.py"), r
    assert set(rules) <= _imports(SRC / "kernel.py")


def test_kernel_lowering_is_a_kernel_frame():
    """What the rules read of the frame (``lowering.KernelFrame``), ``KernelLowering`` has."""
    from pallas_gpu._src.lowering.kernel import KernelLowering

    frame = KernelLowering(None, type("GM", (), {"kernel_name": "k"})(), "k")
    members = [n for n in lowering.KernelFrame.__annotations__] + [
        n for n, v in vars(lowering.KernelFrame).items() if callable(v) and not n.startswith("_")
    ]
    assert {"em", "lower_jaxpr", "tma_descriptor"} <= set(members)
    assert all(hasattr(frame, n) for n in members), [n for n in members if not hasattr(frame, n)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["class", "tl", "my kernel", "x" * 300])
def test_any_kernel_name_on_gpu(name):
    x = random((100,), jnp.float32)
    assert_close(jax.jit(_add(name, call=pl.pallas_call))(x), x + 1)
