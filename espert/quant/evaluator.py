"""A torch evaluator whose ES center is the quantized weights (QuantLinear layers) of the model.

The ES loop only sees the Evaluator interface; ModelEvaluator only needs a
:class:`~espert.center.Center`, which QuantCenterStore implements.
"""

from __future__ import annotations

from espert.evaluators.torch_model import TorchEvaluator

from .model import model_quant_center


class QuantTorchEvaluator(TorchEvaluator):
    """:class:`TorchEvaluator` over a model prepared with :func:`~espert.quant.quantize_model`: ES perturbs
    and updates the QuantLinear codes (float parameters stay fixed).  master: keep the float32 master;
    noise: the noise family (docs/noise.md §5)."""

    def __init__(self, model, tokenizer, score, master: bool = True, noise: str = "gaussian", **kw):
        super().__init__(model, tokenizer, score, center=model_quant_center(model, master=master, noise=noise), **kw)
