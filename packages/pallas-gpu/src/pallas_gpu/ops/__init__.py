"""Ready-made Pallas kernels for GPUs, each with the API of its namesake
among JAX's Pallas GPU ops (the ``ops/gpu`` modules of JAX's Pallas):
``attention`` (``mha``), ``decode_attention`` (``mqa``, ``gqa``),
``paged_attention``, ``layer_norm``, ``rms_norm`` and ``softmax``; ``attention_fp8`` (``mha_fp8``,
no JAX counterpart); and ``matmul``
(a table of H200-measured configurations or the autotuner, TMA; JAX's GPU ops have none).
"""
