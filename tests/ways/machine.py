"""The machine the ways run on: ``ON_CHIP`` on a TPU (the lent v5e: scripts/tpu_check.sh), where
the compiled way is the chip engine (``chip.py``); anywhere else (CI) the CPU.

On a TPU, test data and jnp references are made on the host's CPU, as in CI: XLA on the TPU
flushes subnormals and canonicalizes NaN payloads (a bit-exact reference made there is not
the one the test means), and its default matmul precision is bf16. Kernels go to the chip
explicitly (``chip.to_chip``)."""

from __future__ import annotations

import jax

ON_CHIP = jax.default_backend() == "tpu"
if ON_CHIP:
    jax.config.update("jax_default_device", jax.devices("cpu")[0])
