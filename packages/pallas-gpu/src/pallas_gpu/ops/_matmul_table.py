"""``pallas_gpu.ops.matmul``'s configuration per shape, measured on an NVIDIA H200.

``matmul`` takes the row nearest its shape (same input class, distance summed over
log2 of m, n and k) on a first call instead of timing every candidate. Each row is
the autotuner's pick (every candidate of ``configs_for``, outputs checked, interleaved
25 ms batches) from ``python benchmarks/matmul_table.py --measure FILE`` on the H200
(jax 0.11.2, Triton 3.6.0, 2026-12-04), with the pick's TFLOP/s in that run; rerun it
and paste the rows here when the candidates change (``tests/gpu/test_matmul_table.py``
fails when a row names a config that no candidate has).
"""

from __future__ import annotations

# (input class, m, n, k, the pick's label, its TFLOP/s in the tuning run)
ROWS: tuple[tuple[str, int, int, int, str, float], ...] = (
    ("16-bit", 512, 512, 512, "256x128x64/8w/3s/tma/persistent", 7),
    ("16-bit", 1024, 1024, 1024, "128x256x64/8w/3s/ptr/grid", 47),
    ("16-bit", 2048, 2048, 2048, "256x128x64/8w/3s/tma/persistent", 517),
    ("16-bit", 4096, 4096, 4096, "sm90-pingpong/128x128x64/5buf", 645),
    ("16-bit", 8192, 8192, 8192, "sm90-pingpong/128x128x64/5buf", 659),
    ("16-bit", 2048, 2048, 1024, "128x128x64/4w/4s/tma/grid", 176),
    ("16-bit", 4096, 4096, 1024, "sm90-coop/128x256x64/3buf", 603),
    ("16-bit", 8192, 8192, 1024, "sm90-pingpong/128x128x64/5buf", 653),
    ("16-bit", 16384, 16384, 1024, "sm90-pingpong/128x128x64/5buf", 661),
    ("16-bit", 256, 8192, 8192, "sm90-pingpong/128x128x64/5buf", 608),
    ("16-bit", 1024, 8192, 8192, "sm90-pingpong/128x128x64/5buf", 657),
    ("16-bit", 8192, 1024, 8192, "sm90-pingpong/128x128x64/5buf", 643),
    ("16-bit", 1024, 1024, 16384, "sm90-pingpong/128x128x64/5buf", 402),
    ("16-bit", 2048, 2048, 8192, "sm90-coop/128x256x64/3buf", 640),
    ("fp8", 2048, 2048, 2048, "128x256x64/8w/4s/ptr/flat-persistent", 373),
    ("fp8", 4096, 4096, 4096, "128x256x128/8w/3s/ptr/grid", 1030),
    ("fp8", 8192, 8192, 8192, "128x256x128/8w/3s/ptr/grid", 1158),
    ("fp8", 8192, 8192, 1024, "128x256x128/8w/3s/ptr/grid", 735),
    ("fp8", 1024, 8192, 8192, "128x256x128/8w/3s/ptr/grid", 867),
)
