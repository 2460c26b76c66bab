"""Every helper of espert.quant that builds a tensor from a QuantWeight returns it on the weight's device.

On the first GPU run, ``initial_master`` (through ``unpack_codes``) returned a host tensor for a CUDA
weight and ``es_update_(..., master=...)`` refused it ("master is on cpu but qweight is on cuda:0"):
18 of tests/test_gpu.py's quantized cases.  Without a GPU the weights go to the ``meta`` device (shapes
and dtypes, no data): a helper that round-trips through the host cannot run there at all, and one that
follows the weight returns a meta tensor of the same shape and dtype as on CPU.
"""

import dataclasses
import inspect
import typing

import pytest
import torch
from test_gpu import Q_CASES

from espert.quant import center, formats
from espert.quant.formats import QuantWeight, quantize_weight

CASES = Q_CASES  # exactly the formats tests/test_gpu.py runs on a GPU


def _builders():
    """Public functions of espert.quant.formats / .center taking a QuantWeight and returning a tensor."""
    out = {}
    for mod in (formats, center):
        for name, fn in vars(mod).items():
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            hints = typing.get_type_hints(fn)
            params = list(inspect.signature(fn).parameters)
            if params and hints.get(params[0]) is QuantWeight and hints.get("return") is torch.Tensor:
                out[name] = fn
    return out


def test_the_builders_are_found():
    assert {"unpack_codes", "logical_scales", "logical_zeros", "dequantize", "initial_master", "nk_view"} <= set(
        _builders()
    )


def _on(qw: QuantWeight, dev: str) -> QuantWeight:
    return dataclasses.replace(
        qw,
        qweight=qw.qweight.to(dev),
        scales=qw.scales.to(dev),
        zeros=None if qw.zeros is None else qw.zeros.to(dev),
    )


@pytest.mark.parametrize("fmt,kw", CASES, ids=[f"{f}-{'-'.join(map(str, k.values()))}" for f, k in CASES])
@pytest.mark.parametrize("name", sorted(_builders()))
def test_helpers_return_tensors_on_the_weights_device(name, fmt, kw):
    kw = dict(kw)
    group = kw.pop("group", 32)
    qw = quantize_weight(torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * 0.02, fmt, group, **kw)
    fn = _builders()[name]
    want = fn(qw)
    got = fn(_on(qw, "meta"))
    assert got.device.type == "meta", f"{name}({fmt}) returned a tensor on {got.device} for a meta weight"
    assert got.shape == want.shape and got.dtype == want.dtype


@pytest.mark.parametrize("fmt", ["int8", "fp8", "gptq", "awq", "cpu_w4a16", "marlin"])
def test_initial_master_passes_the_ops_device_check(fmt):
    """What the GPU test does: the master built from a (meta) weight is accepted by the op's checks."""
    from espert.quant.ops import _check_master

    qw = _on(quantize_weight(torch.randn(64, 64, generator=torch.Generator().manual_seed(4)) * 0.02, fmt, 32), "meta")
    m = center.initial_master(qw)
    try:
        _check_master(qw, m)
    except Exception as e:  # the finiteness check cannot read meta data; the device check comes first
        assert "is on" not in str(e), e


@pytest.mark.parametrize("fmt", ["gptq", "awq", "cpu_w4a16", "marlin"])
def test_torch_unpack_equals_the_numpy_reference(fmt):
    """The device-following unpack gives the numpy reference's codes, for every bit pattern (sign bit set too)."""
    n, k = 64, 64
    words = torch.randint(
        -(2**31), 2**31, formats.storage_shape(fmt, n, k), dtype=torch.int64, generator=torch.Generator().manual_seed(5)
    ).to(torch.int32)
    want = formats.unpack_int4(fmt, words.numpy(), n, k)
    assert torch.equal(formats.unpack_int4_t(fmt, words, n, k), torch.from_numpy(want))


def test_quant_cuda_runner_launches_under_the_weights_device_guard_with_one_upload(monkeypatch):
    """The quantized CUDA runner makes the weight's device current around the launch (the plain runner
    does): a weight on cuda:1 called from cuda:0 would otherwise launch on the wrong device.  Without a GPU
    the guard and the launch are recorded (the kernel itself cannot run here)."""
    import contextlib

    import numpy as np

    from espert.quant import ops as qops
    from espert.quant.ops import qgeometry

    events = []

    @contextlib.contextmanager
    def guard(dev):
        events.append(("enter", torch.device(dev)))
        yield
        events.append(("exit", torch.device(dev)))

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "device", guard)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: Stream())
    monkeypatch.setattr(qops._C, "quant_cuda", lambda row, stream: events.append(("launch", None)), raising=False)
    qw = quantize_weight(torch.randn(64, 64, generator=torch.Generator().manual_seed(6)) * 0.02, "int8", 32)
    g = qgeometry(qw, None)
    seeds, coeffs = np.array([5], dtype=np.uint64), np.array([1e-3], dtype=np.float32)
    qn = qops._noise(qops.NoiseFamily.parse("gaussian"), g, 1, seeds, qw.qweight.device, "cuda")
    from espert import ops

    with ops.counting() as copies:
        qops._run_cuda(qw, g, None, "perturb", seeds, coeffs, 1, qn)
    assert [e[0] for e in events] == ["enter", "launch", "exit"], events
    # seeds and coefficients go in the ops' one upload (pinned, non-blocking on a GPU); before: two
    # pageable .to(dev) copies, each of which synchronizes the stream
    assert copies["h2d"] == 1
    assert events[0][1] == qw.qweight.device
