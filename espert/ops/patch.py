"""``restore="patch"``: undo a perturb by subtracting it, exactly (docs/architecture.md).

Subtracting regenerated noise does not restore bf16/fp16 (or float32) weights: rounding maps
several centers to one perturbed value.  A *recording* perturb (``perturb_many_(..., record=list)``)
therefore lists, as it writes, every element whose subtraction would not give back its bits: its
address and its old bits (csrc/apply.h ``PatchList``).  :func:`restore_patched_many_` then runs the
same call with the sign flipped and writes the list over the result.  The restore is exact by
construction, and it moves 16 bytes per listed element instead of the whole center.

A list that overflowed its capacity is incomplete: the restore refuses it (returns False, touching
nothing), and the caller copies the center back instead.
"""

from __future__ import annotations

import torch

# One record: the element's address, then its old bits | dtype code << 32 (int64 each).
RECORD_BYTES = 16


class PatchList:
    """Where a recording perturb lists the elements subtraction would not restore.

    capacity: records it can hold (int >= 0).  device: the weights' device.  ``records`` is int64
    [max(capacity, 1), 2]: in pinned host memory for CUDA weights (the kernels write it through the
    mapping, so it takes no device memory), else on ``device``.  ``count`` is int64 [1] on ``device``:
    every miss is counted, also those past capacity.
    """

    def __init__(self, capacity: int, device: str | torch.device = "cpu"):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"patch capacity must be an int >= 0, got {capacity!r}")
        self.device = torch.device(device)
        self.capacity = capacity
        on_gpu = self.device.type == "cuda"
        self.records = torch.zeros(
            (max(capacity, 1), 2), dtype=torch.int64, device="cpu" if on_gpu else self.device, pin_memory=on_gpu
        )
        self.count = torch.zeros(1, dtype=torch.int64, device=self.device)

    @property
    def nbytes(self) -> int:
        """Host (or device, for non-CUDA devices) memory the records take, in bytes."""
        return self.records.numel() * 8

    def clear(self) -> None:
        """Empty the list (before a recording perturb)."""
        self.count.zero_()

    def misses(self) -> int:
        """Elements the last recording perturb(s) listed or counted (reads the count: a synchronize on a GPU)."""
        return int(self.count.item())
