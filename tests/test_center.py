"""The Center protocol and CenterStore: validation before mutation, optimizers, per-tensor σ, decay
exclusions, the pinned-mirror restore pipeline, and exact NaN round trips."""

import math

import pytest
import torch

from espert import ops
from espert.center import Center, CenterStore, Optimizer
from espert.ops import plan
from espert.params import ParamView
from espert.quant import QuantCenterStore, QuantParamView, quantize_weight
from espert.update import Update

SEEDS, COEFFS = [11, 12, 13], [1e-3, -2e-3, 5e-4]


def _views(dtype=torch.bfloat16, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    return [
        ParamView("layer.0.weight", (torch.randn(12, 16, generator=gen) * 0.02).to(dtype)),
        ParamView("layer.0.bias", (torch.randn(16, generator=gen) * 0.02).to(dtype)),
        ParamView("norm.weight", torch.ones(16, dtype=dtype)),
    ]


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _snapshot(store):
    return [c.clone() for c in store.centers], [_bits(v.tensor) for v in store.views]


def _unchanged(store, snap):
    centers, live = snap
    return all(torch.equal(a, b) for a, b in zip(centers, store.centers)) and all(
        torch.equal(a, _bits(v.tensor)) for a, v in zip(live, store.views)
    )


def test_every_center_implements_the_protocol():
    qw = quantize_weight(torch.randn(8, 32) * 0.02, "int8")
    assert isinstance(CenterStore(_views()), Center)
    assert isinstance(QuantCenterStore([QuantParamView("q.weight", qw)]), Center)


def test_constructor_validates_every_view_before_building_anything():
    """An out-of-range Block in the second view used to surface only when that view was reached,
    after the first view's weight had been perturbed or its center updated."""
    good = ParamView("a.weight", torch.zeros(4, 8))
    bad = ParamView("b.weight", torch.zeros(4, 8), ops.Block(2, 0, 4, 8))  # rows 2..5 of 4
    with pytest.raises(ValueError, match="outside the logical shape"):
        CenterStore([good, bad])


def test_update_accepts_iterators():
    """update(iter(seeds), iter(coeffs)) used to apply nothing: validation consumed the iterators."""
    a, b = CenterStore(_views()), CenterStore(_views())
    a.update(Update(SEEDS, COEFFS))
    b.update(Update(iter(SEEDS), iter(COEFFS)))
    assert all(torch.equal(x, y) for x, y in zip(a.centers, b.centers))
    assert not torch.equal(b.centers[0], CenterStore(_views()).centers[0])


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.update(Update(SEEDS, COEFFS[:2])),
        lambda s: s.update(Update(SEEDS, [1e-3, math.nan, 0.0])),
        lambda s: s.update(Update(SEEDS, COEFFS, decay=0.0)),
        lambda s: s.update(Update(SEEDS, COEFFS, decay=True)),
        lambda s: s.update(Update([-1], [1e-3])),
        lambda s: s.scale(float("inf")),
        lambda s: s.perturb(1, 1e-3, sign=True),
        lambda s: s.perturb(1, -1e-3),
    ],
)
def test_bad_calls_leave_centers_and_weights_untouched(call):
    store = CenterStore(_views())
    snap = _snapshot(store)
    with pytest.raises((ValueError, TypeError)):
        call(store)
    assert _unchanged(store, snap)


def test_load_state_dict_checks_everything_before_copying():
    """A meta tensor (or a bad shape) in a later entry used to leave the earlier centers replaced."""
    store = CenterStore(_views())
    snap = _snapshot(store)
    state = {k: v.clone() + 1 for k, v in store.state_dict().items()}
    state["norm.weight"] = torch.empty(16, device="meta")
    with pytest.raises(ValueError, match="meta"):
        store.load_state_dict(state)
    state["norm.weight"] = torch.zeros(17)
    with pytest.raises(ValueError, match="norm.weight"):
        store.load_state_dict(state)
    del state["norm.weight"]
    with pytest.raises(KeyError, match="norm.weight"):
        store.load_state_dict(state)
    assert _unchanged(store, snap)


