"""vLLM-CPU prepacks a mixture of experts' weights; espert keeps the plain weights and packs them again after edits.

At load, vLLM-CPU's grouped-GEMM experts (``fused_moe/experts/cpu_moe.py``, 0.28 on) replace ``w13_weight`` and
``w2_weight`` by ``cpu_prepack_moe_weight(weight, isa)``: the same shape, its elements permuted into the
kernel's blocks, so an edit by logical index would land on the wrong weights.  The wrapper below lets vLLM's
prepack run unchanged and keeps the plain weight it was packed from, which :mod:`espert.vllm.engine.params`
maps (:func:`expert_plain`); after every edit :class:`~espert.vllm.engine.repack.RepackingCenter` packs it
into the packed tensor again, in place, with vLLM's own function (:func:`repack_experts`), at once: the expert
kernel reads the packed parameter itself.  Cost: one more copy of the expert weights and a repack per edited
expert tensor per weight change.  On GPU vLLM never packs experts and the patch is inert.
"""

from __future__ import annotations

import logging

import torch

from espert.vllm.patches import wrap_once
from espert.vllm.patches.cpu_prepack import pack_threads

log = logging.getLogger("espert.vllm")

#: A prepacked expert weight (by its address) -> (the plain weight it was packed from, the ISA, vLLM's prepack).
_PLAIN: dict[int, tuple] = {}


def _prepack(original, weight: torch.Tensor, isa: str) -> torch.Tensor:
    packed = original(weight, isa)
    _PLAIN[packed.data_ptr()] = (weight.detach(), isa, original)
    return packed


def expert_plain(packed: torch.Tensor) -> torch.Tensor | None:
    """The plain weight a prepacked expert tensor was packed from (None: it is not prepacked, as on GPU)."""
    got = _PLAIN.get(packed.data_ptr())
    return got[0] if got is not None and got[0].shape == packed.shape else None


def repack_experts(packed: torch.Tensor) -> None:
    """Pack the plain weight of ``packed`` into it again, in place (after an edit of the plain weight)."""
    plain, isa, prepack = _PLAIN[packed.data_ptr()]
    with pack_threads():
        packed.copy_(prepack(plain, isa))


def install() -> bool:
    """Wrap vLLM-CPU's ``cpu_moe.cpu_prepack_moe_weight`` (idempotent); False where vLLM has no CPU experts."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:  # a GPU build without the CPU experts: nothing is packed
        return False
    if wrap_once(cpu_moe, "cpu_prepack_moe_weight", _prepack):
        log.info("espert: vLLM-CPU prepacked expert weights keep their plain copy and are packed again after edits")
    return True
