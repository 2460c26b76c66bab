"""Quantized weights: layouts, bitwise agreement of every backend with the numpy reference, exact
restore, SR statistics, update fidelity, memory, errors, the CUDA compile check and QuantLinear."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import quant_exactness as D
import torch
from torch.profiler import ProfilerActivity, profile

from espert import noise, ops
from espert.ops import Block
from espert.quant import (
    FORMATS,
    INT4_FORMATS,
    QuantCenterStore,
    QuantParamView,
    QuantWeight,
    dequantize,
    quantize_weight,
    unpack_codes,
)
from espert.quant import formats as F
from espert.quant.center import initial_master
from espert.quant.reference import e4m3_to_f32, f32_to_e4m3
from espert.update import Update

ROOT = Path(__file__).resolve().parents[1]
KEY = noise.param_key("model.layers.1.mlp.down_proj.weight")
FAMILIES = ["gaussian", "gaussian-icdf", "rademacher", "lowrank:3"]  # every noise family (docs/noise.md §5)
SLOW = os.environ.get("ESPERT_SLOW") == "1"


def qweight(fmt, n=128, k=64, group=32, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return quantize_weight(torch.randn(n, k, generator=g) * 0.02, fmt, group, **kw)


def storage(qw):
    return qw.qweight.view(torch.uint8) if qw.fmt == "fp8" else qw.qweight


def run(qw, mode, backend, block=None, noise="gaussian"):
    """Apply one op (perturb / master / naive) with ``backend``; returns (qw, master)."""
    master = initial_master(qw) if mode == "master" else None
    if mode == "perturb":
        ops.perturb_(qw, 5, KEY, 2e-3, -1, block=block, backend=backend, noise=noise)
    else:
        seeds, coeffs = [1, 2**64 - 1, 3], [3e-3, -2e-3, 1e-3]
        ops.es_update_(qw, seeds, coeffs, KEY, master=master, block=block, backend=backend, noise=noise)
    return qw, master


# ---- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", INT4_FORMATS)
def test_int4_pack_unpack_roundtrip(fmt):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(128, 64)).astype(np.int32)
    packed = F.pack_int4(fmt, codes)
    assert packed.shape == F.storage_shape(fmt, 128, 64) and packed.dtype == np.int32
    np.testing.assert_array_equal(F.unpack_int4(fmt, packed, 128, 64), codes)


def test_marlin_closed_form_matches_the_vllm_repack():
    """The index map of docs/quantized.md is the same bijection as vLLM's marlin_permute_weights + pack."""
    rng = np.random.default_rng(1)
    k, n = 64, 256
    codes_kn = rng.integers(0, 16, size=(k, n))
    np.testing.assert_array_equal(F.pack_int4("marlin", codes_kn.T.copy()), F.marlin_pack_vllm(codes_kn))
    kk, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
    row, col, shift = F.marlin_index(kk, nn)
    flat = (row * 2 * n + col) * 8 + shift // 4
    assert np.unique(flat).size == k * n  # bijective onto the (K/16, 2N) x 8 nibbles


def test_marlin_scale_permutations_match_vllm():
    s = np.arange(3 * 128, dtype=np.float32).reshape(3, 128)
    for grouped in (True, False):
        perm = F.marlin_permute_scales(s, grouped)
        cols = F.marlin_scale_col(np.arange(128), grouped)
        np.testing.assert_array_equal(perm[:, cols], s)


