"""restore="patch": a recording perturb lists exactly the elements whose subtraction would not give back
their bits, on every backend (CPU, Triton in the interpreter, the CUDA kernel emulated on the host), and
the patched restore is bit-identical to copying the center back (docs/architecture.md)."""

import os

import numpy as np
import pytest
import torch

from espert import ops
from espert.center import CenterStore
from espert.config import ESConfig
from espert.params import ParamView
from espert.update import Update

FAMILIES = ("gaussian", "gaussian-icdf", "rademacher", "lowrank:2")
SIGMA = 1e-2
SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 3e38, -65504.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def weights(seed: int) -> tuple[list[torch.Tensor], list[tuple]]:
    """Tensors of all three dtypes, special values, a row-strided column block of a matrix (with its Block)
    and a 1-row parameter; the same bits for the same seed.  Returns (bases, items)."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(9, 301, generator=g) * 0.02).bfloat16()
    a[0, : len(SPECIAL)] = torch.tensor(SPECIAL).bfloat16()
    b = (torch.randn(1003, generator=g) * 0.05).half()
    c = torch.randn(4, 5, 6, generator=g)
    c.view(-1)[: len(SPECIAL)] = torch.tensor(SPECIAL)
    fused = (torch.randn(6, 40, generator=g) * 0.1).bfloat16()
    items = [
        (a, 11, None),
        (b, 12, None),
        (c, 13, None),
        (fused[:, 8:27], 14, ops.Block(0, 8, 6, 40)),  # a column block, row stride 40
    ]
    return [a, b, c, fused], items


def element_of(bases, address: int) -> tuple[int, int]:
    for k, t in enumerate(bases):
        lo = t.data_ptr()
        if lo <= address < lo + t.numel() * t.element_size():
            return k, (address - lo) // t.element_size()
    raise AssertionError(f"record address {address:#x} is in no tensor")


def recorded(bases, patch: ops.PatchList) -> set:
    n = patch.misses()
    assert n <= patch.capacity
    return {(*element_of(bases, a), v) for a, v in patch.records[:n].tolist()}


def subtraction_misses(noise: str, scales) -> set:
    """The elements a plain perturb and a plain subtraction do not bring back, with their old bits."""
    bases, items = weights(0)
    before = [bits(t).clone() for t in bases]
    ops.perturb_many_(items, 5, SIGMA, 1, noise=noise, scales=scales)
    ops.es_update_many_(items, [5], [-SIGMA], noise=noise, scales=scales)
    out = set()
    dtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    for k, (t, old) in enumerate(zip(bases, before)):
        wrong = (bits(t) != old).reshape(-1).nonzero().reshape(-1).tolist()
        flat = old.reshape(-1)
        out |= {(k, i, (int(flat[i]) & (0xFFFFFFFF if t.element_size() == 4 else 0xFFFF)) | dtype[t.dtype] << 32)
                for i in wrong}  # fmt: skip
    return out


@pytest.fixture(params=["cpu", "triton", "cuda_emulated"])
def backend(request, monkeypatch):
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend runs CPU tensors only under TRITON_INTERPRET=1")
    if request.param == "cuda_emulated":
        from cuda_host import emulated

        emulated.register(monkeypatch, max_blocks=3)  # a forced small grid: the grid-stride loop runs
    return request.param


@pytest.mark.parametrize("noise", FAMILIES)
def test_the_list_is_exactly_what_subtraction_misses_and_the_restore_is_exact(backend, noise):
    scales = [1.0, 0.5, 2.0, 1.0]
    expected = subtraction_misses(noise, scales)
    assert len(expected) > 100  # bf16, fp16 and float32 all miss at σ = 1e-2
    bases, items = weights(0)
    before = [bits(t).clone() for t in bases]
    patch = ops.PatchList(20_000)
    ops.perturb_many_(items, 5, SIGMA, 1, noise=noise, scales=scales, backend=backend, record=patch)
    assert recorded(bases, patch) == expected
    assert ops.restore_patched_many_(items, 5, SIGMA, 1, patch, noise=noise, scales=scales, backend=backend)
    for t, old in zip(bases, before):
        assert torch.equal(bits(t), old)  # the padding of the strided block too


def test_an_overflowed_list_is_refused_and_nothing_is_written():
    bases, items = weights(1)
    patch = ops.PatchList(10)
    ops.perturb_many_(items, 7, SIGMA, -1, record=patch)
    perturbed = [bits(t).clone() for t in bases]
    assert patch.misses() > 10  # every miss is counted, also past capacity
    assert not ops.restore_patched_many_(items, 7, SIGMA, -1, patch)
    assert all(torch.equal(bits(t), p) for t, p in zip(bases, perturbed))


def test_bad_patch_arguments_are_refused_before_any_write():
    bases, items = weights(2)
    before = [bits(t).clone() for t in bases]
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="patch capacity"):
            ops.PatchList(bad)
    with pytest.raises(TypeError, match="PatchList"):
        ops.perturb_many_(items, 1, SIGMA, record=torch.zeros(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="the patch list is on meta"):
        ops.perturb_many_(items, 1, SIGMA, record=ops.PatchList(8, "meta"))
    assert all(torch.equal(bits(t), b) for t, b in zip(bases, before))
    from espert import _C

    bogus = torch.tensor([[bases[0].data_ptr(), 7 << 32]], dtype=torch.int64)
    with pytest.raises(ValueError, match="unknown dtype code"):
        _C.apply_patch_cpu(bogus.data_ptr(), 1)
    assert torch.equal(bits(bases[0]), before[0])


def _stores(restore: str, **kw):
    g = torch.Generator().manual_seed(3)
    ws = [(torch.randn(64, 96, generator=g) * 0.02).bfloat16(), (torch.randn(96, generator=g) * 0.1).bfloat16()]
    views = [ParamView("w", ws[0]), ParamView("b", ws[1])]
    return ws, CenterStore(views, noise="gaussian-icdf", sigma_scales=[1.0, 3.0], restore=restore, **kw)


@pytest.mark.parametrize("capacity", [1 / 4, 1e-5])
def test_a_patch_center_gives_the_copy_centers_bits_through_es_steps(capacity):
    """Members, updates, a decay, two perturbs in a row: every restore of restore="patch" equals the copy's.
    A list too small for the misses (capacity 1e-5) falls back to copies, as exact."""
    ws_c, copy = _stores("copy")
    ws_p, patch = _stores("patch", patch_capacity=capacity)
    for it in range(3):
        for seed in (10 * it, 10 * it + 1):
            for sign in (1, -1):
                for c in (copy, patch):
                    c.perturb(seed, 3e-3, sign)
                assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ws_c, ws_p))
                if seed == 21 and sign == 1:  # a second perturb before the restore: not one perturb away
                    for c in (copy, patch):
                        c.perturb(seed + 100, 3e-3)
                for c in (copy, patch):
                    c.restore()
                assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ws_c, ws_p))
        for c in (copy, patch):
            c.update(Update([10 * it, 10 * it + 1], [0.4, -0.2], decay=0.999))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ws_c, ws_p))
    stats = patch.patch_stats
    if capacity == 1e-5:
        assert stats["patched"] == 0 and stats["copied"] == 12 + 3
    else:
        assert stats == {"patched": 11, "copied": 1 + 3, "records": stats["records"]}
        assert 0 < stats["records"] < 0.1 * 11 * (64 * 96 + 96)
    assert copy.patch_stats["patched"] == 0


def test_restore_patch_config_is_checked_and_reaches_the_center():
    with pytest.raises(ValueError, match="restore: patch undoes float perturbations in the torch evaluator"):
        ESConfig(restore="patch", evaluator="vllm")
    with pytest.raises(ValueError, match="restore must be one of"):
        ESConfig(restore="subtract")
    from espert.evaluators.torch_model import config_center

    model = torch.nn.Linear(8, 4)
    store = config_center(model, ESConfig(restore="patch"))
    assert store.restore_mode == "patch" and store.patch is not None
    with pytest.raises(ValueError, match="restore must be 'copy' or 'patch'"):
        CenterStore([ParamView("w", torch.zeros(4))], restore="paste")
    assert np.isclose(store.patch.capacity, np.ceil((8 * 4 + 4) / 16))
