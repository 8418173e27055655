"""Block and VMEM policy of ``pallas_tpu.ops``: the one place each family asks what blocks to
use and how much VMEM to plan for on the chip its kernels are traced for.

* **Facts** (``facts()``): per TPU generation, a file of its own here (``v4.py``, ``v5e.py``,
  ``v5p.py``, ``v6e.py``) with the chip's ``FACTS``: VMEM, MXU shape, TensorCores, sublanes,
  HBM rate, peak rates, instruction memory. A generation without a file gets the figures of
  ``pltpu.get_tpu_info()`` (no instruction memory).
* **Measured blocks**: the same file's ``BLOCKS``, ``{op: {key: blocks}}``, rows measured on that
  chip (each checked by a libtpu compile for its generation: ``tests/tpu/test_ops_policy.py``).
* **Estimated blocks**: the file's ``ESTIMATED``, alike, for chips we cannot run: rows chosen by
  ``pltpu.estimate`` (libtpu's compile for that generation, its bundles simulated) over candidate
  blocks, by ``benchmarks/tpu_estimate_blocks.py``; a row is written only where the estimate's
  pick beats the family's rule by more than the estimate's error on the v5e (each compiled for
  its generation by the same test).
* **Rules**: where no row covers a call, the family's rule, a function of the facts and the
  key, in the family's ``_blocks`` module. ``choose(op, key, rule)`` asks in that order (measured,
  estimated, the rule), with the ``ESTIMATE`` hook before the rule.
* ``fit_block``: the one rule that fits a block to an axis it must divide.
* **VMEM** (``vmem.VMEM``): per family the budget its blocks may take and the scoped limit its
  kernels ask, one formula, every family's numbers side by side (``vmem_budget``,
  ``vmem_limit``); a generation file may override an entry in its own ``VMEM``.

A new chip, or a new measurement, is one file here with ``FACTS`` and ``BLOCKS`` (and ``VMEM``
overrides where the defaults do not suit); ``FACTS.name`` is ``str(TpuInfo.chip_version)`` (``"v5e"``,
``"7x"``), the file's name that with a ``tpu`` in front where it starts with a digit (``tpu7x.py``).
Every module here but ``facts`` and ``vmem`` is a generation file.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import types
from collections.abc import Callable
from typing import Any

import pallas_tpu as pltpu
from pallas_tpu.ops._policy.facts import Facts as Facts
from pallas_tpu.ops._policy.vmem import VMEM as VMEM
from pallas_tpu.ops._policy.vmem import VmemPolicy as VmemPolicy

LANES = 128

# A family's rule: ``rule(facts, key)`` -> its blocks.
Rule = Callable[[Facts, Any], Any]

# A hook for chips with no measured row: ``ESTIMATE(op, key, facts)`` returns blocks or None
# (None: the family's rule). Meant for pallas_tpu's cost estimate, to pick blocks for chips we
# cannot run; unset, the rules decide.
ESTIMATE: Callable[[str, Any, Facts], Any] | None = None


def _generation_files() -> dict[str, types.ModuleType]:
    """Every module here but ``facts`` and ``vmem``, by its chip's name (``FACTS.name``)."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("facts", "vmem"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            found[module.FACTS.name] = module
    return found


_FILES = _generation_files()
# The generations with a file here (found, not listed: a new chip is its file alone).
GENERATIONS = tuple(sorted(_FILES))


def _generation(name: str) -> types.ModuleType | None:
    """The generation file of chip ``name``, or None."""
    return _FILES.get(name)


@functools.cache
def _facts(info) -> Facts:
    module = _generation(str(info.chip_version))
    if module is None:
        return Facts.of(info)
    return dataclasses.replace(module.FACTS, num_cores=info.num_cores)


def facts(info=None) -> Facts:
    """The facts of the chip ``info`` (a ``TpuInfo``; default ``pltpu.get_tpu_info()``, the chip
    kernels are traced for), with its device's TensorCores. ``Facts`` are returned as they are,
    so every function here takes either."""
    if isinstance(info, Facts):
        return info
    return _facts(info or pltpu.get_tpu_info())


def generation_facts(chip: str) -> Facts:
    """The ``FACTS`` of the generation file of ``chip`` (one of ``GENERATIONS``)."""
    return _FILES[chip].FACTS


def measured(chip: str, op: str) -> dict:
    """The measured rows of ``op`` on generation ``chip``: ``{key: blocks}`` (empty: none)."""
    module = _generation(chip)
    return dict(module.BLOCKS.get(op, {})) if module is not None else {}


def estimated(chip: str, op: str) -> dict:
    """The rows of ``op`` that ``pltpu.estimate`` chose for generation ``chip`` (``ESTIMATED``)."""
    module = _generation(chip)
    return dict(getattr(module, "ESTIMATED", {}).get(op, {})) if module is not None else {}


def choose(op: str, key, rule: Rule, info=None) -> Any:
    """The blocks of ``op`` for ``key`` on the chip ``info`` (default: the one traced for): the
    generation's measured row for ``key``, else its estimated row, else ``ESTIMATE``'s answer,
    else ``rule(facts, key)``."""
    chip = facts(info)
    row = measured(chip.name, op).get(key)
    if row is None:
        row = estimated(chip.name, op).get(key)
    if row is not None:
        return row
    if ESTIMATE is not None and (guess := ESTIMATE(op, key, chip)) is not None:
        return guess
    return rule(chip, key)


def fit_block(dim: int | None, want: int, align: int = LANES, *, or_whole: bool = False) -> int | None:
    """The block for an axis of ``dim`` elements that must divide it: the whole axis when it is
    no longer than ``want``, else the largest multiple of ``align`` up to ``want`` dividing
    ``dim``. None divides: None (the caller pads), or ``dim`` itself with ``or_whole`` (a block
    as long as its axis is always a legal TPU block). ``dim`` None (unknown): ``want``."""
    if dim is None:
        return want
    if dim <= want:
        return dim
    for b in range(want - want % align, 0, -align):
        if dim % b == 0:
            return b
    return dim if or_whole else None


def vmem_policy(family: str, info=None) -> VmemPolicy:
    """``family``'s VMEM policy on the chip ``info``: its generation file's, else ``VMEM``'s."""
    module = _generation(facts(info).name)
    return getattr(module, "VMEM", {}).get(family) or VMEM[family]


def vmem_budget(family: str, info=None) -> int:
    """Bytes ``family``'s blocks may take on the chip ``info`` (default: the one traced for)."""
    return vmem_policy(family, info).budget(facts(info).vmem_bytes)


def vmem_limit(family: str, needed: int, info=None) -> int:
    """The ``vmem_limit_bytes`` of ``family``'s kernel whose blocks hold ``needed`` bytes."""
    return vmem_policy(family, info).limit(needed, facts(info).vmem_bytes)
