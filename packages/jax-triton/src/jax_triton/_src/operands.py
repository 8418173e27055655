"""From ``triton_call``'s arguments to the kernel's operands.

One binding rule serves both call forms:

- positional arguments bind to the kernel's parameters in order (as
  ``inspect.Signature.bind_partial`` would); a keyword argument naming a
  non-constexpr parameter binds to it; every other keyword is a metaparam;
- the outputs bind to the non-constexpr parameters left without an argument,
  in parameter order, so an output may sit between inputs; parameters left
  over after that take their declared defaults.

The forms differ in aliasing only. With ``out_type=`` (the published
jax-triton's current API) an output aliased to an input is not bound to a
parameter (the kernel writes through the input's pointer), and
``input_output_aliases`` counts the non-constexpr operands in parameter order,
scalars included. With ``out_shape=`` (jax-triton 0.4) every output is bound,
and the indices count the array inputs. Inside, aliases use JAX's convention:
index among the primitive's array operands.

A ``jax.new_ref`` Ref argument is read, passed as an input aliased to an extra
output that is not bound to a parameter, and written back after the call: the
kernel updates it in place, as upstream's Ref arguments do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jax_triton._src import arguments
from jax_triton._src.signature import Operand, has_default, is_array

_Ref = getattr(jax, "Ref", None)


def is_ref(x) -> bool:
    return _Ref is not None and isinstance(x, _Ref)


@dataclasses.dataclass(frozen=True)
class Operands:
    """The result of ``resolve``: what ``triton_call`` binds and launches."""

    params: dict[str, Operand]  # by kernel parameter name, in parameter order
    metaparams: dict[str, Any]
    arrays: list  # the array inputs (Refs read), in parameter order
    in_avals: tuple
    out_avals: tuple  # the user's outputs, then one per Ref
    aliases: dict[int, int]  # array input -> output
    refs: list  # (Ref, output index) to write back after the call
    scalars: tuple  # (key, value): key is the positional index or the keyword


def _signature_text(fn) -> str:
    names = list(fn.arg_names)
    return f"kernel {fn.__name__!r} has {len(names)} parameters {names}"


def resolve(fn, args, kwargs, out_avals, aliases, legacy: bool, where: str) -> Operands:
    """Binds ``triton_call(*args, **kwargs)`` to ``fn``'s parameters.

    ``legacy``: the call gave ``out_shape=`` (jax-triton 0.4 aliasing).
    """
    names = list(fn.arg_names)
    constexpr = {n for n, p in zip(names, fn.params) if p.is_constexpr}
    given, metaparams = _arguments(fn, names, constexpr, args, kwargs, where)
    params, arrays, in_avals, refs, scalars = _inputs(given, names, where)
    aliases = _aliases(aliases, params, names, constexpr, in_avals, out_avals, legacy, where)
    if refs and aliases:
        raise ValueError(
            f"{where}: input_output_aliases cannot be combined with jax.new_ref Ref "
            f"arguments: a Ref is already updated in place; pass the aliased inputs as Refs"
        )
    params = _bind_outputs(fn, params, names, constexpr, aliases, out_avals, legacy, where)
    out_avals = tuple(out_avals)
    for _, i in refs:
        aliases[i] = len(out_avals)
        out_avals += (in_avals[i],)
    return Operands(params, metaparams, arrays, tuple(in_avals), out_avals, aliases, refs, tuple(scalars))


def _arguments(fn, names, constexpr, args, kwargs, where) -> tuple[dict, dict]:
    """({parameter name: (what, positional index or keyword, value)} of the
    non-constexpr arguments, {name: value} of the metaparams): constexpr values
    given positionally and the declared constexpr defaults are metaparams too."""
    if len(args) > len(names):
        raise TypeError(
            f"{where}: {_signature_text(fn)}, but triton_call got {len(args)} positional arguments"
        )
    given = {names[i]: (f"argument {i}", i, a) for i, a in enumerate(args)}
    metaparams = {}
    for k, v in kwargs.items():
        if k in given:
            raise TypeError(
                f"{where}: {_signature_text(fn)}; parameter {k!r} got {given[k][0]} and the keyword {k}="
            )
        if k in names and k not in constexpr:
            given[k] = (f"keyword argument {k!r}", k, v)
        else:
            metaparams[k] = v

    for i, a in enumerate(args):  # a value for a constexpr is a metaparam: grid callables see it
        if names[i] in constexpr and not (is_ref(a) or is_array(a)):
            metaparams[names[i]] = given.pop(names[i])[2]
    for n in names:  # so are the declared constexpr defaults
        if n in constexpr and n not in given and n not in metaparams and has_default(fn, n):
            metaparams[n] = fn.signature.parameters[n].default
    return given, metaparams


def _inputs(given, names, where):
    """(params, arrays, in_avals, refs, scalars) of the given arguments, in
    parameter order: arrays and Refs (read) are inputs, scalars and None values."""
    params, arrays, in_avals, refs, scalars = {}, [], [], [], []
    for name in names:
        if name not in given:
            continue
        what, key, value = given[name]
        label = what if isinstance(key, str) else f"{what} ({name!r})"
        if is_ref(value) or is_array(value):
            read = value[...] if is_ref(value) else value
            if is_ref(value):
                refs.append((value, len(arrays)))
            params[name] = Operand(label, "input", len(arrays))
            in_avals.append(arguments.input_aval(read, f"{where}: {what}"))
            arrays.append(read)
        elif value is None or isinstance(value, (bool, int, float, np.generic)):
            params[name] = Operand(label, "value", value=value)
            if value is not None:
                scalars.append((key, value))
        else:
            raise TypeError(
                f"{where}: {what} is {type(value).__name__} ({value!r:.60}); triton_call takes "
                f"arrays and Python/numpy scalars (and jax.new_ref Refs), not pytrees or other objects"
            )
    return params, arrays, in_avals, refs, scalars


def _bind_outputs(fn, params, names, constexpr, aliases, out_avals, legacy, where) -> dict[str, Operand]:
    """``params`` with the outputs bound to the non-constexpr parameters left
    without an argument, in parameter order (aliased ones not, but with
    ``out_shape=``), reordered as the parameters."""
    aliased_outputs = set(aliases.values()) if not legacy else set()
    outputs = [o for o in range(len(out_avals)) if o not in aliased_outputs]
    missing = [n for n in names if n not in constexpr and n not in params]
    out_kw = "out_shape" if legacy else "out_type"
    unaliased = "" if legacy else "unaliased "
    leftover = [n for n in missing[len(outputs) :] if not has_default(fn, n)]
    if len(outputs) > len(missing) or leftover:
        hint = ""
        if legacy and aliases:
            hint = (
                "; with out_shape= (jax-triton 0.4) aliased outputs are bound to "
                "parameters too, with out_type= they are not"
            )
        left = f", leaving {leftover} without a value" if leftover else ""
        raise TypeError(
            f"{where}: {out_kw} has {len(outputs)} {unaliased}outputs, but "
            f"{len(missing)} kernel parameters are missing an argument {missing}{left} "
            f"({_signature_text(fn)}; outputs are bound to the non-constexpr "
            f"parameters that get no argument, in order){hint}"
        )
    for name, o in zip(missing, outputs):
        params[name] = Operand(f"output {o} ({name!r})", "output", o)
    return {n: params[n] for n in names if n in params}


def _aliases(aliases, params, names, constexpr, in_avals, out_avals, legacy, where) -> dict[int, int]:
    """``input_output_aliases`` checked and turned into array input -> output."""
    aliases = {} if aliases is None else aliases
    if legacy:
        inputs = [(f"input {i}", a) for i, a in enumerate(in_avals)]
        counted = f"there are {len(inputs)} array inputs (scalars are not counted)"
    else:
        operands = [
            n for n in names
            if n in params and n not in constexpr and (params[n].kind == "input" or params[n].value is not None)
        ]  # fmt: skip
        inputs = [
            (f"operand {i} ({n!r})", in_avals[params[n].index] if params[n].kind == "input" else None)
            for i, n in enumerate(operands)
        ]
        counted = f"indices count the non-constexpr operands in parameter order, {operands}"
    checked = arguments.check_aliases(aliases, inputs, out_avals, counted, where)
    if legacy:
        return checked
    operands_index = [params[n].index for n in operands]
    return {operands_index[i]: o for i, o in checked.items()}
