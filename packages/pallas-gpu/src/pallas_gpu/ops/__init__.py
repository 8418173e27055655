"""Ready-made Pallas kernels for GPUs, with the APIs of JAX's
``jax.experimental.pallas.ops.gpu`` modules (``pallas_gpu.ops.attention``).
"""