def test_awq_and_cpu_layout_formulas():
    """AWQ nibble order [0, 2, 4, 6, 1, 3, 5, 7] and the CPU W4A16 formula of docs/quantized.md, element by element."""
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, size=(32, 16)).astype(np.int32)
    awq = F.pack_int4("awq", codes).view(np.uint32)
    cpu = F.pack_int4("cpu_w4a16", codes).view(np.uint32)
    for n in range(32):
        for k in range(16):
            nib = list(F.AWQ_ORDER).index(n % 8)
            assert (awq[k, n // 8] >> (4 * nib)) & 0xF == codes[n, k]
            assert (cpu[n // 16, 2 * k + (n % 16) // 8] >> (4 * (n % 8))) & 0xF == codes[n, k]


def test_e4m3_conversions_match_torch():
    bits = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(bits.copy()).view(torch.float8_e4m3fn).float().numpy()
    got = e4m3_to_f32(bits)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))
    np.testing.assert_array_equal(f32_to_e4m3(got[ok]), bits[ok])


def test_sr_uniform_stream():
    idx = np.arange(4096, dtype=np.uint64)
    u = noise.sr_uniform(3, KEY, idx)
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.02 and abs(u.var() - 1 / 12) < 0.005
    # a stream of its own: not the words the normals use
    words = np.stack(noise.philox_words(3, KEY, idx[::4] >> np.uint64(2)), -1).reshape(-1)
    assert not np.array_equal((words >> np.uint32(8)).astype(np.float32) * np.float32(2**-24), u[: words.size])


# ---- bitwise: every backend against the numpy reference ----------------------------------------

CASES = [
    ("int8", {}),
    ("int8", {"per_tensor": True}),
    ("fp8", {}),
    ("fp8", {"per_tensor": True}),
    ("fp8", {"scale_dtype": torch.bfloat16}),
    ("gptq", {}),
    ("gptq", {"scale_dtype": torch.bfloat16}),
    ("awq", {}),
    ("cpu_w4a16", {}),
    ("marlin", {}),
    ("marlin", {"group": -1}),
    ("gptq", {"group": -1}),
]


@pytest.mark.parametrize("noise_family", FAMILIES)
@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("mode", ["perturb", "master", "naive"])
@pytest.mark.parametrize("fmt,kw", CASES, ids=[f"{f}-{'-'.join(map(str, k.values()))}" for f, k in CASES])
def test_backends_match_reference(fmt, kw, mode, backend, noise_family):
    kw = dict(kw)
    group = kw.pop("group", 32)
    base = qweight(fmt, group=group, **kw)
    want, m_want = run(base.clone(), mode, "reference", noise=noise_family)
    got, m_got = run(base.clone(), mode, backend, noise=noise_family)
    assert torch.equal(storage(got), storage(want))
    assert not torch.equal(storage(got), storage(base))  # the op did something
    if mode == "master":
        assert torch.equal(m_got.view(torch.int32), m_want.view(torch.int32))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_8bit_storage_orders_and_vllm_transposed_view(backend):
    """[N, K], [K, N] row-major and vLLM's (K, N) .t() view of [N, K] storage get the same codes."""
    base = qweight("int8")
    want, _ = run(base.clone(), "perturb", "reference")
    kn = QuantWeight("int8", base.qweight.t().contiguous(), base.scales.clone(), 128, 64, transposed=True)
    view = QuantWeight("int8", base.qweight.clone().t(), base.scales.clone(), 128, 64, transposed=True)
    for qw in (kn, view):
        run(qw, "perturb", backend)
        assert torch.equal(unpack_codes(qw), unpack_codes(want))


#: int4 layouts whose storage holds output channels along its columns: (words per channel, channels per tile)
COLUMN_LAYOUTS = {"gptq": (1, 1), "awq": (1 / 8, 8), "marlin": (2, 64)}


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
@pytest.mark.parametrize("fmt", sorted(COLUMN_LAYOUTS))
def test_int4_piece_as_a_column_slice_of_wider_storage(fmt, backend):
    """A fused layer's piece (output channels [64, 192) of 256) is a column slice of the layer's storage, with the
    layer's row stride (vLLM's Marlin qkv / gate_up on a GPU): edited in place like the same piece stored alone,
    and the other columns untouched."""
    per, _ = COLUMN_LAYOUTS[fmt]
    full = qweight(fmt, n=256, k=64, group=32)
    lo, hi = int(64 * per), int(192 * per)
    piece_scales = full.scales[:, 64:192].contiguous()  # Marlin's column permutation stays inside 64-column tiles
    view = QuantWeight(fmt, full.qweight[:, lo:hi], piece_scales, 128, 64, 32)
    alone = QuantWeight(fmt, full.qweight[:, lo:hi].clone(), piece_scales.clone(), 128, 64, 32)
    assert not view.qweight.is_contiguous()
    before = full.qweight.clone()
    blk = Block(64, 0, 256, 64)
    for qw in (view, alone):
        ops.perturb_(qw, 5, KEY, 2e-3, -1, block=blk, backend=backend)
    assert torch.equal(view.qweight, alone.qweight) and not torch.equal(alone.qweight, before[:, lo:hi])
    assert torch.equal(full.qweight[:, :lo], before[:, :lo]) and torch.equal(full.qweight[:, hi:], before[:, hi:])
    whole = QuantWeight(fmt, before.clone(), full.scales, 256, 64, 32)  # the piece moves as in the whole layer
    ops.perturb_(whole, 5, KEY, 2e-3, -1, backend="reference")
    assert torch.equal(unpack_codes(whole)[64:192], unpack_codes(view))


@pytest.mark.parametrize("noise_family", FAMILIES)
def test_same_noise_in_every_layout(noise_family):
    """One logical int4 weight stored in the four int4 layouts moves identically (logical noise index)."""
    base = qweight("gptq", group=-1)
    codes, scales = unpack_codes(base), base.scales
    outs = []
    for fmt in INT4_FORMATS:
        s = scales
        if fmt == "marlin":
            s = torch.from_numpy(F.marlin_permute_scales(scales.numpy(), False))
        qw = QuantWeight(fmt, torch.zeros(F.storage_shape(fmt, 128, 64), dtype=torch.int32), s, 128, 64, -1)
        F.pack_codes_(qw, codes)
        ops.perturb_(qw, 11, KEY, 5e-3, noise=noise_family)
        outs.append(unpack_codes(qw))
    assert all(torch.equal(o, outs[0]) for o in outs) and not torch.equal(outs[0], codes)


@pytest.mark.parametrize("noise_family", FAMILIES)
@pytest.mark.parametrize("fmt", ["int8", "gptq", "marlin"])
def test_shards_compose_to_the_whole(fmt, noise_family):
    """Row / column blocks (tensor-parallel shards) regenerate exactly their elements' noise."""
    n, k = 128, 128
    whole = qweight(fmt, n, k, group=-1)
    ref_codes = unpack_codes(whole)
    ops.perturb_(whole, 9, KEY, 3e-3)
    for r0, r1, c0, c1 in ((0, 64, 0, 64), (64, 128, 64, 128)):
        part = quantize_weight(dequantize(qweight(fmt, n, k, group=-1))[r0:r1, c0:c1], fmt, -1)
        F.pack_codes_(part, ref_codes[r0:r1, c0:c1])
        part.scales = torch.ones_like(part.scales) * 0.004
        full = QuantWeight(fmt, whole.qweight.clone(), whole.scales.clone(), n, k)
        # compare against a whole weight with the part's scales: equal scales make the step comparable
        cmp = quantize_weight(torch.zeros(n, k), fmt, -1)
        F.pack_codes_(cmp, ref_codes)
        cmp.scales = torch.ones_like(cmp.scales) * 0.004
        ops.perturb_(cmp, 9, KEY, 3e-3, noise=noise_family)
        ops.perturb_(part, 9, KEY, 3e-3, block=Block(r0, c0, n, k), noise=noise_family)
        assert torch.equal(unpack_codes(part), unpack_codes(cmp)[r0:r1, c0:c1]), (r0, c0)
        del full


@pytest.mark.parametrize("noise_family", FAMILIES)
@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "awq", "marlin"])
def test_quantized_weight_gets_the_noise_of_its_float_twin(fmt, backend, noise_family):
    """The master update adds exactly fl(Σ c ε / s), with ε from the float kernels (a float32 zero
    tensor updated with the same members, key and block holds Σ c ε): same noise, other code path."""
    n, k = 128, 64
    qw = qweight(fmt, n, k)
    if fmt == "int8":  # vLLM's (K, N) .t() view of [N, K] storage
        qw = QuantWeight("int8", qw.qweight.clone().t(), qw.scales, n, k, transposed=True)
    blk = Block(64, 128, 320, 256)  # a shard of a logical [320, 256] weight
    seeds, coeffs = [7, 2**63 + 5], [2e-3, -1e-3]
    master = initial_master(qw)
    before = master.clone()
    ops.es_update_(qw, seeds, coeffs, KEY, master=master, block=blk, backend=backend, noise=noise_family)
    twin = torch.zeros(n, k)
    ops.es_update_(twin, seeds, coeffs, KEY, block=blk, noise=noise_family)
    if noise_family == "rademacher":  # ±2e-3 ± 1e-3: two magnitudes
        assert torch.unique(twin.abs()).numel() == 2
    want = (before.numpy() + twin.numpy() / F.logical_scales(qw).numpy()).astype(np.float32)
    lo, hi = qw.code_range
    want = np.clip(want, np.float32(lo), np.float32(hi))
    np.testing.assert_array_equal(master.numpy().view(np.int32), want.view(np.int32))
    assert not torch.equal(master, before)


