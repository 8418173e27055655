"""How much VMEM each family's blocks may plan for, and the scoped limit its kernels ask.

One formula for every family, with each family's numbers side by side in ``VMEM`` (a
generation file may override an entry in its own ``VMEM``):

* the **budget**, what the blocks a rule picks may take: ``fraction`` of the chip's VMEM, at
  most ``most`` bytes. The rest is Mosaic's (its temporaries: a dot's result before it is
  added, masks, relayouts) and the pipeline's.
* the **limit**, the ``vmem_limit_bytes`` a kernel whose blocks hold ``needed`` bytes asks for:
  ``headroom * needed + extra``, at least ``floor`` (the scoped default of a larger chip, so a
  small kernel is never squeezed), at most ``CEILING`` of the chip's VMEM.
"""

from __future__ import annotations

import dataclasses

# Of the chip's VMEM, the most a kernel's limit may ask: libtpu keeps the rest.
CEILING = 0.9


@dataclasses.dataclass(frozen=True)
class VmemPolicy:
    """A family's VMEM policy (the module's docstring says how each number is used)."""

    fraction: float
    most: int | None = None
    headroom: float = 1.5
    extra: int = 4 << 20
    floor: int = 32 << 20

    def budget(self, vmem_bytes: int) -> int:
        """Bytes the blocks may take on a chip of ``vmem_bytes`` of VMEM."""
        budget = vmem_bytes * self.fraction
        return int(budget if self.most is None else min(budget, self.most))

    def limit(self, needed: int, vmem_bytes: int) -> int:
        """The ``vmem_limit_bytes`` for blocks of ``needed`` bytes."""
        return int(min(vmem_bytes * CEILING, max(self.floor, self.headroom * needed + self.extra)))


# family -> its policy. The numbers are the ones each family's kernels were measured with.
VMEM: dict[str, VmemPolicy] = {
    # Double-buffered panels and output; the f32 accumulator. Mosaic's temporaries of a
    # 1024 x 1024 dot need the rest.
    "matmul": VmemPolicy(0.6),
    "megablox": VmemPolicy(0.6),
    # The four block slots of K and V pages (and their scales); the limit leaves room for the
    # score tiles of a block beside them.
    "paged_attention": VmemPolicy(0.25, headroom=2, extra=8 << 20),
    # One KV block of every head's K and V (two slots of it in VMEM): 2 MiB, what covers the
    # HBM's latency on a v5e, less on a small VMEM. The limit: the two slots, the query
    # block's rows and one head's score tiles.
    "ragged_paged_attention": VmemPolicy(1 / 16, most=2 << 20, extra=8 << 20),
    # The shard and the gathered output, held whole.
    "all_gather": VmemPolicy(0.75, headroom=1, extra=8 << 20, floor=16 << 20),
    # One output block (the hash runs in register-sized strips): 2 MiB, less on a small VMEM.
    "random": VmemPolicy(1 / 32, most=2 << 20),
    # Flash and splash attention: the budget their block rules start from, also their limit.
    "attention": VmemPolicy(0.75, most=100 << 20),
}
