"""Measurements for quantized weights (tests/test_quant.py asserts on them; ``python bench/quant_exactness.py``
prints the update-fidelity table of docs/quantized.md):

- restore exactness after many perturb / restore cycles, and the memory the center costs;
- update fidelity: relative error of the dequantized trajectory θ_T − θ_0 against an fp64 simulation,
  for the float32 master, the naive rounding of code + step, and the quantization floor;
- the statistics of one stochastically rounded perturbation.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from espert import noise, ops
from espert.quant.center import QuantCenterStore, QuantParamView, initial_master
from espert.quant.formats import (
    QuantWeight,
    dequantize,
    e4m3_bits_to_float,
    logical_scales,
    quantize_weight,
    unpack_codes,
)
from espert.quant.reference import e4m3_round
from espert.update import Update

NAME = "diagnostics.quant.weight"
KEY = noise.param_key(NAME)


def make_weight(
    fmt: str, n: int = 64, k: int = 512, group_size: int = 128, std: float = 0.02, seed: int = 0
) -> QuantWeight:
    """N(0, std) weights [n, k] quantized into ``fmt``."""
    gen = torch.Generator().manual_seed(seed)
    return quantize_weight(torch.randn(n, k, generator=gen) * std, fmt, group_size)


def quantum(qw: QuantWeight, values: torch.Tensor | None = None) -> torch.Tensor:
    """Value-space grid step of each element [N, K] float64 (int: s; fp8: s·2^(E−3) at the value)."""
    s = logical_scales(qw).double()
    if qw.fmt != "fp8":
        return s
    x = e4m3_bits_to_float(unpack_codes(qw)).abs() if values is None else (values / s).abs().float()
    e = torch.clamp(torch.floor(torch.log2(x.clamp_min(2.0**-30))), min=-6)
    return s * torch.pow(2.0, e.double() - 3)


def _eps(seed: int, n: int, k: int) -> torch.Tensor:
    e = torch.zeros(n, k)
    ops.es_update_(e, [seed], [1.0], KEY)  # 0 + 1·ε is exact
    return e


def restore_exactness(fmt: str, cycles: int = 1000, sigma: float | None = None, **kw) -> dict:
    """Codes differing from the center after ``cycles`` perturb / restore cycles (alternating signs),
    the host bytes/weight of the center and the fraction of codes each perturbation moved."""
    qw = make_weight(fmt, **kw)
    n, k = qw.shape
    ref = qw.qweight.clone()
    sigma = float(quantum(qw).mean()) if sigma is None else sigma
    store = QuantCenterStore([QuantParamView(NAME, qw)], master=True)
    moved = 0.0
    for c in range(cycles):
        store.perturb(c, sigma, 1 if c % 2 == 0 else -1)
        if c == 0:
            moved = float((qw.qweight != ref).float().mean())
        store.restore()
    bits = (lambda t: t.view(torch.uint8)) if fmt == "fp8" else (lambda t: t)
    return {
        "fmt": fmt,
        "cycles": cycles,
        "sigma": sigma,
        "differ": int((bits(qw.qweight) != bits(ref)).sum()),
        "storage_moved_frac_first_cycle": moved,
        "host_bytes_per_weight": store.nbytes / (n * k),
        "host_bytes_per_weight_no_master": (store.nbytes - 4 * n * k) / (n * k),
    }


def perturbation_stats(fmt: str, sigma: float, sign: int = 1, seed: int = 7, **kw) -> dict:
    """Mean and variance of the dequantized perturbation Δ = θ' − θ against the SR formulas.

    Unclamped, Δ = s·floor(v + u) with v = sign·σ·ε/s: E[Δ | ε] = sign·σ·ε and
    Var[Δ] = σ² + s²·E[frac(v)(1 − frac(v))]  (≈ σ² + s²/6 when σ ≫ s).
    Elements within 2 steps of the code range's ends are left out (clamping).
    """
    qw = make_weight(fmt, **kw)
    n, k = qw.shape
    theta0 = dequantize(qw).double()
    p = qw.clone()
    ops.perturb_(p, seed, KEY, sigma, sign)
    delta = dequantize(p).double() - theta0
    eps = _eps(seed, n, k).double()
    q = quantum(qw)
    v = sign * sigma * eps / q
    frac = v - torch.floor(v)
    codes = unpack_codes(qw)
    if fmt == "fp8":
        x = e4m3_bits_to_float(codes).abs()
        keep = x < 400
    else:
        lo, hi = qw.code_range
        keep = (codes.float() > lo + 2 + 6 * sigma / q.max()) & (codes.float() < hi - 2 - 6 * sigma / q.max())
    d, e, f, qq = delta[keep], eps[keep], frac[keep], q[keep]
    return {
        "fmt": fmt,
        "sigma": sigma,
        "sign": sign,
        "count": int(keep.sum()),
        "mean": float(d.mean()),
        "mean_se": float(d.std() / d.numel() ** 0.5),
        "var": float(d.var()),
        "var_formula": float(sigma**2 * e.pow(2).mean() + (qq**2 * f * (1 - f)).mean()),
        "cov_eps": float((d * e).mean()),
        "quantum_rms": float(qq.pow(2).mean().sqrt()),
    }


def _floor_theta(qw: QuantWeight, sim: torch.Tensor, theta0: torch.Tensor) -> torch.Tensor:
    """The exact fp64 end point ``sim`` rounded to ``qw``'s grid (what the best code-storing scheme reaches)."""
    s = logical_scales(qw).double()
    if qw.fmt == "fp8":
        return torch.from_numpy(e4m3_round((sim / s).float().numpy())).double().clamp(-448, 448) * s
    zeros = theta0 / s - unpack_codes(qw).double()  # −z
    lo, hi = qw.code_range
    return (torch.round(sim / s - zeros).clamp(lo, hi) + zeros) * s