# ---- exactness, statistics, fidelity, memory --------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_thousand_cycles_restore_exactly(fmt):
    r = D.restore_exactness(fmt, cycles=1000, n=64, k=256)
    assert r["differ"] == 0
    assert r["storage_moved_frac_first_cycle"] > 0.3  # the perturbation really moved codes
    per_code = 1.0 if fmt in ("int8", "fp8") else 0.5
    assert r["host_bytes_per_weight_no_master"] == pytest.approx(per_code)  # the scales are the live weights' own


@pytest.mark.parametrize(
    "fmt,quanta", [("int8", 0.2), ("int8", 3.0), ("fp8", 1.0), ("fp8", 4.0), ("gptq", 0.2), ("awq", 0.5)]
)
@pytest.mark.parametrize("sign", [1, -1])
def test_perturbation_is_unbiased_with_the_sr_variance(fmt, quanta, sign):
    """E[Δ] = 0, Var[Δ] = σ² + E[s²·frac(1 − frac)], Cov(Δ, ε) = sign·σ."""
    q = float(D.quantum(D.make_weight(fmt)).pow(2).mean().sqrt())
    r = D.perturbation_stats(fmt, quanta * q, sign=sign)
    assert r["count"] > 10000
    assert abs(r["mean"]) < 4 * r["mean_se"] + 1e-9
    assert r["var"] == pytest.approx(r["var_formula"], rel=0.08 if fmt == "fp8" else 0.05)
    assert r["cov_eps"] == pytest.approx(sign * r["sigma"], rel=0.06)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "gptq"])
