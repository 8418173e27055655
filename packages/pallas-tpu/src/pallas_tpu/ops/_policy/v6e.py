"""TPU v6e ("TPU v6 lite", Trillium): one TensorCore a chip, 128 MiB of VMEM, two 256 x 256
MXUs. No chip to measure on: the families' rules choose, but where ``pltpu.estimate`` found better."""

from pallas_tpu.ops._policy.facts import Facts

FACTS = Facts(
    name="v6e", generation=6, cores_per_chip=1, vmem_bytes=128 << 20, mxu_shape=(256, 256),
    mxus_per_core=2, sublanes=8, hbm_bytes_per_second=int(1640e9), bf16_flops=int(920e12), int8_ops=int(1840e12))  # fmt: skip

BLOCKS: dict[str, dict] = {}

# Rows chosen by pltpu.estimate for this generation, not measured (benchmarks/tpu_estimate_blocks.py,
# results/tpu_estimate_blocks.txt: libtpu's compile for a v6e, its bundles simulated; 4096^3 and
# 2048x8192x8192 bf16, each block the geometric mean of its times over the shape's best).
ESTIMATED: dict[str, dict] = {
    # bf16: 291 / 566 us; the rule's (2048, 2048, 512) 386 / 757 us (1.33x): its 2048-square tile
    # keeps the MXUs busy 40 % of a step (the rest stalled on results), the pick keeps HBM 91 % busy.
    # The next four candidates are estimated within 1.08x of it.
    "matmul": {2: (1024, 1024, 2048)},
}
