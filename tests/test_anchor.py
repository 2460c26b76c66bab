"""Anchored weight decay (AWD, arXiv 2605.30148): the op against its numpy reference bit for bit on every
backend (CPU, Triton interpreted, the CUDA kernel emulated on the host), the centers' AWD against an
independent float64 implementation of the rule, the anchor's host memory, the quantized code-domain
master, and a run with AWD that resumes and replays bit for bit."""

import os

import numpy as np
import pytest
import torch
from conftest import SMALL_RUN, weights

from espert import ops, runs, train
from espert.center import CenterStore
from espert.config import ESConfig
from espert.es import apply_record
from espert.noise import anchor_decay_reference, normal, param_key
from espert.ops.anchor import anchor_decay_
from espert.params import ParamView
from espert.update import Update

SPECIALS = [0.0, -0.0, 1e-40, -3e-39, 1e-5, 3e38, -3e38, float("inf"), float("-inf"), float("nan")]
STEPS = [{"norm": "l2", "amount": 0.02}, {"norm": "l2", "amount": 0.9999}, {"norm": "l1", "amount": 1e-3}]


def _pair(n: int, dtype: torch.dtype, seed: int):
    """(master float32 [n], anchor of ``dtype`` [n]): the master a small step away from the anchor, with
    every special value on both sides (and both at once) in the first elements."""
    g = torch.Generator().manual_seed(seed)
    anchor = weights((n,), dtype, g, specials=True)
    master = anchor.float() + torch.randn(n, generator=g) * 2e-3
    k = len(SPECIALS)
    master[k : 2 * k] = torch.tensor(SPECIALS)
    master[2 * k : 3 * k] = torch.tensor(SPECIALS)
    anchor[2 * k : 3 * k] = torch.tensor(SPECIALS).to(dtype)
    master[3 * k] = anchor[3 * k].float() + 1e-3  # exactly at the l1 threshold: not > 0, back to the anchor
    return master, anchor


def _bits(t):
    return np.asarray(t).view(np.int32)


def _check_backend(backend, n=5003):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for k, step in enumerate(STEPS):
            master, anchor = _pair(n, dtype, seed=k)
            want = anchor_decay_reference(master.numpy(), anchor.float().numpy(), step["norm"], step["amount"])
            got = anchor_decay_(master, anchor, step, backend=backend)
            assert got is master
            np.testing.assert_array_equal(_bits(master.numpy()), _bits(want), err_msg=f"{backend} {dtype} {step}")


def test_cpu_op_matches_the_numpy_reference_bit_for_bit():
    _check_backend("cpu", n=300_017)  # several OpenMP chunks


def test_triton_kernel_matches_the_reference():
    pytest.importorskip("triton")
    _check_backend("triton")


def test_cuda_kernel_emulated_matches_the_reference(monkeypatch):
    from cuda_host import emulated

    if emulated.CXX is None:
        pytest.skip("no host C++ compiler")
    em = emulated.register(monkeypatch, pad=12)
    _check_backend("cuda_emulated")
    em.max_blocks = 2  # the grid-stride loop
    _check_backend("cuda_emulated", n=1500)


def test_the_reference_is_the_rule():
    """The reference itself against the rule written out in float64 (exact here: the inputs are chosen so
    every float32 step is exact)."""
    a = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    m = np.array([1.5, -2.25, 0.5, 2.0], np.float32)
    np.testing.assert_array_equal(anchor_decay_reference(m, a, "l2", 0.5), [1.25, -2.125, 0.5, 2.5])
    np.testing.assert_array_equal(anchor_decay_reference(m, a, "l1", 0.25), [1.25, -2.0, 0.5, 2.25])


