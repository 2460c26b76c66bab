"""A worker's center whose edits also mark the edited prepacked layers stale (vLLM-CPU).

The prepack patch (:mod:`espert.vllm.patches.cpu_prepack`) keeps each Linear's plain weight beside
vLLM's packed copy and repacks a layer marked stale at its next forward.  :class:`RepackingCenter` is the
center the worker extension holds: every method that changes the live weights marks the layers whose
plain weight shares storage with a selected view, and packs the edited experts of a mixture of experts again.
On GPU there are no packed layers and it only forwards.
"""

from __future__ import annotations

import time

import torch

from espert.quant.formats import marlin_bias_order
from espert.update import Update
from espert.vllm.patches.cpu_prepack import packed_layers
from espert.vllm.patches.moe_prepack import expert_plain, repack_experts


class RepackingCenter:
    """A ``CenterStore`` or :class:`~espert.vllm.engine.w8a8.W8A8Center` (``inner``) plus the staleness
    of the packed layers its views live in.  ``repack_seconds`` / ``repacks`` add up the repack cost
    (W8A8 layers count their own rebuilds)."""

    def __init__(self, inner, model: torch.nn.Module):
        self.inner = inner
        storages = {
            v.tensor.untyped_storage().data_ptr() for v in inner.views if getattr(v, "qv", None) is None
        }  # W8A8 views repack themselves (espert/vllm/engine/w8a8.py)
        self.lazy = [m.cpu_linear for _, m in packed_layers(model) if m.weight.untyped_storage().data_ptr() in storages]
        # experts are packed again at once, not at the next forward: their kernel reads the packed tensor directly
        self.experts = [
            p
            for p in model.parameters()
            if (plain := expert_plain(p.data)) is not None and plain.untyped_storage().data_ptr() in storages
        ]
        self.expert_seconds, self.expert_repacks = 0.0, 0
        # int4 biases on Marlin: the views edit a logical-order copy (espert.vllm.engine.params.marlin_bias)
        self.biases = [
            m
            for m in model.modules()
            if getattr(m, "_espert_bias", None) is not None and m._espert_bias.untyped_storage().data_ptr() in storages
        ]

    def __getattr__(self, name: str):
        """What changes no live weight is the inner center's: ``views``, ``centers``, ``nbytes``, ``sigma_scales``,
        ``state_views``, ``state_dict``, ``export_state``, and ``scale`` (the center only; the live weights
        change at the update's restore)."""
        if name == "inner":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def repack_seconds(self) -> float:
        return sum(z.seconds for z in self.lazy) + self.expert_seconds + getattr(self.inner, "repack_seconds", 0.0)

    @property
    def repacks(self) -> int:
        return sum(z.repacks for z in self.lazy) + self.expert_repacks + getattr(self.inner, "repacks", 0)

    # -- edits: each marks the packed copies stale, also when it raised half way -------------------
    def _stale(self) -> None:
        for z in self.lazy:
            z.stale = True
        for m in self.biases:
            m.bias.data.view(-1, 4, 4, 2).copy_(marlin_bias_order(m._espert_bias))
        t0 = time.perf_counter()
        for p in self.experts:
            repack_experts(p.data)
        self.expert_seconds += time.perf_counter() - t0
        self.expert_repacks += len(self.experts)

    def restore(self) -> None:
        try:
            self.inner.restore()
        finally:
            self._stale()

    def perturb(self, seed: int, sigma: float, sign: int = 1, backend: str | None = None) -> None:
        try:
            self.inner.perturb(seed, sigma, sign, backend=backend)
        finally:
            self._stale()

    def update(self, step: Update) -> None:
        try:
            self.inner.update(step)
        finally:
            self._stale()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        try:
            self.inner.load_state_dict(state)
        finally:
            self._stale()
