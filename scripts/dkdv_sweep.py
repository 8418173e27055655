"""The silently wrong dK a flash-attention backward gave on the H200, looked for over shapes: the dK/dV kernel of
``tests/gpu/test_attention_bwd_dkdv.py`` (GQA, one program per KV tile, a ``fori_loop``
over query blocks, unrolled query heads, chained ``pallas_call``s accumulating through
``input_output_aliases``) compiled for the GPU at each head dim, block sizes, group
size, warps and stages below, with IEEE f32 dots, against ``jax.vjp`` of a jnp f32
attention. Prints one line per configuration (relative errors of dK and dV) and exits
1 if any exceeds 1e-4.

    python scripts/dkdv_sweep.py [--interpret]   # on the GPU machine, after installing

Run on the H200 on 2026-12-04 (jax 0.11.2, Triton 3.6.0; the first 12 configurations
before the session's device time ran out): every one wrong, dK 0.68-0.76 and dV
0.64-0.73 relative error, the error of losing one of the two chained calls'
contributions. The test file's own shape (two batches, 128 keys) is right there.

``--xla-variants`` runs the first configuration again in fresh processes under XLA
flags that turn off what may sit between our FFI call and the GPU. Run on the H200 on
2026-12-05 (before the fix): wrong by default (dK 0.71, dV 0.69) and without command
buffers; right (3.3e-7) without dynamic-slice fusion, with two distinct zero arrays as
dK0/dV0, dispatched call by call, and with two batches; wrong with one batch and 128
keys. The cause: XLA's dynamic-slice fusion of the contiguous slices of a batch of one
into the custom call, with one value passed as two aliased operands (see
``tests/gpu/test_aliased_operands.py``); jax-kernel-runtime now keeps aliased launches
out of it.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS / "gpu"), str(TESTS)]  # the GPU suite, and tests/ways it imports

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import test_attention_bwd_dkdv as t  # noqa: E402
from jax import lax  # noqa: E402

VARIANTS = {  # label: (XLA flag, DKDV_MODE for the child)
    "default": ("", ""),
    "no command buffers": ("--xla_gpu_enable_command_buffer=", ""),
    "no dynamic slice fusion": ("--xla_gpu_enable_dynamic_slice_fusion=false", ""),
    "dK0/dV0 two distinct zero arrays": ("", "given"),
    "every call dispatched alone (disable_jit)": ("", "eager"),
    "two batches, 256 keys": ("", "b2"),
    "one batch, 128 keys": ("", "skv128"),
}


def variants() -> int:
    import subprocess

    dump = os.environ.get("OUT")
    for label, (flag, mode) in VARIANTS.items():
        flags = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        if dump and label == "default":  # the optimized HLO of the wrong case comes back
            flags += f" --xla_dump_to={dump}/hlo --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
        env = dict(os.environ, XLA_FLAGS=flags, DKDV_FIRST="1", DKDV_MODE=mode)
        out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
        lines = [
            ln for ln in out.stdout.splitlines() if ln.startswith(("ok", "BAD"))
        ] or out.stderr.splitlines()[-3:]
        print(f"{label} ({flag or 'no flag'}): {' | '.join(lines)}", flush=True)
    return 0


def main() -> int:
    if "--xla-variants" in sys.argv:
        return variants()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    interpret = "--interpret" in sys.argv  # Triton's interpreter on the CPU: a check of this script
    bad = 0
    configs = list(
        itertools.product((64, 128), ((16, 64), (32, 64), (64, 64), (64, 128)), (1, 4), ((4, 1), (8, 2)))
    )
    if os.environ.get("DKDV_FIRST"):
        configs = configs[:1]
    if interpret:
        import pallas_gpu as plgpu

        interpret, configs = plgpu.InterpretParams(), configs[:2]
    for d, (bq, bkv), group, (warps, stages) in configs:
        t.D, t.BLOCK_Q, t.BLOCK_KV, t.HKV = d, bq, bkv, 2
        t.HQ, t.GROUP, t.SCALE = 2 * group, group, d**-0.5
        t.SQ, t.SKV, t.CHUNK, t.B = 256, 256, 128, 1
        mode = os.environ.get("DKDV_MODE", "")
        if mode == "b2":
            t.B = 2
        elif mode == "skv128":
            t.SKV = 128
        args, (dk_ref, dv_ref) = t.problem()
        if mode == "given":
            args = (*args, jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
        try:
            with jax.disable_jit(mode == "eager"):
                dk, dv = t.dkdv(
                    *args,
                    interpret=interpret,
                    precision=lax.Precision.HIGHEST,
                    num_warps=warps,
                    num_stages=stages,
                )
            errs = t.rel_err(dk, dk_ref), t.rel_err(dv, dv_ref)
            ok = max(errs) < 1e-4
            msg = f"dK {errs[0]:.2e} dV {errs[1]:.2e}"
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses is reported, not fatal
            ok, msg = True, f"not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        bad += not ok
        print(
            f"{'ok ' if ok else 'BAD'} D={d} block_q={bq} block_kv={bkv} group={group} warps={warps} stages={stages}: {msg}"
        )
    print(f"{bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
