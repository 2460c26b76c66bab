"""Weight decay on quantized centers scales the dequantized value, whatever the zero point."""

import pytest
import torch

from espert.quant import QuantCenterStore, QuantParamView, logical_scales, logical_zeros, quantize_weight


@pytest.mark.parametrize("fmt", ["int8", "fp8", "gptq", "awq"])
def test_scale_multiplies_the_dequantized_master(fmt):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    qw = quantize_weight(w, fmt, group_size=32)
    store = QuantCenterStore([QuantParamView("layer.weight", qw)])
    z, s = logical_zeros(qw), logical_scales(qw)
    before = (store.centers[0] - z) * s
    store.scale(0.5)
    after = (store.centers[0] - z) * s
    torch.testing.assert_close(after, 0.5 * before, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="scale factor"):
        store.scale(float("nan"))