def test_nan_weights_restore_to_their_own_bits():
    w = torch.randn(8, 8).to(torch.bfloat16)
    w.view(torch.int16)[0, :3] = torch.tensor([0x7F81, 0x7FC1, -0x5D], dtype=torch.int16)  # sNaN, qNaN, -NaN
    before = _bits(w)
    store = CenterStore([ParamView("w", w)])
    store.perturb(5, 1e-2)
    store.restore()
    assert torch.equal(_bits(w), before)


def test_mirror_pipeline_restores_exactly_and_costs_two_bytes_per_param():
    """The CUDA restore path (a dtype-matched host mirror, rebuilt after each update) runs on CPU too."""
    plain, mirrored = CenterStore(_views()), CenterStore(_views(), mirror=True)
    n = sum(c.numel() for c in plain.centers)
    assert mirrored.nbytes - plain.nbytes == 2 * n
    for store in (plain, mirrored):
        store.perturb(3, 1e-2)
        store.restore()
        store.update(Update(SEEDS, COEFFS))
        store.perturb(4, 1e-2)
        store.restore()
    assert all(torch.equal(_bits(a.tensor), _bits(b.tensor)) for a, b in zip(plain.views, mirrored.views))
    assert all(
        torch.equal(m, ops.cast_exact_(torch.empty_like(m), c)) for m, c in zip(mirrored.mirrors, mirrored.centers)
    )


def test_sigma_scales_scale_perturbation_and_step_per_tensor():
    scales = [0.5, 2.0, 1.0]
    store = CenterStore(_views(torch.float32), sigma_scales=scales)
    ref = _views(torch.float32)
    store.perturb(9, 1e-2, -1)
    for v, s in zip(ref, scales):
        ops.perturb_(v.tensor, 9, v.key, 1e-2 * s, -1, block=v.block)
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(store.views, ref))
    with pytest.raises(ValueError, match="sigma_scales"):
        CenterStore(_views(), sigma_scales=[1.0, 1.0])


def test_no_decay_patterns_exclude_views_from_scale():
    store = CenterStore(_views(torch.float32), no_decay=["bias", "norm"])
    before = [c.clone() for c in store.centers]
    store.scale(0.5)
    assert torch.equal(store.centers[0], before[0] * 0.5)
    assert torch.equal(store.centers[1], before[1]) and torch.equal(store.centers[2], before[2])


def _direction(views, seeds, coeffs):
    """The step Σ c ε of every view, by the single-tensor op on zeros (the reference the optimizers see)."""
    out = []
    for v in views:
        d = torch.zeros(v.tensor.shape)
        ops.es_update_(d, seeds, coeffs, v.key, block=v.block)
        out.append(d)
    return out


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_optimizers_match_their_textbook_update(name):
    opt = Optimizer(name, beta1=0.8, beta2=0.9, eps=1e-6)
    store = CenterStore(_views(), optimizer=opt)
    theta = [c.clone() for c in store.centers]
    m = [torch.zeros_like(t) for t in theta]
    v = [torch.zeros_like(t) for t in theta]
    lr = 1e-3
    for step in range(1, 4):
        seeds = [100 * step + k for k in range(3)]
        store.update(Update(seeds, COEFFS, lr=lr))
        for i, d in enumerate(_direction(store.views, seeds, COEFFS)):
            if name == "momentum":
                m[i] = 0.8 * m[i] + d
                theta[i] = theta[i] + m[i]
            else:
                g = d / lr
                m[i] = 0.8 * m[i] + 0.2 * g
                v[i] = 0.9 * v[i] + 0.1 * g * g
                theta[i] = theta[i] + lr * (m[i] / (1 - 0.8**step)) / ((v[i] / (1 - 0.9**step)).sqrt() + 1e-6)
    for c, t in zip(store.centers, theta):
        torch.testing.assert_close(c, t, rtol=1e-5, atol=1e-7)
    assert store.nbytes == sum(c.numel() for c in store.centers) * 4 * (1 + len(opt.slots))


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_optimizer_state_checkpoints_resume_bit_identically(name):
    straight = CenterStore(_views(), optimizer=name)
    for s in range(5):
        straight.update(Update([s], [1e-3], decay=0.999, lr=1e-3))
    first = CenterStore(_views(), optimizer=name)
    for s in range(3):
        first.update(Update([s], [1e-3], decay=0.999, lr=1e-3))
    state = {k: v.clone() for k, v in first.state_dict().items()}
    resumed = CenterStore(_views(), optimizer=name)
    resumed.load_state_dict(state)
    for s in range(3, 5):
        resumed.update(Update([s], [1e-3], decay=0.999, lr=1e-3))
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    assert all(torch.equal(_bits(a.tensor), _bits(b.tensor)) for a, b in zip(straight.views, resumed.views))


