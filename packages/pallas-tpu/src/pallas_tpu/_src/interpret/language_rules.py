"""The TPU interpreter's rules of the kernel language's primitives that need no
model of their own: ``pltpu.has_memory_space`` (the memory the Ref's cell is in),
``pltpu.touch`` (orders nothing here) and the core's hidden PRNG
(``pltpu.prng_seed``/``prng_random_bits``: a threefry key carried as hidden state,
one per core). The language defines the primitives and knows no interpreter;
the interpreter registers its rules for them here, as ``dma.py`` and ``mxu.py``
do for theirs (``pallas_call.py`` imports this module)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_tpu._src.interpret import rules
from pallas_tpu._src.language import core as tpu_core
from pallas_tpu._src.language import random as tpu_random
from pallas_tpu._src.language.memory_query import has_memory_space_p
from pallas_tpu._src.language.vector_annotations import touch_p

PRNG_STATE = "prng_key"  # the name of the hidden state in ctx.hidden.named


def _has_memory_space(interp, eqn, ref):
    # The cell the Ref views: a pl.ANY operand's is its HBM cell, a block's its VMEM buffer.
    placed = interp.cell_spaces[ref.cell] or tpu_core.VMEM
    return jnp.bool_(placed is eqn.params["memory_space"])


def _prng_seed(interp, eqn, *seeds):
    del eqn
    interp.hidden.named[PRNG_STATE] = tpu_random.state_from_seeds(seeds)
    return []


def _prng_random_bits(interp, eqn, *args):
    del args
    state = interp.hidden.named[PRNG_STATE]
    bits = tpu_random.bits_from_state(state, eqn.params["shape"])
    interp.hidden.named[PRNG_STATE] = state.at[2].add(np.uint32(1))
    return [lax.bitcast_convert_type(bits, jnp.int32)]


rules.STATE_RULES[has_memory_space_p] = _has_memory_space
rules.STATE_RULES[touch_p] = lambda interp, eqn, ref: []  # orders nothing in an interpreter
rules.STATE_RULES[tpu_random.prng_seed_p] = _prng_seed
rules.STATE_RULES[tpu_random.prng_random_bits_p] = _prng_random_bits
_initial_state = functools.partial(tpu_random.state_from_seeds, ())
rules.HIDDEN_STATE[tpu_random.prng_seed_p] = {PRNG_STATE: _initial_state}
rules.HIDDEN_STATE[tpu_random.prng_random_bits_p] = {PRNG_STATE: _initial_state}
