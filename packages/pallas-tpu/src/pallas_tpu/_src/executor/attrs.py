"""Reading an op's attributes and operands for ``run_mosaic``'s rules, through
jaxlib's MLIR bindings. Two kinds of attribute have builders in jaxlib but no
readers (no Python attribute class), and only those are read from their text:
a dialect's enum attribute (``enum_attr``) and ``tpu.matmul``'s dimension
numbers (``dot_dimension_numbers``)."""

from __future__ import annotations

import re

from pallas_tpu._src.executor.errors import MosaicError, where


def array_attr(op, name) -> list[int]:
    """An integer attribute as a list, read through the MLIR bindings: a dense
    array (``array<i64: 1, 2>``, any width), an array of integers (``[1 : i32]``),
    dense integer elements, or one integer (``1 : i32`` gives ``[1]``); ``[]``
    when the op does not have it."""
    from jaxlib.mlir import ir

    if name not in op.attributes:
        return []
    a = op.attributes[name]  # the bindings give the attribute's own class
    dense = (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr, ir.DenseI16ArrayAttr, ir.DenseI8ArrayAttr)
    if isinstance(a, (*dense, ir.DenseIntElementsAttr)):
        return [int(x) for x in a]  # type: ignore[union-attr]  # the stubs omit DenseIntElementsAttr.__iter__
    if isinstance(a, ir.ArrayAttr):
        return [int(ir.IntegerAttr(x).value) for x in a]
    if isinstance(a, ir.IntegerAttr):
        return [int(a.value)]
    raise MosaicError(f"run_mosaic: {where(op)}: attribute {name} = {a} is not an integer or integer array")


def int_attr(op, name) -> int:
    """An integer attribute (``dim = 1 : i32``)."""
    from jaxlib.mlir import ir

    return ir.IntegerAttr(op.attributes[name]).value


def bool_attr(op, name) -> bool:
    """A bool attribute (``add = true``); ``False`` when the op does not have it."""
    from jaxlib.mlir import ir

    return name in op.attributes and ir.BoolAttr(op.attributes[name]).value


def type_attr(op, name):
    """A type attribute (``target_type = bf16``) as an ``ir.Type``."""
    from jaxlib.mlir import ir

    return ir.TypeAttr(op.attributes[name]).value


def symbol_attr(op, name) -> str:
    """A flat symbol reference (``callee = @f``) as its name."""
    from jaxlib.mlir import ir

    return ir.FlatSymbolRefAttr(op.attributes[name]).value


def enum_attr(attr) -> str:
    """The case of a dialect's enum attribute: ``#tpu.memory_space<vmem>`` gives
    ``vmem``, ``#vector.kind<add>`` ``add``. jaxlib's bindings build these
    attributes (the generated ``register_attribute_builder`` functions of
    ``_tpu_enum_gen``) but have no Python class to read one back, so this and
    ``dot_dimension_numbers`` are the places where run_mosaic reads an
    attribute's text."""
    s = str(attr)
    m = re.search(r"<(\w+)>$", s)
    return m.group(1) if m else s


def dot_dimension_numbers(attr) -> list[list[int]]:
    """``tpu.matmul``'s ``#tpu.dot_dimension_numbers<[1], [0], [0], [1], [0, 0,
    1, 1], [], []>`` as its seven lists (lhs and rhs contracting dims, lhs and
    rhs non-contracting dims, the output's (operand, dim) pairs, lhs and rhs
    batch dims). jaxlib's Mosaic bindings build this attribute (the
    ``TPU_DotDimensionNumbersAttr`` builder of ``tpu.MatmulOp``) but have no
    Python class to read its fields back, so its text is read."""
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\[([^\]]*)\]", str(attr))]


def operand(op, env, name):
    """The value of the op's operand ``name`` (an optional one: ``None``)."""
    v = getattr(op, name)
    return None if v is None else env[v]


def operands(op, env, name):
    """The values of the op's variadic operand ``name``."""
    return [env[v] for v in getattr(op, name)]
