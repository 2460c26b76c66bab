"""Batched low-rank members: a lowrank:r population served as vLLM LoRA adapters, in one ``generate``.

With ``noise: lowrank:r`` a member's perturbation of a logical [R, C] matrix is exactly rank r
(docs/noise.md §5.2): ``sign·σ·s_t·ε = (σ·s_t·A') @ (sign·Bᵀ)``, a LoRA adapter with ``lora_b = σ·s_t·A'``
(vLLM's [out, rank]) and ``lora_a = sign·Bᵀ`` ([rank, in]).  So every member of a chunk becomes one of K
pinned adapter slots (:class:`LoraSlots`), whose stacked buffers the worker fills from the seeds with
espert's staging kernel (:func:`espert.ops.lowrank_stage`), and all their prompts go into one multi-LoRA
``generate`` (``members: batched``); the base weights stay at the center.  Each slice of a fused layer gets
its piece's logical factors; what no LoRA layer carries (norms, biases, embeddings, ``lm_head``) is left out
of the center (:func:`lora_targets`), so the update moves exactly what the rewards saw, as in EGGROLL.
Rewards differ from an in-place evaluation only in rounding (docs/vllm.md, "Batched members").
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from espert.ops import perturb_
from espert.params import ParamView
from espert.vllm.patches.lora_cpu import USED_RANK

#: First adapter id of espert's slots (ids are vLLM's ``lora_int_id``; anything > 0 works).
SLOT_ID_BASE = 1


class LoraLayoutError(ValueError):
    """A selected parameter cannot be carried by a vLLM LoRA slot in the way espert maps it."""


@dataclass(frozen=True)
class Target:
    """Where one center view lives in vLLM's LoRA buffers: ``layer.lora_{a,b}_stacked[slice]``, its rows
    starting at ``row`` of that slice's output (``rows`` of them) and all the slice's input columns."""

    view: int  # index into the center's views
    layer: torch.nn.Module
    slice: int
    row: int
    rows: int
    cols: int


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """vLLM's LoRA-wrapped linear layers (they have per-slice ``output_slices`` and a ``base_layer``)."""
    from vllm.lora.layers import BaseLayerWithLoRA

    out = []
    for m in model.modules():
        if isinstance(m, BaseLayerWithLoRA) and hasattr(m, "output_slices") and hasattr(m, "lora_a_stacked"):
            w = getattr(m.base_layer, "weight", None)
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                out.append(m)
    return out


def lora_targets(model: torch.nn.Module, views: Sequence[ParamView]) -> tuple[list[Target], list[int]]:
    """Match every view to the LoRA slice holding it: ``(targets, uncovered)``, one Target per coverable view
    and the indices of the views no LoRA layer carries.  A view is covered when it is a 2-D block of a LoRA
    layer's base weight spanning whole rows, inside one output slice, of a logical parameter with more than
    one row (lowrank's 1-row tensors take the Gaussian); LoraLayoutError for any other share of its storage."""
    by_storage = {m.base_layer.weight.untyped_storage().data_ptr(): m for m in _lora_layers(model)}
    targets, uncovered = [], []
    for i, v in enumerate(views):
        t = v.tensor
        layer = by_storage.get(t.untyped_storage().data_ptr()) if t.dim() == 2 else None
        logical_rows = t.shape[0] if v.block is None or v.block.logical_rows is None else v.block.logical_rows
        if layer is None or logical_rows < 2:
            uncovered.append(i)
            continue
        w = layer.base_layer.weight
        start = (t.data_ptr() - w.data_ptr()) // (w.stride(0) * w.element_size())
        if t.shape[1] != w.shape[1] or t.stride() != w.stride():
            raise LoraLayoutError(f"{v.name}: covers part of the rows of {type(layer).__name__}'s weight")
        edge = 0
        for s, size in enumerate(layer.output_slices):
            if edge <= start < edge + size:
                if start + t.shape[0] > edge + size:
                    raise LoraLayoutError(f"{v.name}: rows {start}..{start + t.shape[0]} cross a LoRA slice edge")
                targets.append(Target(i, layer, s, start - edge, t.shape[0], t.shape[1]))
                break
            edge += size
        else:
            raise LoraLayoutError(f"{v.name}: rows from {start} are outside the LoRA slices {layer.output_slices}")
    return targets, uncovered


def _block_geometry(v: ParamView) -> tuple[int, int, int]:
    """(row_offset, col_offset, logical_cols) of a view inside its logical parameter."""
    b = v.block
    if b is None:
        return 0, 0, int(v.tensor.shape[1])
    cols = v.tensor.shape[1] if b.logical_cols is None else b.logical_cols
    return int(b.row_offset), int(b.col_offset), int(cols)


