"""W8A8 int8 layers on vLLM-CPU keep their exact codes (:mod:`espert.vllm.engine.w8a8` edits them).

``CPUInt8ScaledMMLinearKernel.process_weights_after_loading`` prepacks every W8A8 Linear into a private
oneDNN (or, with AMX, SGL) copy and drops the plain codes.  The wrapper below stashes the int8 codes
(``layer._espert_codes``, [N, K] host) and forces the oneDNN path, the one that can be rebuilt from
(codes, scales); a variant espert cannot edit loads unchanged and gets ``layer._espert_w8a8_error``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from espert.vllm.patches import wrap_once

if TYPE_CHECKING:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as Kernel


def _unsupported(kernel: Kernel) -> str | None:
    c = kernel.config
    if not c.input_symmetric:
        return "asymmetric activations (input zero points / azp_adj)"
    if not c.is_channelwise:
        return "per-tensor weight scales (vLLM rescales fused shards at load)"
    return None


def _capture(original, kernel: Kernel, layer: torch.nn.Module) -> None:
    """Stash the exact int8 codes, then prepack on the oneDNN path (rebuildable)."""
    w_q = kernel.layer_param_names[0]
    weight = getattr(layer, w_q)
    why = _unsupported(kernel)
    if why is None and (weight is None or weight.dtype != torch.int8 or weight.dim() != 2 or weight.is_meta):
        why = f"weight is {None if weight is None else (weight.dtype, tuple(weight.shape))}, not int8 [N, K]"
    if why is not None:
        layer._espert_w8a8_error = why
        original(kernel, layer)
        return
    layer._espert_codes = weight.detach().to("cpu").contiguous().clone()
    kernel.linear_method = kernel._apply_weights_onednn  # force the path we can rebuild (not SGL/AMX)
    kernel.process_weights_for_onednn(layer)
    layer._espert_kernel = kernel


def install() -> bool:
    """Wrap ``CPUInt8ScaledMMLinearKernel.process_weights_after_loading`` (idempotent; before the model loads)."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as K
    except ImportError:  # pragma: no cover - vllm missing or another version
        return False
    wrap_once(K, "process_weights_after_loading", _capture)
    return True
