"""Ready-made Pallas kernels for GPUs, each with the API of its namesake
among JAX's Pallas GPU ops (the ``ops/gpu`` modules of JAX's Pallas):
``attention`` (``mha``), ``layer_norm``, ``rms_norm`` and ``softmax``.
"""