def test_update_fidelity_master_vs_naive(fmt):
    r = D.update_fidelity(fmt, steps=100, population=8, n=32, k=256)
    assert r["naive"] > 0.5  # naive rounding loses most sub-step updates
    assert r["master"] < 0.5 * r["naive"]
    assert r["master"] <= r["floor"] * 1.35 + 0.02  # near what any code-storing scheme can reach
    assert r["host_bytes_per_weight_master"] == pytest.approx(r["host_bytes_per_weight_naive"] + 4)


@pytest.mark.parametrize("fmt", ["int8", "gptq"] + (["fp8", "awq", "cpu_w4a16", "marlin"] if SLOW else []))
def test_the_compact_master_meets_the_host_budget_within_ten_percent_of_float32s_fidelity(fmt):
    """residual8 (issue 49): host ≤ 1.5 B per int4 weight and ≤ 2.5 B per int8 weight, and an update trajectory
    within 10% of the float32 master's error (float16 measured beside it: 2.5 B and 3 B, over the budget)."""
    r = D.update_fidelity(fmt, steps=100, population=8, n=64, k=256)  # Marlin's tiles need N % 64 == 0
    budget = {"int8": 2.5, "fp8": 3.0}.get(fmt, 1.5)  # fp8 keeps a float16 master under residual8
    assert r["host_bytes_per_weight_residual8"] <= budget
    assert r["residual8"] <= 1.10 * r["master"] and r["float16"] <= 1.10 * r["master"]
    assert r["residual8"] < 0.5 * r["naive"]


@pytest.mark.parametrize("master", ["residual8", "float16"])
@pytest.mark.parametrize("fmt", ["int8", "gptq", "fp8"])
def test_a_compact_master_resumes_bit_for_bit_from_its_checkpoint(fmt, master):
    """The checkpoint holds int16 ``code·256 + r`` for a residual8 master of int codes (2 B per weight) and float32
    otherwise, made one tensor at a time; a store loaded from it keeps the same compact master and codes, and the
    next update moves both stores identically."""
    base = D.make_weight(fmt, n=16, k=64, group_size=32)
    a = QuantCenterStore([QuantParamView("w", base.clone())], master=master)
    a.update(Update([1, 2, 3], [0.7, -0.4, 0.2]))
    a.update(Update(range(50, 90), [0.3] * 40))  # many members: residuals spread over [−½, ½]
    if fmt != "fp8":  # the kept master rounds to the kept codes (a residual never reaches ½: no ties)
        assert torch.equal(torch.round(a.master(0)), unpack_codes(a.host[0]).float())
    saved = {k: t.clone() for k, t in a.state_dict().items()}
    assert saved["w"].dtype == (torch.int16 if master == "residual8" and fmt != "fp8" else torch.float32)
    b = QuantCenterStore([QuantParamView("w", base.clone())], master=master)
    b.load_state_dict(saved)
    assert torch.equal(a.masters[0], b.masters[0]) and torch.equal(a.codes[0], b.codes[0])
    for s in (a, b):
        s.update(Update([4, 5], [0.3, -0.6], decay=0.99))
    assert torch.equal(a.masters[0], b.masters[0]) and torch.equal(a.codes[0], b.codes[0])
    assert torch.equal(a.views[0].qw.qweight, b.views[0].qw.qweight)


