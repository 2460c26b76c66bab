"""A call planned once, with its seeds and coefficients in a persistent buffer: what a CUDA graph needs.

An ordinary op builds its launch plan and uploads seeds, coefficients and table on every call (a
pinned buffer made, copied and freed).  Captured in a CUDA graph, that upload is baked in: every
replay perturbs with the seed of the capture.  :class:`Prepared` builds the plan and stages it once;
:meth:`Prepared.apply` only launches kernels that read the staged buffers, and
:meth:`Prepared.set_members` rewrites the seeds and coefficients in place, outside the graph.  So one
captured perturb → forward → restore graph serves every member::

    p = ops.Prepared(items)                  # one member; items as for perturb_many_
    p.set_members([seed0], [sigma])
    with torch.cuda.graph(g):
        p.apply(); out.copy_(model(x)); store.restore()
    for seed in seeds:
        p.set_members([seed], [sigma]); g.replay()   # member `seed`, bit for bit the eager perturb

The same object runs eagerly on every backend (the CPU dry run of the GPU check uses it that way).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from espert.noise import NoiseFamily

from .backends import member_slots, write_members
from .checks import check_members
from .core import _check_items
from .plan import build_steps


class Prepared:
    """``w <- round(w + Σ_n c_n · ε(seeds[n], key, index))`` for a fixed list of tensors and a fixed
    number of members, planned and staged once.

    items: ``(w, key, block)`` as for :func:`espert.ops.es_update_many_` (checked once, here); the
    tensors must keep their storage while the object is used (:meth:`apply` refuses a moved one).
    members: N >= 1.  noise, scales, backend: as for the ops.  Nothing runs until :meth:`apply`;
    :meth:`set_members` must come first."""

    def __init__(
        self,
        items,
        members: int = 1,
        *,
        noise: str = "gaussian",
        scales: Sequence[float] | None = None,
        backend: str | None = None,
    ):
        if not isinstance(members, int) or isinstance(members, bool) or members < 1:
            raise ValueError(f"members must be an int >= 1, got {members!r}")
        fam = NoiseFamily.parse(noise)
        checked, bits, be, device = _check_items(items, fam, members, scales, backend)
        self.members, self.device, self.backend = members, device, be
        self._tensors = [w for w, _, _, _ in checked]
        self._addresses = [w.data_ptr() for w in self._tensors]
        self._steps = build_steps(checked, fam, members, bits, device, be.unit_groups and be.unit_groups())
        zeros_s, zeros_c = np.zeros(members, np.uint64), np.zeros(members, np.float32)
        self._staged = be.stage(device, self._steps, zeros_s, zeros_c) if self._steps else None
        self._host = member_slots(members)
        if device.type == "cuda":  # a pinned image: the copy into the staged buffer does not sync the stream
            self._pinned = torch.from_numpy(self._host).pin_memory()
            self._host = self._pinned.numpy()
            self._copied = torch.cuda.Event()
        self._ready = False

    def set_members(self, seeds: Sequence[int], coeffs: Sequence[float]) -> None:
        """Rewrite the staged seeds (N ints in [0, 2^64)) and coefficients (N finite floats, rounded to
        float32), in stream order on a GPU.  Not inside a graph capture: the graph reads the buffer."""
        seed_arr, coeff32 = check_members(seeds, coeffs)
        if len(seed_arr) != self.members:
            raise ValueError(f"this Prepared has {self.members} member(s); got {len(seed_arr)} seeds")
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("set_members is called between replays, not inside a CUDA graph capture")
            self._copied.synchronize()  # the previous copy has read the pinned image
            write_members(self._host, seed_arr, coeff32)
            if self._staged is not None:
                with torch.cuda.device(self.device):
                    self._staged.members.copy_(self._pinned, non_blocking=True)
                    self._copied.record()
        elif self._staged is not None:
            write_members(self._host, seed_arr, coeff32)
            self._staged.members.copy_(torch.from_numpy(self._host))
        self._ready = True

    def apply(self) -> None:
        """Launch the kernels over the staged plan: no allocation, no host-to-device copy (capturable)."""
        if not self._ready:
            raise RuntimeError("set_members before apply: the staged members are not set")
        moved = [k for k, (w, a) in enumerate(zip(self._tensors, self._addresses)) if w.data_ptr() != a]
        if moved:
            raise RuntimeError(f"items{moved} moved to new storage since this Prepared was built; build a new one")
        if self._staged is not None:
            self.backend.launch(self.device, self._steps, self._staged)
            torch.autograd.graph.increment_version(self._tensors)
