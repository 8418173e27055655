"""TPU v4: two TensorCores a chip (one megacore device by default), 16 MiB of VMEM, four
128 x 128 MXUs, no int8 MXU path. No chip to measure on: the families' rules choose, but where
``pltpu.estimate`` found better."""

from pallas_tpu.ops._policy.facts import Facts

FACTS = Facts(
    name="v4", generation=4, cores_per_chip=2, vmem_bytes=16 << 20, mxu_shape=(128, 128),
    mxus_per_core=4, sublanes=8, hbm_bytes_per_second=int(615e9), bf16_flops=int(137.5e12), int8_ops=0)  # fmt: skip

BLOCKS: dict[str, dict] = {}

# Rows chosen by pltpu.estimate for this generation, not measured (benchmarks/tpu_estimate_blocks.py,
# results/tpu_estimate_blocks.txt: libtpu's compile for a v4, its bundles simulated).
ESTIMATED: dict[str, dict] = {
    # bf16: 1137 / 2195 us at 4096^3 / 2048x8192x8192; the rule's (512, 512, 256) 1582 / 3082 us
    # (1.40x): 1024 short steps of 1.7 us whose DMAs are not hidden (HBM 64 %, MXU 57 % busy); the
    # pick's MXU is 95 % busy. (512, 1024, 512) ties.
    "matmul": {2: (1024, 512, 512)},
}