def _max_cpu_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("fmt", ["int8", "gptq"])
def test_ops_allocate_nothing_proportional_to_the_weight(fmt):
    qw = qweight(fmt, 1024, 1024, group=128)
    master = initial_master(qw)
    codes = qw.qweight.clone()
    calls = [
        lambda: ops.perturb_(qw, 1, KEY, 1e-3),
        lambda: ops.es_update_(qw, list(range(8)), [1e-4] * 8, KEY, master=master),
        lambda: ops.restore_(qw, codes),
    ]
    # only scale-sized temporaries (validation of the scales: N or K/g·N elements), never weight-sized
    peak = max(_max_cpu_allocation(c) for c in calls)
    assert peak <= 4 * qw.scales.numel() + 4096, peak
    assert _max_cpu_allocation(lambda: dequantize(qw)) >= 1024 * 1024  # the check can fail


# ---- errors: clear, and nothing changes ----------------------------------------------------------


def _bad_cases():
    g = qweight("gptq")
    i8 = qweight("int8")
    yield "group", QuantWeight("gptq", g.qweight, g.scales, 128, 64, group_size=12), "group_size"
    yield "scale shape", QuantWeight("gptq", g.qweight, g.scales[:1], 128, 64, group_size=32), "scales must have shape"
    yield "scale dtype", QuantWeight("int8", i8.qweight, i8.scales.to(torch.float64), 128, 64), "float32 / float16"
    yield "zero scale", QuantWeight("int8", i8.qweight, torch.zeros_like(i8.scales), 128, 64), "finite and > 0"
    yield "layout", QuantWeight("marlin", g.qweight, g.scales, 128, 64, group_size=32), "marlin qweight must have shape"
    yield "dtype", QuantWeight("int8", i8.qweight.to(torch.int16), i8.scales, 128, 64), "must be torch.int8"
    wide = torch.zeros(64, 256, dtype=torch.int8)
    yield "strided", QuantWeight("int8", wide[:, ::2], i8.scales, 128, 64, transposed=True), "unit inner stride"
    yield "K % 4", QuantWeight("int8", torch.zeros(4, 6, dtype=torch.int8), torch.ones(4), 4, 6), "multiple of 4"
    yield "unknown", QuantWeight("int3", g.qweight, g.scales, 128, 64), "unknown quantized format"
    yield "range", QuantWeight("int8", i8.qweight, i8.scales, 128, 64, qmin=-200), "code range"
    yield (
        "awq N",
        QuantWeight("awq", torch.zeros(64, 1, dtype=torch.int32), torch.ones(2, 4, dtype=torch.float16), 4, 64, 32),
        "out_features % 8",
    )


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_clear_errors_and_weights_untouched(case):
    _, qw, msg = case
    before = qw.qweight.clone()
    with pytest.raises((ValueError, TypeError), match=re.escape(msg)):
        ops.perturb_(qw, 1, KEY, 1e-2)
    with pytest.raises((ValueError, TypeError), match=re.escape(msg)):
        ops.es_update_(qw, [1], [1e-2], KEY)
    assert torch.equal(qw.qweight, before)


def test_bad_master_block_and_members_leave_everything_untouched():
    qw = qweight("gptq")
    master = initial_master(qw)
    before, m_before = qw.qweight.clone(), master.clone()
    with pytest.raises(ValueError, match="master must be a contiguous"):
        ops.es_update_(qw, [1], [1e-2], KEY, master=master.t())
    with pytest.raises(ValueError, match="float32"):
        ops.es_update_(qw, [1], [1e-2], KEY, master=master.double())
    with pytest.raises(ValueError, match="finite"):
        ops.es_update_(qw, [1, 2], [1e-2, float("nan")], KEY, master=master)
    with pytest.raises(ValueError, match="outside the logical shape"):
        ops.perturb_(qw, 1, KEY, 1e-2, block=Block(1, 0, 128, 64))
    with pytest.raises(ValueError, match="sigma"):
        ops.perturb_(qw, 1, KEY, 0.0)
    with pytest.raises(ValueError, match="restore source"):
        ops.restore_(qw, qw.qweight[:1].clone())
    assert torch.equal(qw.qweight, before) and torch.equal(master, m_before)


