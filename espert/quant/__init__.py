"""Quantized weights (int8, FP8 e4m3, int4 GPTQ / AWQ / vLLM CPU W4A16 / Marlin): perturb, restore and
update them in place, in their storage layouts, with the one noise spec, through the one op surface
(``espert.ops.perturb_ / es_update_ / restore_`` dispatch a :class:`QuantWeight` here).  See docs/quantized.md."""

from .formats import (
    FORMATS,
    INT4_FORMATS,
    QuantWeight,
    dequantize,
    logical_scales,
    logical_zeros,
    pack_codes_,
    quantize_weight,
    unpack_codes,
)
from .ops import qgeometry, requantize_

__all__ = [
    "FORMATS",
    "INT4_FORMATS",
    "QuantWeight",
    "dequantize",
    "logical_scales",
    "logical_zeros",
    "pack_codes_",
    "quantize_weight",
    "unpack_codes",
    "qgeometry",
    "requantize_",
]
from .center import QuantCenterStore, QuantParamView  # noqa: E402
from .model import QuantLinear, model_quant_center, quant_param_views, quantize_model  # noqa: E402

__all__ += [
    "QuantCenterStore",
    "QuantParamView",
    "QuantLinear",
    "model_quant_center",
    "quant_param_views",
    "quantize_model",
]