@pytest.mark.parametrize(
    "step,match",
    [
        ({"norm": "l3", "amount": 0.1}, "norm must be one of"),
        ({"norm": "l2", "amount": 1.0}, r"in \(0, 1\)"),
        ({"norm": "l2", "amount": 0.0}, r"in \(0, 1\)"),
        ({"norm": "l1", "amount": -1e-3}, "> 0"),
        ({"norm": "l1", "amount": float("nan")}, "finite"),
        ({"norm": "l1", "amount": True}, "finite"),
        ({"norm": "l1"}, "dict"),
    ],
)
def test_bad_steps_are_refused_and_nothing_moves(step, match):
    master, anchor = _pair(100, torch.float32, 0)
    before = master.clone()
    with pytest.raises(ValueError, match=match):
        anchor_decay_(master, anchor, step)
    assert torch.equal(master.view(torch.int32), before.view(torch.int32))


def test_bad_tensors_are_refused():
    master, anchor = _pair(100, torch.bfloat16, 0)
    step = STEPS[0]
    with pytest.raises(TypeError, match="master must be float32"):
        anchor_decay_(master.bfloat16(), anchor, step)
    with pytest.raises(ValueError, match="does not match master"):
        anchor_decay_(master, anchor[:50], step)
    with pytest.raises(ValueError, match="contiguous"):
        anchor_decay_(master.view(10, 10).t(), anchor.view(10, 10), step)
    with pytest.raises(TypeError, match="anchor must be"):
        anchor_decay_(master, anchor.to(torch.float64), step)


# ---- the centers ---------------------------------------------------------------------------------------


def _views(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.mlp.up_proj.weight": (48, 40), "model.norm.weight": (40,), "lm_head.weight": (7, 40)}
    return [ParamView(n, weights(s, dtype, g)) for n, s in shapes.items()]


def _noise(name: str, seed: int, shape) -> np.ndarray:
    n = int(np.prod(shape))
    return normal(seed, param_key(name), np.arange(n, dtype=np.uint64)).astype(np.float64).reshape(shape)


def _float64_run(views, updates, norm, lam):
    """The rule of AWD written independently, in float64: θ += Σ c ε, then toward θ0 (l2 factor or l1 threshold)."""
    out = {}
    for v in views:
        base = v.tensor.double().numpy()
        theta = base.copy()
        for seeds, coeffs, alpha in updates:
            for s, c in zip(seeds, coeffs):
                theta += np.float64(np.float32(c)) * _noise(v.name, s, base.shape)
            d = theta - base
            if norm == "l2":
                theta = base + (1 - alpha * lam) * d
            else:
                theta = base + np.sign(d) * np.maximum(np.abs(d) - alpha * lam, 0)
        out[v.name] = (base, theta)
    return out


@pytest.mark.parametrize("norm,lam", [("l2", 10.0), ("l1", 0.05)])
def test_center_awd_against_float64(norm, lam):
    """30 updates of a CenterStore with AWD against the rule in float64: the change from the base agrees to
    a few float32 ulps of its size (relative error of θ − θ₀ below 1e-5), so AWD adds no error of its own."""
    views = _views()
    c = CenterStore(views, anchor=True)
    rng = np.random.default_rng(0)
    updates = []
    for t in range(30):
        seeds = [int(s) for s in rng.integers(0, 2**63, 3)]
        coeffs = [float(x) for x in rng.normal(0, 3e-3, 3)]
        updates.append((seeds, coeffs, 2e-3))
    ref = _float64_run(views, updates, norm, lam)
    for seeds, coeffs, alpha in updates:
        c.update(Update(seeds, coeffs, anchor={"norm": norm, "amount": alpha * lam}))
    for v, m in zip(views, c.centers):
        base, theta = ref[v.name]
        want, got = theta - base, m.double().numpy() - base
        assert np.linalg.norm(want) > 0
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5, v.name
        # and the decay is doing something: the same steps without AWD move further from the base
    plain = CenterStore(_views(), anchor=False)
    for seeds, coeffs, _ in updates:
        plain.update(Update(seeds, coeffs))
    moved = sum(float((p - v.tensor.float()).norm()) for p, v in zip(plain.centers, views))
    anchored = sum(float((m - v.tensor.float()).norm()) for m, v in zip(c.centers, views))
    assert anchored < 0.8 * moved


def test_center_awd_is_the_op_after_the_step_on_every_path():
    """sgd on the host, sgd streamed through staging (update_on), momentum: the master after an update with an
    anchor step equals the same update without one followed by the op, bit for bit; weight decay toward
    zero (``decay``) still comes first and is independent of it."""
    step = {"norm": "l1", "amount": 2e-4}
    for kw in ({}, {"update_on": "cpu"}, {"optimizer": "momentum"}):
        with_awd = CenterStore(_views(), anchor=True, no_decay=["*norm*"], **kw)
        plain = CenterStore(_views(), no_decay=["*norm*"], **kw)
        for t in range(3):
            with_awd.update(Update([t, t + 7], [3e-3, -2e-3], decay=0.99, lr=1e-3, anchor=step))
            plain.update(Update([t, t + 7], [3e-3, -2e-3], decay=0.99, lr=1e-3))
            for m, v in zip(plain.centers, _views()):
                anchor_decay_(m, v.tensor, step)
        for a, b in zip(with_awd.centers, plain.centers):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), kw
        # the live weights are the rounded master
        for v, m in zip(with_awd.views, with_awd.centers):
            assert torch.equal(v.tensor, m.to(v.tensor.dtype))


