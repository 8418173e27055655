"""TPU v4: two TensorCores a chip (one megacore device by default), 16 MiB of VMEM, four
128 x 128 MXUs, no int8 MXU path. No chip to measure on: the families' rules choose."""

from pallas_tpu.ops._policy.facts import Facts

FACTS = Facts(
    name="v4", generation=4, cores_per_chip=2, vmem_bytes=16 << 20, mxu_shape=(128, 128),
    mxus_per_core=4, sublanes=8, hbm_bytes_per_second=int(615e9), bf16_flops=int(137.5e12), int8_ops=0)  # fmt: skip

BLOCKS: dict[str, dict] = {}
