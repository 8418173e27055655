"""What a block rule may know of a chip: ``Facts``, one per generation."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Facts:
    """The facts of a TPU generation that block and VMEM choices are made from. Figures are
    per TensorCore, as ``pltpu.get_tpu_info()`` gives them; ``num_cores`` is the device's (2 on
    a megacore v4 or v5p device, 1 where each core is a device), the rest are the chip's."""

    name: str  # "v5e": ``str(TpuInfo.chip_version)``
    generation: int
    cores_per_chip: int  # physical TensorCores
    vmem_bytes: int
    mxu_shape: tuple[int, int]  # (rows, columns) of one MXU
    mxus_per_core: int
    sublanes: int
    hbm_bytes_per_second: int
    bf16_flops: int  # per second
    int8_ops: int  # per second; 0: the MXU has no int8 path
    # A TensorCore's instruction memory in bundles (VLIW words): a kernel larger than this is
    # split by libtpu into overlays fetched from HBM as it runs. None: not measured.
    instruction_bundles: int | None = None
    num_cores: int = 1  # TensorCores per device: set from the device (``policy.facts``)

    @property
    def mxu_columns(self) -> int:
        return self.mxu_shape[1]

    @classmethod
    def of(cls, info) -> Facts:
        """The facts a ``TpuInfo`` holds (no instruction memory: it does not say)."""
        return cls(
            name=str(info.chip_version), generation=info.generation, num_cores=info.num_cores,
            cores_per_chip=info.chip_version.num_physical_tensor_cores_per_chip,
            vmem_bytes=info.vmem_capacity_bytes, mxu_shape=(info.mxu_column_size,) * 2,
            mxus_per_core=info.num_mxus, sublanes=info.num_sublanes, hbm_bytes_per_second=info.mem_bw_bytes_per_second,
            bf16_flops=info.bf16_ops_per_second, int8_ops=info.int8_ops_per_second,
        )  # fmt: skip
