"""Counter-based PRNGs as Pallas TPU kernels, with the module names and call
signatures of JAX's ``ops.tpu.random``: ``threefry`` (Threefry-2x32, the bits
of ``jax.random``'s default generator), ``philox`` (Philox-4x32-10) and the
helpers both use (``prng_utils``). Each generator module also defines a
``jax.random`` implementation (``threefry.plthreefry_prng_impl``,
``philox.plphilox_prng_impl``) for ``jax.random.key(seed, impl=...)``.

Import the modules themselves (``from pallas_tpu.ops.random import threefry``).
"""
