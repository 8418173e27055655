"""Grouped matmuls for mixture-of-experts layers, with the module names of JAX's
``ops.tpu.megablox``: ``megablox.gmm`` is the
differentiable grouped matmul (``ops.gmm``); the kernels ``gmm`` and ``tgmm``
are in ``megablox.gmm``, their visit schedule in ``megablox.schedule``."""

from pallas_tpu.ops.megablox.ops import gmm as gmm
