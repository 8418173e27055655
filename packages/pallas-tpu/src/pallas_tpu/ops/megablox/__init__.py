"""Grouped matmuls for mixture-of-experts layers, with the module names of JAX's
``ops.tpu.megablox``: ``megablox.gmm`` is the
differentiable grouped matmul (``ops.gmm``); the kernels ``gmm`` and ``tgmm``
are in ``megablox.gmm`` (whose docstring says how they work and lists the family's modules)."""

from pallas_tpu.ops.megablox.ops import gmm as gmm