def test_optimizer_chunks_compose_to_one_pass(monkeypatch):
    """The optimizer forms its step in bounded chunks (Blocks of the view); the bits do not depend on them."""

    big = CenterStore(_views(torch.float32), optimizer="momentum")
    monkeypatch.setattr(plan, "STAGING_BYTES", 4 * 5)
    small = CenterStore(_views(torch.float32), optimizer="momentum")
    for store in (big, small):
        store.update(Update(SEEDS, COEFFS))
        store.update(Update([7], [2e-3]))
    assert all(torch.equal(a, b) for a, b in zip(big.centers, small.centers))


def test_adam_needs_lr_and_the_master():
    with pytest.raises(ValueError, match="lr"):
        CenterStore(_views(), optimizer="adam").update(Update(SEEDS, COEFFS))
    with pytest.raises(ValueError, match="float32 master"):
        CenterStore(_views(), master_dtype=None, optimizer="momentum")
    with pytest.raises(ValueError, match="unknown optimizer"):
        CenterStore(_views(), optimizer="lion")


def test_quant_master_with_nan_is_refused_and_codes_untouched():
    """A float32 code-domain master holding NaN used to be accepted and the code silently became 0."""
    qw = quantize_weight(torch.randn(8, 32) * 0.02, "int8")
    store = QuantCenterStore([QuantParamView("q.weight", qw)])
    codes = qw.qweight.clone()
    state = {k: v.clone() for k, v in store.state_dict().items()}
    state["q.weight"][0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        store.load_state_dict(state)
    assert torch.equal(qw.qweight, codes)


def test_quant_zero_points_are_shape_checked():
    """Transposed zero points used to make dequantize and export_state silently wrong."""
    from dataclasses import replace

    qw = quantize_weight(torch.randn(16, 64) * 0.02, "gptq", group_size=32)
    good = torch.full((2, 16), 8, dtype=torch.int32)
    QuantCenterStore([QuantParamView("q.weight", replace(qw, zeros=good))])
    with pytest.raises(ValueError, match="zeros must have shape"):
        QuantCenterStore([QuantParamView("q.weight", replace(qw, zeros=good.t().contiguous()))])


def test_quant_scale_decays_nothing_when_an_argument_is_bad():
    qws = [quantize_weight(torch.randn(8, 32) * 0.02, "int8") for _ in range(2)]
    store = QuantCenterStore([QuantParamView(f"q{i}.weight", q) for i, q in enumerate(qws)])
    before = [m.clone() for m in store.centers]
    with pytest.raises(ValueError):
        store.update(Update([1], [1e-3], decay=-1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, store.centers))


def test_staged_update_pipeline_gives_the_same_bits(monkeypatch):
    """update_on streams the master through a bounded staging buffer (the GPU update path); on the CPU
    the same pipeline runs and must equal the in-place host update bit for bit."""

    monkeypatch.setattr(plan, "STAGING_BYTES", 4 * 7)  # many chunks, rows split
    host, staged = CenterStore(_views()), CenterStore(_views(), update_on="cpu")
    for store in (host, staged):
        store.update(Update(SEEDS, COEFFS, decay=0.99))
    assert all(torch.equal(a, b) for a, b in zip(host.centers, staged.centers))


def test_launches_and_transfers_per_perturb_do_not_grow_with_the_number_of_tensors():
    """One multi-tensor call per CenterStore.perturb / update: counted in the op layer."""

    def counts(n_tensors):
        gen = torch.Generator().manual_seed(1)
        views = [
            ParamView(f"l{i}.weight", (torch.randn(4, 8, generator=gen) * 0.02).to(torch.bfloat16))
            for i in range(n_tensors)
        ]
        store = CenterStore(views)
        with ops.counting() as c:
            store.perturb(1, 1e-3)
            store.restore()
            store.update(Update(SEEDS, COEFFS))
        return dict(c)

    few, many = counts(3), counts(300)
    assert few == many and few["launches"] == 2, (few, many)
