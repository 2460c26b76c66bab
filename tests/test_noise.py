"""The noise spec itself: Philox known answers, committed golden vectors, keys, and normal quality."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from espert import noise, ops

GOLDEN = Path(__file__).parent / "golden" / "noise_v1.json"

# Random123 known-answer vectors for philox4x32_10: (counter, key) -> output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(x) for x in noise.philox4x32_10(counter, key)) == expected


def test_reference_matches_committed_golden_vectors():
    assert json.loads(GOLDEN.read_text()) == noise.golden_vectors()


def _backend_normals(seed, key, start, count, backend="cpu"):
    """ε for logical indices start..start+count-1, computed by a backend: 0 + 1·ε on a zero block."""
    w = torch.zeros(count, dtype=torch.float32)
    ops.es_update_(
        w, [seed], [1.0], key, block=ops.Block(col_offset=start, logical_cols=start + count), backend=backend
    )
    return w.numpy().view(np.uint32)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_backends_reproduce_golden_normals(backend):
    for case in json.loads(GOLDEN.read_text())["cases"]:
        got = _backend_normals(case["seed"], case["key"], case["start"], len(case["normal_bits"]), backend)
        assert got.tolist() == case["normal_bits"], case["name"]


def test_param_key_is_stable_and_distinct():
    assert noise.param_key("model.layers.0.self_attn.q_proj.weight") == 2455024642836832549
    names = [f"model.layers.{i}.mlp.{p}.weight" for i in range(64) for p in ("gate_proj", "up_proj", "down_proj")]
    assert len({noise.param_key(n) for n in names}) == len(names)


def test_same_shaped_parameters_get_different_noise():
    a = _backend_normals(5, noise.param_key("layers.0.w"), 0, 1024)
    b = _backend_normals(5, noise.param_key("layers.1.w"), 0, 1024)
    assert np.mean(a == b) < 0.01


def test_normal_quality_against_float64_box_muller():
    groups = np.arange(1 << 16, dtype=np.uint64)
    got = noise.normals4(7, 11, groups).astype(np.float64)
    x0, x1, x2, x3 = noise.philox_words(7, 11, groups)

    def bm(xr, xa):
        u = ((xr >> 8).astype(np.float64) + 1) * 2.0**-24
        th = 2 * np.pi * (xa >> 8).astype(np.float64) / 2**24
        r = np.sqrt(-2 * np.log(u))
        return r * np.cos(th), r * np.sin(th)

    ref = np.stack([*bm(x0, x1), *bm(x2, x3)], -1)
    err = np.abs(got - ref)
    assert err.max() < 1e-6  # measured 6.3e-7
    ulps = err / np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 6  # measured 3.8


def test_normal_distribution_moments_tails_and_ks():
    n = _backend_normals(99, noise.param_key("w"), 0, 1 << 22).view(np.float32).astype(np.float64)
    assert abs(n.mean()) < 5 * 1 / math.sqrt(n.size)
    assert abs(n.var() - 1) < 5 * math.sqrt(2 / n.size)
    assert abs(stats.skew(n)) < 0.01 and abs(stats.kurtosis(n)) < 0.02
    for s in (2, 3, 4):
        expected = math.erfc(s / math.sqrt(2))
        assert abs((np.abs(n) > s).mean() - expected) < 6 * math.sqrt(expected / n.size), s
    assert stats.kstest(n[: 1 << 20], "norm").pvalue > 1e-3
    assert np.abs(n).max() < 5.8  # radius is bounded by sqrt(-2 ln 2^-24) = 5.77


def test_antithetic_is_exact_negation():
    key = noise.param_key("w")
    plus = torch.zeros(4096)
    minus = torch.zeros(4096)
    ops.perturb_(plus, 3, key, 0.5, +1)
    ops.perturb_(minus, 3, key, 0.5, -1)
    assert torch.equal(plus, -minus)
