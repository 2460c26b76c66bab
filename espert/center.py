"""The center store: where the exact center θ lives.

Why a host-side center.  Restoring a bf16/fp16 weight by subtracting regenerated
noise cannot be exact (several centers round to the same perturbed value: about
4.6% of bf16 elements at σ=1e-3 on N(0, 0.02) weights), and small updates vanish
when added to bf16 weights.  Both problems need information beyond the live
weights.  We keep it in host memory, never on the device:

- ``restore()`` copies the center back into the live weights (round to nearest
  even, ≤ 64 MiB converted at a time), so it is exact after any number of cycles
  and the device holds nothing beyond the weights;
- ``update()`` applies the fused ES update to the center itself, by default a
  float32 master (4 bytes per parameter of host memory), then restores.  With
  ``master_dtype=None`` the center is kept in the weights' own dtype (2 bytes per
  bf16 parameter): still exact restores, but naive bf16 update fidelity.

The center is also what checkpoints save and replays rebuild.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from espert import ops
from espert.params import ParamView


def check_state(state: dict[str, torch.Tensor], views: Sequence, centers: Sequence[torch.Tensor]) -> None:
    """Raise unless ``state`` has a tensor of the same shape and dtype as each center, by view name."""
    for v, c in zip(views, centers):
        if v.name not in state:
            raise KeyError(f"checkpoint has no center for {v.name}")
        s = state[v.name]
        if s.shape != c.shape or s.dtype != c.dtype:
            raise ValueError(f"center {v.name}: checkpoint has {s.dtype}{tuple(s.shape)}, "
                             f"expected {c.dtype}{tuple(c.shape)}")


class CenterStore:
    """Exact centers of a list of ParamViews, in host memory.

    views: the live weights (any device).  master_dtype: torch.float32 (default, faithful
    updates) or None (the weights' dtype).  pin: page-lock the host copies (faster GPU restores).
    """

    def __init__(self, views: Sequence[ParamView], master_dtype: torch.dtype | None = torch.float32,
                 pin: bool = False):
        if master_dtype not in (None, torch.float32):
            raise ValueError(f"master_dtype must be torch.float32 or None, got {master_dtype}")
        names = [v.name for v in views]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate logical parameter names: {dup[:5]}")
        self.views = list(views)
        self.centers: list[torch.Tensor] = []
        for v in self.views:
            c = torch.empty(v.tensor.shape, dtype=master_dtype or v.tensor.dtype, device="cpu",
                            pin_memory=pin and torch.cuda.is_available())
            c.copy_(v.tensor)
            self.centers.append(c)

    @property
    def nbytes(self) -> int:
        """Host memory held by the centers, in bytes."""
        return sum(c.numel() * c.element_size() for c in self.centers)

    def restore(self) -> None:
        """Write the exact center back into every live weight."""
        for v, c in zip(self.views, self.centers):
            ops.restore_(v.tensor, c)

    def perturb(self, seed: int, sigma: float, sign: int = 1, backend: str | None = None) -> None:
        """Live weights <- center + sign·σ·ε(seed), in place (from the restored state)."""
        for v in self.views:
            ops.perturb_(v.tensor, seed, v.key, sigma, sign, block=v.block, backend=backend)

    def update(self, seeds: Sequence[int], coeffs: Sequence[float]) -> None:
        """center <- center + Σ_n coeffs[n]·ε(seeds[n]) with the fused op, then restore the live weights.

        Arguments are validated once up front, so an error leaves centers and weights untouched.
        """
        ops.check_members(seeds, coeffs)
        for v, c in zip(self.views, self.centers):
            ops.es_update_(c, seeds, coeffs, v.key, block=v.block)
        self.restore()

    def scale(self, factor: float) -> None:
        """center <- factor · center (float32 elementwise on the host, deterministic), weights not restored.

        Used for weight decay (factor = 1 − α·wd) right before :meth:`update`, which restores.
        """
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"scale factor must be a finite number > 0, got {factor!r}")
        for c in self.centers:
            c.mul_(float(factor))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Logical name -> center tensor (host).  Blocks of one logical parameter are saved by view name."""
        return {v.name: c for v, c in zip(self.views, self.centers)}

    def export_state(self) -> dict[str, torch.Tensor]:
        """The center as checkpoint values by logical name: here the same tensors as :meth:`state_dict`."""
        return self.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the centers (exactly) and restore the live weights.  Checks names, shapes and dtypes first."""
        check_state(state, self.views, self.centers)
        for v, c in zip(self.views, self.centers):
            c.copy_(state[v.name])
        self.restore()
