"""restore_: bit-exact from a float32 master or a same-dtype copy, NaN bits included, and one geometry
check shared with the other ops (a weight they cannot address is refused, never copied into a temporary)."""

import numpy as np
import pytest
import torch

from espert import ops
from espert.ops import plan


def _i16(xs):
    return torch.tensor([x - 65536 if x >= 32768 else x for x in xs], dtype=torch.int16)


NANS = {  # quiet, negative with payload, signaling, a normal number
    torch.bfloat16: [0x7FC1, 0xFFA3, 0x7F81, 0x3F80],
    torch.float16: [0x7E01, 0xFC05, 0x7C01, 0x3C00],
}


@pytest.mark.parametrize("dtype", list(NANS))
def test_nan_bits_survive_master_round_trip(dtype):
    """torch's casts turn every bf16 NaN into 0xFFFF and quiet fp16 signaling NaNs; restore must not."""
    w = _i16(NANS[dtype] * 16).view(dtype).reshape(8, 8).clone()
    naive = w.float().to(dtype)
    assert not torch.equal(naive.view(torch.int16), w.view(torch.int16))  # the failure being fixed
    master = ops.cast_exact_(torch.empty(8, 8), w)
    out = torch.zeros_like(w)
    ops.restore_(out, master)
    assert torch.equal(out.view(torch.int16), w.view(torch.int16))


def test_float32_nan_without_top_payload_becomes_quiet_nan_not_inf():
    src = torch.tensor([0x7F800001, -0x007FFFFF], dtype=torch.int32).view(torch.float32)  # NaNs, low payload
    for dtype in NANS:
        out = ops.cast_exact_(torch.empty(2, dtype=dtype), src)
        assert torch.isnan(out).all()


def test_restore_refuses_a_weight_that_cannot_be_addressed_as_rows():
    """Used to write into a temporary reshape and leave the weight unchanged, silently."""
    w = torch.zeros(3, 2, 5).permute(1, 0, 2)
    with pytest.raises(ValueError, match="contiguous"):
        ops.restore_(w, torch.ones(2, 3, 5))
    assert w.abs().sum() == 0


def test_restore_names_a_non_tensor_center():
    with pytest.raises(TypeError, match="center must be a torch.Tensor, got ndarray"):
        ops.restore_(torch.zeros(8, 12), np.zeros((8, 12)))


def test_restore_refuses_meta_and_strided_centers():
    w = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="meta"):
        ops.restore_(w, torch.empty(4, 6, device="meta"))
    with pytest.raises(ValueError, match="contiguous"):
        ops.restore_(w, torch.ones(6, 4).t())
    assert w.abs().sum() == 0


def test_restore_in_bounded_chunks_matches_a_cast(monkeypatch):
    monkeypatch.setattr(plan, "STAGING_BYTES", 256)  # many chunks
    center = torch.randn(37, 29) * 0.02
    w = torch.empty(37, 29, dtype=torch.bfloat16)
    ops.restore_(w, center)
    assert torch.equal(w, center.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", list(NANS))
def test_host_narrowing_kernel_equals_cast_exact(dtype):
    """restore_'s one-pass C++ narrowing (strided rows, every special value) equals cast_exact_."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(7, 300, generator=gen) * 0.02
    flat = src.view(-1)
    specials = [
        0.0,
        -0.0,
        1e-40,
        -3e-39,
        6e-8,
        -5.9e-8,
        65504.0,
        65520.0,
        -70000.0,
        3.4e38,
        float("inf"),
        -float("inf"),
        float("nan"),
    ]
    flat[: len(specials)] = torch.tensor(specials)
    flat.view(torch.int32)[20:24] = torch.tensor([0x7F800001, -0x007FFFFF, 0x7FC12345, 0x7F812000], dtype=torch.int32)
    big = torch.zeros(7, 310, dtype=dtype)
    ops.restore_(big[:, 5:305], src)
    expect = ops.cast_exact_(torch.empty(7, 300, dtype=dtype), src)
    assert torch.equal(big[:, 5:305].contiguous().view(torch.int16), expect.view(torch.int16))
    assert big[:, :5].abs().sum() == 0 and big[:, 305:].abs().sum() == 0
