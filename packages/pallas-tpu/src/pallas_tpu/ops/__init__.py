"""TPU kernels written with pallas-tpu, with the module names and call signatures of
JAX's Pallas TPU ops (its experimental ``pallas.ops.tpu``): moving over is the import
change of that package to ``pallas_tpu.ops``. Each family is its own
module (``from pallas_tpu.ops import flash_attention``), imported on first use."""
