"""Kernels lowered here, bundled to run on a TPU whose JAX is older than ours
(``scripts/tpu_chip_run.py``; the lent TPU v5e has JAX 0.10.2 only).

Each kernel is a function of no arguments (its inputs are constants) exported for
platform ``tpu``; a bundle folder holds, per kernel ``STEM``:

- ``STEM.exported`` (our lowering) and, where JAX's lowering takes the same kernel source,
  ``STEM.jax.exported``: ``jax.export`` artifacts whose StableHLO is serialized for an
  older StableHLO (0.10.2 reads up to 1.17.0; 0.11.2 writes 1.18.0 by default);
- ``STEM.npz``: the reference outputs;
- ``STEM.json``: name, tolerances, the number of Mosaic kernels of each side, and the text
  (generic form) of each Mosaic module keyed by the SHA-256 of its bytecode: Mosaic
  bytecode of JAX 0.11.2's MLIR does not load in libtpu 0.0.42.1 ("unknown attribute
  code"), so the chip's JAX serializes each module again from its text.

One file per kernel, so pytest workers can write into one bundle at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import jax
import numpy as np
from jax._src import tpu_custom_call
from jax._src.lib import _jax

STABLEHLO = "1.15.0"
_texts: dict[str, str] = {}
_seen: dict[str, int] = {}  # kernels added per name: a test that runs several gets #2, #3...


def _install_recorder():
    """Keeps the text of every Mosaic module JAX's serializer is given (ours and JAX's
    lowerings both serialize through it)."""
    serialize = tpu_custom_call._lower_mosaic_module_to_asm
    if getattr(serialize, "_chip_bundle", False):
        return

    def recording(module, **kw):
        result = serialize(module, **kw)  # (bytecode, flags...): JAX 0.12 returns more flags
        text = module.operation.get_asm(enable_debug_info=False, print_generic_op_form=True)
        _texts[hashlib.sha256(result[0]).hexdigest()] = text
        return result

    recording._chip_bundle = True
    tpu_custom_call._lower_mosaic_module_to_asm = recording


def _bodies(mlir_text: str) -> list[str]:
    import base64

    return [
        hashlib.sha256(base64.b64decode(b)).hexdigest()
        for b in re.findall(r"custom_call_config\\22: \{\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", mlir_text)
    ]


def _export(fn, path: Path, context) -> tuple[int, dict[str, str]]:
    """Exports ``fn`` (no arguments) for TPU into ``path``; returns the number of its
    Mosaic kernels and their modules' texts."""
    _install_recorder()
    with context():
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])()
    text = exported.mlir_module()
    keys = _bodies(text)
    calls = text.count("@tpu_custom_call(")
    if len(keys) != calls:
        raise RuntimeError(f"{path.name}: found {len(keys)} Mosaic bodies in {calls} tpu_custom_calls")
    hlo = _jax.mlir.serialize_portable_artifact(text, STABLEHLO, False)
    path.write_bytes(dataclasses.replace(exported, mlir_module_serialized=hlo).serialize())
    return calls, {k: _texts[k] for k in keys}


def stem_of(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")[-60:]
    return f"{slug}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def add(folder, name, ours, refs, *, theirs=None, context=None, tolerance=3e-2, tolerance_vs_jax=1e-2):
    """Adds a kernel to the bundle in ``folder``: ``ours``/``theirs`` are functions of no
    arguments (our lowering's and JAX's of the same source; ``theirs`` may be None or fail
    to lower: the chip then runs ours alone), ``refs`` the reference outputs (flat),
    ``context`` a context manager factory entered while exporting (an abstract TPU mesh)."""
    import contextlib

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    context = context or contextlib.nullcontext
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] > 1:
        name = f"{name} #{_seen[name]}"
    stem = stem_of(name)
    calls, texts = _export(ours, folder / f"{stem}.exported", context)
    entry = {
        "name": name,
        "custom_calls": calls,
        "tolerance": tolerance,
        "tolerance_vs_jax": tolerance_vs_jax,
    }
    if theirs is not None:
        try:
            entry["jax_custom_calls"], jax_texts = _export(theirs, folder / f"{stem}.jax.exported", context)
            texts = {**texts, **jax_texts}
        except Exception as e:  # noqa: BLE001 - JAX's lowering refuses some kernels; ours runs alone
            entry["jax_refused"] = f"{type(e).__name__}: {str(e)[:300]}"
    entry["mosaic"] = texts
    # Floats as float32 (an .npz holds no bfloat16); integers and booleans as they are.
    leaves = [np.asarray(r) for r in jax.tree.leaves(refs)]
    leaves = [
        x.astype(np.float32) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x for x in leaves
    ]
    np.savez(folder / f"{stem}.npz", *leaves)
    (folder / f"{stem}.json").write_text(json.dumps(entry))
    return stem
