"""TPU v5e ("TPU v5 lite"): one TensorCore a chip, 128 MiB of VMEM, four 128 x 128 MXUs. The chip
the measured rows come from (``benchmarks/tpu_ops_*.py`` on one v5e chip)."""

from pallas_tpu.ops._policy.facts import Facts

FACTS = Facts(
    name="v5e", generation=5, cores_per_chip=1, vmem_bytes=128 << 20, mxu_shape=(128, 128),
    mxus_per_core=4, sublanes=8, hbm_bytes_per_second=int(820e9), bf16_flops=int(197e12),
    int8_ops=int(394e12),
    # libtpu's overlay split (``compile_check``'s code size): a kernel of ~56k bundles fits.
    instruction_bundles=56_000,
)  # fmt: skip

# op -> {key: blocks}, measured on the chip.
BLOCKS: dict[str, dict] = {
    # key: the input itemsize; blocks: (bm, bn, bk). A (bm, bn) tile does bm*bn/(bm+bn) flops per
    # loaded bf16 byte: 512 for 1024 x 1024 tiles, twice the chip's 240 (197 TFLOP/s over 820
    # GB/s), so HBM stays ahead of the MXU; a k step of 1024 keeps the accumulator's VMEM round
    # trip and the per-step cost small beside 2 GFLOP of work (libtpu's LLO for v5e: the fewest
    # loads, stores and packs per MXU push of the candidates). The working set (double-buffered
    # panels and output, f32 accumulator) is 16 MiB of the 128. 187.8 TFLOP/s at 8192^3 bf16
    # (docs/tpu_ops.md); benchmarks/tpu_ops_matmul.py --sweep times the alternatives.
    "matmul": {
        1: (1024, 1024, 1024),  # int8, fp8
        2: (1024, 1024, 1024),  # bf16
        4: (512, 1024, 512),  # f32 (the MXU's multi-pass f32 is compute bound sooner)
    },
}
