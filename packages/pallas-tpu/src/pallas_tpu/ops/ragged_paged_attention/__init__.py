"""Ragged paged attention, mixed prefill and decode (the names of JAX's
``ops.tpu.ragged_paged_attention``): ``ragged_paged_attention``, its plain-JAX reference
``ref_ragged_paged_attention``, the input checks, and ``get_tuned_block_sizes``. ``v3``: the
entry point vLLM's TPU backend calls, which writes the new tokens' K/V into the cache too."""

from pallas_tpu.ops.ragged_paged_attention import kernel as kernel
from pallas_tpu.ops.ragged_paged_attention import tuned_block_sizes as tuned_block_sizes
from pallas_tpu.ops.ragged_paged_attention import v3 as v3

dynamic_validate_inputs = kernel.dynamic_validate_inputs
ragged_paged_attention = kernel.ragged_paged_attention
ref_ragged_paged_attention = kernel.ref_ragged_paged_attention
static_validate_inputs = kernel.static_validate_inputs
get_tuned_block_sizes = tuned_block_sizes.get_tuned_block_sizes
