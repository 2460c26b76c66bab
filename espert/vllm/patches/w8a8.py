"""W8A8 int8 layers on vLLM-CPU keep their exact codes (:mod:`espert.vllm.engine.w8a8` edits them).

``CPUInt8ScaledMMLinearKernel.process_weights_after_loading`` (``CPUScaledMMLinearKernel`` before vLLM 0.15) prepacks every W8A8 Linear into a private
oneDNN (or, with AMX, SGL) copy and drops the plain codes.  The wrapper below stashes the int8 codes
(``layer._espert_codes``, [N, K] host) and forces the oneDNN path, the one that can be rebuilt from
(codes, scales); a variant espert cannot edit loads unchanged and gets ``layer._espert_w8a8_error``.
"""

from __future__ import annotations

import torch

from espert.vllm.patches import for_release, releases, wrap_once

try:  # vLLM >= 0.17 (this module is imported by espert.vllm.patches.install only, inside vLLM's processes)
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel as Kernel
except ImportError:
    try:  # 0.15, 0.16
        from vllm.model_executor.layers.quantization.kernels.scaled_mm.cpu import (
            CPUInt8ScaledMMLinearKernel as Kernel,
        )
    except ImportError:  # 0.11 to 0.14
        from vllm.model_executor.layers.quantization.kernels.scaled_mm.cpu import CPUScaledMMLinearKernel as Kernel


def _unsupported(kernel: Kernel) -> str | None:
    c = kernel.config
    if not c.input_symmetric:
        return "asymmetric activations (input zero points / azp_adj)"
    if not c.is_channelwise:
        return "per-tensor weight scales (vLLM rescales fused shards at load)"
    return None


@releases("0.15")
def _param_names(kernel: Kernel) -> tuple[str, ...]:
    """The layer's attribute names of (weight, weight scale, input scale, input zero point, azp adjustment)."""
    return tuple(kernel.layer_param_names)


@releases("0.11", "0.14")
def _param_names_0_11(kernel: Kernel) -> tuple[str, ...]:
    """:func:`_param_names` on vLLM 0.11 to 0.14, whose kernel keeps them one attribute each."""
    return (kernel.w_q_name, kernel.w_s_name, kernel.i_s_name, kernel.i_zp_name, kernel.azp_adj_name)


def _capture(original, kernel: Kernel, layer: torch.nn.Module) -> None:
    """Stash the exact int8 codes and the layer's parameter names, then prepack on the oneDNN path (rebuildable)."""
    names = for_release(_param_names, _param_names_0_11)(kernel)
    weight = getattr(layer, names[0])
    why = _unsupported(kernel)
    if why is None and (weight is None or weight.dtype != torch.int8 or weight.dim() != 2 or weight.is_meta):
        why = f"weight is {None if weight is None else (weight.dtype, tuple(weight.shape))}, not int8 [N, K]"
    if why is not None:
        layer._espert_w8a8_error = why
        original(kernel, layer)
        return
    layer._espert_codes = weight.detach().to("cpu").contiguous().clone()
    layer._espert_param_names = names
    kernel.linear_method = kernel._apply_weights_onednn  # force the path we can rebuild (not SGL/AMX)
    kernel.process_weights_for_onednn(layer)
    layer._espert_kernel = kernel


def install() -> bool:
    """Wrap ``CPUInt8ScaledMMLinearKernel.process_weights_after_loading`` (idempotent; before the model loads)."""
    wrap_once(Kernel, "process_weights_after_loading", _capture)
    return True
