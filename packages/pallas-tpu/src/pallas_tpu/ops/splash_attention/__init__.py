"""Splash attention (sparse flash attention over static masks) for TPUs, with the module
names and call signatures of JAX's ``ops.tpu.splash_attention``: moving over is the import
change to ``pallas_tpu.ops.splash_attention``.

    mask = MultiHeadMask([CausalMask((q_len, kv_len))] * heads)
    kernel = make_splash_mha_single_device(mask)
    out = jax.vmap(kernel)(q, k, v)  # q: [batch, heads, q_len, head_dim]
"""

from pallas_tpu.ops.splash_attention.splash_attention_kernel import BlockSizes as BlockSizes
from pallas_tpu.ops.splash_attention.splash_attention_kernel import QKVLayout as QKVLayout
from pallas_tpu.ops.splash_attention.splash_attention_kernel import SegmentIds as SegmentIds
from pallas_tpu.ops.splash_attention.splash_attention_kernel import (
    SplashAttentionKernel as SplashAttentionKernel,
)
from pallas_tpu.ops.splash_attention.splash_attention_kernel import (
    make_masked_mha_reference as make_masked_mha_reference,
)
from pallas_tpu.ops.splash_attention.splash_attention_kernel import (
    make_masked_mqa_reference as make_masked_mqa_reference,
)
from pallas_tpu.ops.splash_attention.splash_attention_kernel import make_splash_mha as make_splash_mha
from pallas_tpu.ops.splash_attention.splash_attention_kernel import (
    make_splash_mha_single_device as make_splash_mha_single_device,
)
from pallas_tpu.ops.splash_attention.splash_attention_kernel import make_splash_mqa as make_splash_mqa
from pallas_tpu.ops.splash_attention.splash_attention_kernel import (
    make_splash_mqa_single_device as make_splash_mqa_single_device,
)
from pallas_tpu.ops.splash_attention.splash_attention_mask import CausalMask as CausalMask
from pallas_tpu.ops.splash_attention.splash_attention_mask import ChunkedCausalMask as ChunkedCausalMask
from pallas_tpu.ops.splash_attention.splash_attention_mask import FullMask as FullMask
from pallas_tpu.ops.splash_attention.splash_attention_mask import LocalMask as LocalMask
from pallas_tpu.ops.splash_attention.splash_attention_mask import Mask as Mask
from pallas_tpu.ops.splash_attention.splash_attention_mask import MultiHeadMask as MultiHeadMask
from pallas_tpu.ops.splash_attention.splash_attention_mask import NumpyMask as NumpyMask
from pallas_tpu.ops.splash_attention.splash_attention_mask import make_causal_mask as make_causal_mask
from pallas_tpu.ops.splash_attention.splash_attention_mask import (
    make_local_attention_mask as make_local_attention_mask,
)
from pallas_tpu.ops.splash_attention.splash_attention_mask import make_random_mask as make_random_mask