def test_anchor_memory_and_refusals():
    """The anchor is the base in the weights' dtype: 2 bytes per bfloat16 parameter, 4 per float32 one,
    never saved; a step to a center without one, or an anchor without the master, is refused before
    anything moves."""
    for dtype, per in ((torch.bfloat16, 2), (torch.float32, 4)):
        views = _views(dtype)
        n = sum(v.tensor.numel() for v in views)
        assert CenterStore(views, anchor=True).nbytes - CenterStore(views).nbytes == per * n
        assert set(CenterStore(views, anchor=True).state_dict()) == {v.name for v in views}
    c = CenterStore(_views())
    before = [m.clone() for m in c.centers]
    with pytest.raises(ValueError, match="anchor=True"):
        c.update(Update([1], [1e-3], anchor={"norm": "l2", "amount": 0.1}))
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        CenterStore(_views(), anchor=True).update(Update([1], [1e-3], anchor={"norm": "l2", "amount": 2.0}))
    assert all(torch.equal(a, b) for a, b in zip(before, c.centers))
    with pytest.raises(ValueError, match="needs the float32 master"):
        CenterStore(_views(), master_dtype=None, anchor=True)


@pytest.mark.parametrize("fmt", ["int8", "gptq"])
def test_quant_center_awd_in_the_code_domain(fmt):
    """QuantCenterStore: the master moves toward the base codes' values by the op's rule (after the step),
    and the codes are the master rounded; the anchor costs the base codes (1 byte per int8 weight, 0.5 per
    int4 one)."""
    from espert.quant import QuantCenterStore, quantize_weight
    from espert.quant.center import QuantParamView, initial_master
    from espert.quant.ops import requantize_

    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g) * 0.05
    make = lambda: [QuantParamView("model.layers.0.mlp.up_proj.weight", quantize_weight(w, fmt, group_size=32))]  # noqa: E731
    step = {"norm": "l2", "amount": 0.3}
    a, b = QuantCenterStore(make(), anchor=True), QuantCenterStore(make())
    assert a.nbytes - b.nbytes == a.codes[0].numel() * a.codes[0].element_size()
    base = initial_master(b.host[0]).clone()
    for t in range(4):
        a.update(Update([t], [0.8], anchor=step))
        b.update(Update([t], [0.8]))
        want = anchor_decay_reference(b.masters[0].numpy(), base.numpy(), "l2", 0.3)
        b.masters[0].copy_(torch.from_numpy(want))
        requantize_(b.host[0], b.masters[0], backend="cpu")
        assert torch.equal(a.masters[0].view(torch.int32), b.masters[0].view(torch.int32))
        assert torch.equal(a.codes[0], b.codes[0]) and torch.equal(a.views[0].qw.qweight, b.codes[0])
    with pytest.raises(ValueError, match="master"):
        QuantCenterStore(make(), master=False, anchor=True)


