"""Measurements of the two exactness properties espert promises for float weights, next to the naive way.

- restore exactness: after many perturb/restore cycles, how many weights differ from the center;
- update fidelity: relative error of the applied trajectory θ_T − θ_0 against an fp64 simulation.

tests/test_exactness.py asserts the goals on them; ``python bench/exactness.py`` prints them (the numbers in
docs/architecture.md and the README).  bench/quant_exactness.py measures the same for quantized weights.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from espert import ops
from espert.center import CenterStore
from espert.noise import param_key
from espert.params import ParamView
from espert.update import Update

KEY = param_key("diagnostics.weight")


def _normals(seed: int, n: int) -> torch.Tensor:
    """ε(seed, KEY, 0..n-1) as float32, computed by the CPU kernel (0 + 1·ε is exact)."""
    eps = torch.zeros(n)
    ops.es_update_(eps, [seed], [1.0], KEY)
    return eps


def restore_exactness(
    dtype: torch.dtype, cycles: int = 1000, numel: int = 1 << 20, sigma: float = 1e-3, std: float = 0.02, seed: int = 0
) -> dict:
    """Fraction of weights that differ from the center after ``cycles`` perturb/restore cycles.

    'espert' restores from the center store; 'subtract' is the naive w − σε restore (the same
    perturbations, undone by subtracting the regenerated noise, as existing tools do).
    """
    gen = torch.Generator().manual_seed(seed)
    center = (torch.randn(numel, generator=gen) * std).to(dtype)
    live = center.clone()
    store = CenterStore([ParamView("diagnostics.weight", live)], master_dtype=None)
    naive = center.clone()
    for c in range(cycles):
        sign = 1 if c % 2 == 0 else -1
        store.perturb(c, sigma, sign)
        store.restore()
        ops.perturb_(naive, c, KEY, sigma, sign)
        ops.perturb_(naive, c, KEY, sigma, -sign)
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "cycles": cycles,
        "numel": numel,
        "espert_differ": int((live.view(torch.int16) != center.view(torch.int16)).sum()),
        "subtract_differ_frac": float((naive != center).float().mean()),
        "host_bytes_per_param": store.nbytes / numel,
    }


def update_fidelity(
    steps: int = 100, population: int = 8, numel: int = 1 << 16, alpha: float = 5e-4, std: float = 0.02, seed: int = 0
) -> dict:
    """Relative error ‖Δ − Δ_fp64‖ / ‖Δ_fp64‖ of θ_steps − θ_0 for bf16 weights, per update path.

    coefficients c_n = α z_n / N with z ~ N(0, 1), as in ES-at-scale (α = 5e-4 for σ = 1e-3).
    - 'espert_fp32_master': the center store's float32 master (the run's center of truth);
    - 'espert_bf16_center': the center store without a master (fused update rounded to bf16 once per step);
    - 'naive_bf16_add': per member ``w.add_(c·ε)`` on bf16 weights, as existing tools do.
    """
    gen = torch.Generator().manual_seed(seed)
    theta0 = (torch.randn(numel, generator=gen) * std).to(torch.bfloat16)
    sim = theta0.double()
    master = CenterStore([ParamView("diagnostics.weight", theta0.clone())], master_dtype=torch.float32)
    same = CenterStore([ParamView("diagnostics.weight", theta0.clone())], master_dtype=None)
    naive = theta0.clone()
    rng = np.random.default_rng(seed)
    for t in range(steps):
        seeds = [t * population + n for n in range(population)]
        coeffs = (alpha * rng.standard_normal(population) / population).astype(np.float32)
        for s, c in zip(seeds, coeffs):
            eps = _normals(s, numel)
            sim += float(c) * eps.double()
            naive.add_(float(c) * eps)
        master.update(Update(seeds, coeffs))
        same.update(Update(seeds, coeffs))
    want = sim - theta0.double()

    def rel(center: torch.Tensor) -> float:
        return float((center.double() - theta0.double() - want).norm() / want.norm())

    return {
        "steps": steps,
        "population": population,
        "numel": numel,
        "espert_fp32_master": rel(master.centers[0]),
        "espert_bf16_center": rel(same.centers[0]),
        "naive_bf16_add": rel(naive),
        "update_rms": float(want.pow(2).mean().sqrt()),
        "master_host_bytes_per_param": master.nbytes / numel,
    }


if __name__ == "__main__":
    for dt in (torch.bfloat16, torch.float16):
        print(json.dumps(restore_exactness(dt)))
    print(json.dumps(update_fidelity()))