def update_fidelity(
    fmt: str, steps: int = 100, population: int = 8, step_in_quanta: float = 0.3, seed: int = 0, **kw
) -> dict:
    """Relative error ‖Δθ − Δθ_fp64‖ / ‖Δθ_fp64‖ of θ_steps − θ_0 (dequantized), per update path.

    Coefficients c_n = α z_n / N (z ~ N(0, 1)), with α chosen so one step moves a weight by about
    ``step_in_quanta`` grid steps (RMS) — the regime where a naive rounded update loses most steps.
    - 'master': float32 master + round-to-nearest codes (QuantCenterStore, master=True);
    - 'float16' / 'residual8': the compact masters (2 B and 1 B per weight; fp8 under residual8 keeps float16);
    - 'master_value': the master itself (s·(M_T − M_0)), before rounding to codes;
    - 'naive': codes ← round(code + Σ c ε / s) each step (no residual);
    - 'floor': rounding the exact fp64 end point to the grid (no code-storing scheme does better).
    """
    qw = make_weight(fmt, seed=seed, **kw)
    n, k = qw.shape
    theta0 = dequantize(qw).double()
    q = quantum(qw)
    alpha = step_in_quanta * float(q.pow(2).mean().sqrt()) * population**0.5
    master_store = QuantCenterStore([QuantParamView(NAME, qw.clone())], master=True)
    naive_store = QuantCenterStore([QuantParamView(NAME, qw.clone())], master=False)
    compact = {m: QuantCenterStore([QuantParamView(NAME, qw.clone())], master=m) for m in ("float16", "residual8")}
    sim = theta0.clone()
    rng = np.random.default_rng(seed)
    for t in range(steps):
        seeds = [t * population + m for m in range(population)]
        coeffs = (alpha * rng.standard_normal(population) / population).astype(np.float32)
        acc = torch.zeros(n, k)
        ops.es_update_(acc, seeds, coeffs, KEY)  # Σ c ε in float32, as the kernels sum it
        sim += acc.double()
        for store in (master_store, naive_store, *compact.values()):
            store.update(Update(seeds, coeffs))
    want = sim - theta0

    def rel(theta: torch.Tensor) -> float:
        return float((theta - theta0 - want).norm() / want.norm())

    mq = master_store.views[0].qw
    s = logical_scales(qw).double()
    m_val = master_store.masters[0].double() * s
    m0_val = initial_master(qw).double() * s
    return {
        "fmt": fmt,
        "steps": steps,
        "population": population,
        "alpha": alpha,
        "update_rms": float(want.pow(2).mean().sqrt()),
        "quantum_rms": float(q.pow(2).mean().sqrt()),
        "master": rel(dequantize(mq).double()),
        "master_value": float((m_val - m0_val - want).norm() / want.norm()),
        "naive": rel(dequantize(naive_store.views[0].qw).double()),
        **{m: rel(dequantize(st.views[0].qw).double()) for m, st in compact.items()},
        **{f"host_bytes_per_weight_{m}": st.nbytes / (n * k) for m, st in compact.items()},
        "floor": rel(_floor_theta(qw, sim, theta0)),
        "host_bytes_per_weight_master": master_store.nbytes / (n * k),
        "host_bytes_per_weight_naive": naive_store.nbytes / (n * k),
    }


if __name__ == "__main__":
    for fmt in ("int8", "fp8", "gptq", "marlin", "cpu_w4a16"):
        print(json.dumps(update_fidelity(fmt, n=64, k=512)))