class LoraSlots:
    """K pinned vLLM LoRA slots that espert fills with members' factors (see the module docstring).  views: the
    selected ParamViews, of which ``views`` keeps those a LoRA slot carries (the center's in this mode) and
    ``unmoved`` names the others (ValueError when none is carried); rank: the noise's r."""

    def __init__(self, model: torch.nn.Module, views, rank: int):
        self.rank = int(rank)
        targets, uncovered = lora_targets(model, views)
        if not targets:
            raise ValueError("members: batched: no selected parameter is carried by a LoRA layer")
        self.unmoved = [views[i].name for i in uncovered]
        self.views = [views[t.view] for t in targets]
        self.targets = [dataclasses.replace(t, view=i) for i, t in enumerate(targets)]  # indices into self.views
        self.ids: list[int] = []
        self.count = 0

    def pin(self, worker_lora, count: int | None = None) -> None:
        """Register ``count`` (default: all, ``max_loras``) zero adapters with the worker's LoRA manager (an
        ``LRUCacheWorkerLoRAManager``) and pin them in their slots; ``ids[k]`` is then the ``lora_int_id`` of
        slot k (generate with it).  Call it after the engine's own forward passes (es_setup's self-test),
        which drop every adapter."""
        from vllm.lora.request import LoRARequest

        am = worker_lora._adapter_manager
        count = int(count or am.lora_slots)
        if not 1 <= count <= am.lora_slots:
            raise ValueError(f"{count} slots asked, the engine has {am.lora_slots} (max_loras)")
        self.count, self.ids = count, [SLOT_ID_BASE + k for k in range(count)]
        for i in self.ids:
            if i not in worker_lora.list_adapters():
                worker_lora.add_dummy_lora(LoRARequest(f"espert-slot-{i}", i, "espert-slot"), self.rank)
            worker_lora.pin_adapter(i)  # activates it in a slot and keeps it there
        self.index = [am.lora_index_to_id.index(i) for i in self.ids]  # slot index in the stacked buffers
        for layer in {id(t.layer): t.layer for t in self.targets}.values():
            for k in self.index:
                layer.reset_lora(k)  # zero the whole slot: rank columns >= r stay zero
        if self.count == am.lora_slots:  # every slot is espert's: the CPU ops may skip the zero columns
            for t in self.targets:
                for buf in (t.layer.lora_a_stacked[t.slice], t.layer.lora_b_stacked[t.slice]):
                    USED_RANK[id(buf)] = (weakref.ref(buf), self.rank)

    def fill(
        self, members: Sequence[tuple[int, int]], sigma: float, scales: Sequence[float] | None = None
    ) -> list[int]:
        """Write the factors of ``members`` [(seed, sign)] into the first len(members) slots; returns
        their adapter ids.  Slot k then adds ``sign_k·σ·s_t·ε(seed_k)`` (up to rounding) to every target;
        scales: the σ multipliers s_t of :attr:`views` (the center's ``sigma_scales``; None: all 1)."""
        n = len(members)
        if not 1 <= n <= self.count:
            raise ValueError(f"{n} members for {self.count} LoRA slots")
        from espert.ops import lowrank_stage
        from espert.ops.backends import default_backend

        seeds = np.array([int(s) for s, _ in members], dtype=np.uint64)
        r = self.rank
        for t in self.targets:
            v = self.views[t.view]
            row_off, col_off, logical_cols = _block_geometry(v)
            a_buf, b_buf = t.layer.lora_a_stacked[t.slice], t.layer.lora_b_stacked[t.slice]
            stage, _, _ = lowrank_stage(
                v.key, t.rows, t.cols, row_off, col_off, logical_cols, seeds, r, a_buf.device, default_backend(a_buf)
            )
            a_prime = stage[: n * t.rows * r].view(n, t.rows, r)  # A' = fl(K_r·A), float32
            b_t = stage[n * t.rows * r :].view(n, r, t.cols)  # Bᵀ, float32
            s = float(sigma) * (1.0 if scales is None else float(scales[t.view]))
            for m, (_, sign) in enumerate(members):
                k = self.index[m]
                b_buf[k, 0, t.row : t.row + t.rows, :r].copy_(a_prime[m] * s)
                a_buf[k, 0, :r, : t.cols].copy_(b_t[m] if sign > 0 else -b_t[m])
        return self.ids[:n]

    def delta(self, k: int, target: Target) -> torch.Tensor:
        """The weight change slot k adds to ``target``'s rows: lora_b @ lora_a in float64 ([rows, cols]); tests."""
        a = target.layer.lora_a_stacked[target.slice][self.index[k], 0].to(torch.float64)
        b = target.layer.lora_b_stacked[target.slice][self.index[k], 0, target.row : target.row + target.rows]
        return b.to(torch.float64) @ a[:, : target.cols]


def slot_error(slots: LoraSlots, seed: int, sign: int, sigma: float, scales=None) -> dict[str, float]:
    """Fill slot 0 with member (seed, sign) (``scales`` as :meth:`LoraSlots.fill`) and compare, per target, the
    weight change the slot adds (lora_b @ lora_a, float64) with the in-place perturbation of the same member.
    Returns ``{logical name: max |difference| / max |in-place|}`` for this rank's pieces (about 1e-7)."""
    slots.fill([(seed, sign)], sigma, scales)
    out = {}
    for t in slots.targets:
        v = slots.views[t.view]
        s = float(sigma) * (1.0 if scales is None else float(scales[t.view]))
        ref = torch.zeros(v.tensor.shape, dtype=torch.float32, device=v.tensor.device)
        perturb_(ref, int(seed), v.key, s, int(sign), block=v.block, noise=f"lowrank:{slots.rank}")
        got = slots.delta(0, t)
        scale = float(ref.abs().max()) or 1.0
        out[v.name] = float((got - ref.to(torch.float64)).abs().max()) / scale
    return out
