"""TPU v5p: two TensorCores a chip (one megacore device by default), 64 MiB of VMEM, four
128 x 128 MXUs. No chip to measure on: the families' rules choose."""

from pallas_tpu.ops._policy.facts import Facts

FACTS = Facts(
    name="v5p", generation=5, cores_per_chip=2, vmem_bytes=64 << 20, mxu_shape=(128, 128),
    mxus_per_core=4, sublanes=8, hbm_bytes_per_second=int(1230e9), bf16_flops=int(229.5e12), int8_ops=int(459e12))  # fmt: skip

BLOCKS: dict[str, dict] = {}

# pltpu.estimate (benchmarks/tpu_estimate_blocks.py) ranks matmul's rule, (1024, 1024, 512) for bf16,
# within 0.9 % of its best candidate on this generation (below the estimate's error): no estimated row.
ESTIMATED: dict[str, dict] = {}