def test_center_store_roundtrip_and_checkpoint():
    qws = [qweight("int8", seed=1), qweight("awq", seed=2)]
    store = QuantCenterStore([QuantParamView("a.weight", qws[0]), QuantParamView("b.weight", qws[1])])
    store.update(Update([1, 2], [2e-3, -1e-3]))
    state = {k: v.clone() for k, v in store.state_dict().items()}
    live = [q.qweight.clone() for q in qws]
    store.perturb(3, 1e-2)
    other = QuantCenterStore([QuantParamView("a.weight", qws[0].clone()), QuantParamView("b.weight", qws[1].clone())])
    other.load_state_dict(state)
    store.restore()
    for q, o, want in zip(qws, other.views, live):
        assert torch.equal(q.qweight, want) and torch.equal(o.qw.qweight, want)
    with pytest.raises(KeyError):
        other.load_state_dict({"a.weight": state["a.weight"]})


# ---- QuantLinear and models -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_model_forward_and_exact_restore(fmt, tmp_path):
    from espert.quant import model_quant_center, quant_param_views, quantize_model
    from espert.tiny import build_tiny_model

    model = build_tiny_model(str(tmp_path / "tiny"), seed=0)
    ids = torch.tensor([[1, 5, 6, 7, 8, 4]])
    ref = model(ids).logits
    quantize_model(model, fmt, group_size=32)
    views = quant_param_views(model)
    assert views and all(v.name.endswith(".weight") and "lm_head" not in v.name for v in views)
    assert "model.layers.0.self_attn.q_proj.weight" in {v.name for v in views}
    out = model(ids).logits
    assert (out - ref).abs().max() < 0.2 * ref.abs().max()  # quantization error, not garbage
    store = model_quant_center(model)
    store.perturb(1, 0.02)
    assert not torch.equal(model(ids).logits, out)
    store.restore()
    assert torch.equal(model(ids).logits, out)


def test_quant_cpu_isa_paths_agree():
    """The AVX-512 and generic paths of the quantized CPU kernels produce identical codes."""
    import os
    import subprocess
    import sys

    script = (
        "import torch; from espert import _C; from espert.quant import quantize_weight; from espert import ops\n"
        "w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02\n"
        "out = []\n"
        "for fmt in ('int8', 'fp8', 'gptq', 'awq', 'marlin'):\n"
        "  for fam in ('gaussian', 'rademacher'):\n"
        "    qw = quantize_weight(w, fmt, group_size=128)\n"
        "    ops.perturb_(qw, 3, 77, 0.01, -1, backend='cpu', noise=fam)\n"
        "    ops.es_update_(qw, [1, 2], [0.01, -0.02], 77, backend='cpu', noise=fam)\n"
        "    out.append(qw.qweight.contiguous().view(torch.uint8).numpy().tobytes().hex())\n"
        "print(_C.cpu_isa(), ''.join(out))"
    )
    outs = {}
    for isa in ("generic", "native"):
        res = subprocess.run(
            [sys.executable, "-c", script],
            env=dict(os.environ, ESPERT_CPU_ISA=isa),
            capture_output=True,
            text=True,
            check=True,
        )
        name, data = res.stdout.split()
        outs[name] = data
    assert "generic" in outs and len(set(outs.values())) == 1


@pytest.mark.parametrize(
    "sigma, sign, match",
    [
        (1e-2, True, "sign"),
        (1e-2, 1.0, "sign"),
        (1e-2, -1.0, "sign"),
        (1e-2, np.int64(1), "sign"),
        (1e-40, 1, "subnormal"),
        (1e-50, 1, "float32"),
        (np.float64(1e-40), 1, "subnormal"),
        (1e39, 1, "float32"),
        (np.bool_(True), 1, "sigma"),
    ],
)
def test_quantized_perturb_checks_sigma_and_sign_as_float_weights_do(sigma, sign, match):
    """One check_sigma / check_sign for every weight type: what the float ops refuse, perturb_q refuses."""
    w = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=match):
        ops.perturb_(w, 1, KEY, sigma, sign)
    qw = qweight("int8")
    before = qw.qweight.clone()
    with pytest.raises(ValueError, match=match):
        ops.perturb_(qw, 1, KEY, sigma, sign)
    assert torch.equal(qw.qweight, before)
