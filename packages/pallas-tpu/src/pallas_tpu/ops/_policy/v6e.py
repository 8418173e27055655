"""TPU v6e ("TPU v6 lite", Trillium): one TensorCore a chip, 128 MiB of VMEM, two 256 x 256
MXUs. No chip to measure on: the families' rules choose."""

from pallas_tpu.ops._policy.facts import Facts

FACTS = Facts(
    name="v6e", generation=6, cores_per_chip=1, vmem_bytes=128 << 20, mxu_shape=(256, 256),
    mxus_per_core=2, sublanes=8, hbm_bytes_per_second=int(1640e9), bf16_flops=int(920e12), int8_ops=int(1840e12))  # fmt: skip

BLOCKS: dict[str, dict] = {}
