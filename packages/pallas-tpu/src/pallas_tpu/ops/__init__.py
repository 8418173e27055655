"""TPU kernels written with pallas-tpu, with the module names and call signatures of
JAX's ``jax.experimental.pallas.ops.tpu``: moving over is the import change
``jax.experimental.pallas.ops.tpu`` -> ``pallas_tpu.ops``. Each family is its own
module (``from pallas_tpu.ops import flash_attention``), imported on first use."""