# ---- the loop, resume and replay --------------------------------------------------------------------------


def test_old_records_replay_as_updates_without_an_anchor_step():
    """A record without ``anchor`` (runs before AWD) is an Update without an anchor step; a record that moves
    nothing is not applied."""
    calls = []

    class ThirdPartyCenter:
        def update(self, step: Update) -> None:
            calls.append(step)

    apply_record(ThirdPartyCenter(), {"seeds": [1], "coeffs": [0.5], "decay": 1.0, "alpha": 0.1})
    apply_record(ThirdPartyCenter(), {"seeds": [], "coeffs": [], "decay": 1.0, "alpha": 0.1, "anchor": None})
    assert len(calls) == 1 and calls[0].seeds.tolist() == [1] and calls[0].coeffs.tolist() == [0.5]
    assert (calls[0].decay, calls[0].lr, calls[0].anchor) == (1.0, 0.1, None)


def test_an_alpha_schedule_that_ends_at_zero_applies_nothing_at_its_end():
    """At α = 0 (a schedule's end) the record has no members, decay 1 and an anchor amount α·λ = 0: nothing is
    applied.  On e7b98f5 apply_record sent it to the center, which refused it ("lr must be a finite number > 0,
    got 0.0"): an AWD run with an α schedule ending at 0 stopped at its last iteration."""
    c = CenterStore(_views(), anchor=True)
    before = [t.clone() for t in c.centers]
    apply_record(c, {"seeds": [], "coeffs": [], "decay": 1.0, "alpha": 0.0, "anchor": {"norm": "l2", "amount": 0.0}})
    assert all(torch.equal(a, b) for a, b in zip(before, c.centers))
    assert Update.of_record({"seeds": [1], "coeffs": [0.5], "decay": 1.0, "alpha": 0.1}) is not None


AWD_RUN = dict(SMALL_RUN, iterations=4, checkpoint_every=2, eval_every=0, anchor_decay=2.0, anchor_decay_norm="l2")


@pytest.mark.parametrize("norm,lam", [("l2", 2.0), ("l1", 0.02)])
def test_awd_run_logs_its_steps_resumes_and_replays_bit_identically(tmp_path, norm, lam):
    cfg = ESConfig(**{**AWD_RUN, "anchor_decay": lam, "anchor_decay_norm": norm})
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(cfg, a, progress=False, echo=None)
    its = [r for r in runs.read_log(os.path.join(a, runs.LOG)) if r["kind"] == "iter"]
    assert all(r["anchor"] == {"norm": norm, "amount": cfg.alpha * lam} for r in its)

    def crash(t, phase):
        if (t, phase) == (3, "logged"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, b, progress=False, echo=None, hook=crash)
    train(None, b, resume=True, progress=False, echo=None)
    sa, _ = runs.load_center(os.path.join(a, runs.CENTER))
    sb, _ = runs.load_center(os.path.join(b, runs.CENTER))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert runs.replay(a, str(tmp_path / "r"), echo=None)["matches_checkpoint"] is True
    # the same run without AWD ends elsewhere (the anchor steps are not a no-op)
    c = str(tmp_path / "c")
    train(ESConfig(**{**AWD_RUN, "anchor_decay": 0.0}), c, progress=False, echo=None)
    sc, _ = runs.load_center(os.path.join(c, runs.CENTER))
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_config_rules():
    with pytest.raises(ValueError, match="alpha·anchor_decay must be < 1"):
        ESConfig(alpha=0.05, anchor_decay=20.0)
    with pytest.raises(ValueError, match="anchor_decay must be a finite number >= 0"):
        ESConfig(anchor_decay=-1.0)
    assert ESConfig(alpha=0.05, anchor_decay=20.0, anchor_decay_norm="l1").anchor_decay == 20.0
    assert ops.BACKENDS["cpu"].anchor is not None  # the registry carries the op
