"""CPU: espert's fused kernels against the naive torch way and a plain copy, in one run.

pytest bench/test_bench_cpu.py --benchmark-json=bench/cpu.json && python bench/table.py bench/cpu.json
"""

import pytest
import torch
from conftest import record

from espert import ops

SIGMA = 1e-3
KEY = 12345


def test_copy(benchmark, cpu_weights):
    dst = torch.empty_like(cpu_weights)
    record(benchmark, cpu_weights, 2 * cpu_weights.nbytes, "copy")
    benchmark.pedantic(dst.copy_, args=(cpu_weights,), rounds=5, warmup_rounds=1)


def test_perturb_espert(benchmark, cpu_weights):
    record(benchmark, cpu_weights, 2 * cpu_weights.nbytes, "perturb")
    benchmark.pedantic(ops.perturb_, args=(cpu_weights, 1, KEY, SIGMA), rounds=5, warmup_rounds=1)


def test_perturb_naive_torch(benchmark, cpu_weights):
    """What existing tools do: a full-size noise tensor per parameter, then add_."""
    record(benchmark, cpu_weights, 2 * cpu_weights.nbytes, "perturb")
    benchmark.pedantic(lambda: cpu_weights.add_(torch.randn_like(cpu_weights), alpha=SIGMA), rounds=3, warmup_rounds=1)


def test_restore_espert(benchmark, cpu_weights):
    center = cpu_weights.float()
    record(benchmark, cpu_weights, 2 * cpu_weights.nbytes + center.nbytes, "restore")
    benchmark.pedantic(ops.restore_, args=(cpu_weights, center), rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("n", [8, 32])
def test_update_espert(benchmark, cpu_weights, n):
    record(benchmark, cpu_weights, 2 * cpu_weights.nbytes, f"update N={n}")
    benchmark.pedantic(ops.es_update_, args=(cpu_weights, list(range(n)), [1e-5] * n, KEY), rounds=2, warmup_rounds=0)


def test_update_naive_torch_n8(benchmark, cpu_weights):
    """The naive update: regenerate each member's noise tensor and add it."""
    gens = [torch.Generator().manual_seed(s) for s in range(8)]

    def naive():
        for g in gens:
            cpu_weights.add_(torch.randn(cpu_weights.shape, generator=g, dtype=cpu_weights.dtype), alpha=1e-5)

    record(benchmark, cpu_weights, 2 * cpu_weights.nbytes, "update N=8")
    benchmark.pedantic(naive, rounds=2, warmup_rounds=0)
