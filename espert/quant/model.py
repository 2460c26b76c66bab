"""Quantized torch models: ``QuantLinear`` (dequantize on the fly), ``quantize_model`` and the views ES needs.

Correctness over speed: ``QuantLinear.forward`` dequantizes the whole weight per call with the
reference :func:`~espert.quant.formats.dequantize` and runs ``F.linear``.  The quantized storage
(``qweight``), ``scales`` and ``zeros`` are buffers; :func:`quant_param_views` names each weight by
its float checkpoint name (``<module>.weight``), so it gets the same noise key as in the float model.
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

import torch
import torch.nn.functional as F

from .center import QuantCenterStore, QuantParamView
from .formats import FORMATS, QuantWeight, dequantize, quantize_weight


class QuantLinear(torch.nn.Module):
    """A Linear layer whose weight [out, in] is stored quantized (see :class:`QuantWeight`); ``in_order`` (int64
    ``[in]``, optional): the input feature of each stored column (an act-order GPTQ checkpoint's, whose columns
    espert keeps grouped: :func:`espert.quant.checkpoint.act_order`)."""

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None = None, in_order: torch.Tensor | None = None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = qw.fmt, qw.in_features, qw.out_features
        self.group_size, self.transposed, self.qmin, self.qmax = qw.group_size, qw.transposed, qw.qmin, qw.qmax
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)
        self.register_buffer("in_order", in_order)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def qw(self) -> QuantWeight:
        """The live quantized weight (built from the current buffers, so it survives ``.to()``)."""
        return QuantWeight(
            self.fmt,
            self.qweight,
            self.scales,
            self.out_features,
            self.in_features,
            self.group_size,
            self.zeros,
            self.transposed,
            self.qmin,
            self.qmax,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.qw).to(device=x.device, dtype=x.dtype)
        if self.in_order is not None:
            x = x.index_select(-1, self.in_order.to(x.device))
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"fmt={self.fmt}, in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}"
        )


def _pick_group(fmt: str, k: int, group_size: int) -> int:
    if fmt in ("int8", "fp8") or group_size == -1:
        return -1
    return group_size if k % group_size == 0 and group_size < k else -1


@torch.no_grad()
def quantize_model(
    model: torch.nn.Module,
    fmt: str,
    group_size: int = 128,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = ("lm_head",),
) -> torch.nn.Module:
    """Replace the model's ``nn.Linear`` layers by :class:`QuantLinear` in ``fmt`` (in place; returns the model).

    include / exclude: glob patterns on module names (exclude defaults to ``lm_head``, as
    compressed-tensors checkpoints do).  group_size: int4 group along K (layers whose K it does not
    divide use one group).  Raises ValueError for an unknown format or a layer the layout cannot hold.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {FORMATS}")
    targets = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        if exclude and any(fnmatch.fnmatchcase(name, p) or p in name.split(".") for p in exclude):
            continue
        targets.append((name, mod))
    if not targets:
        raise ValueError(f"no Linear layers selected (include={include}, exclude={exclude})")
    for name, mod in targets:
        qw = quantize_weight(mod.weight, fmt, _pick_group(fmt, mod.in_features, group_size))
        qw.qweight = qw.qweight.to(mod.weight.device)
        qw.scales = qw.scales.to(mod.weight.device)
        if qw.zeros is not None:
            qw.zeros = qw.zeros.to(mod.weight.device)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(qw, mod.bias))
    return model


def quant_param_views(model: torch.nn.Module) -> list[QuantParamView]:
    """One :class:`QuantParamView` per QuantLinear, named ``<module name>.weight`` (its float checkpoint name)."""
    views = [
        QuantParamView(f"{name}.weight", mod.qw) for name, mod in model.named_modules() if isinstance(mod, QuantLinear)
    ]
    if not views:
        raise ValueError("the model has no QuantLinear layers (quantize_model first)")
    return views


def model_quant_center(
    model: torch.nn.Module,
    master: bool | str = True,
    pin: bool = False,
    noise: str = "gaussian",
    anchor: bool = False,
    export: str = "values",
) -> QuantCenterStore:
    """The host center of a quantized model's QuantLinear weights (master: see :class:`QuantCenterStore`; noise: the
    noise family, docs/noise.md §5;
    anchor: keep the base codes for anchored weight decay; export: what ``export_state`` gives, see
    :class:`QuantCenterStore`)."""
    return QuantCenterStore(quant_param_views(model), master=master, pin=pin, noise=noise, anchor=anchor, export=export)
