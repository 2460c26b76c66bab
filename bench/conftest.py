"""Benchmark setup.  Sizes come from ESPERT_BENCH_MIB (default 256 MiB of bf16 weights)."""

import os

import pytest
import torch

MIB = int(os.environ.get("ESPERT_BENCH_MIB", "256"))


def bench_tensor(device: str = "cpu", mib: int = MIB) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(mib * (1 << 20) // 2, device=device, generator=g) * 0.02).to(torch.bfloat16)


def record(benchmark, w: torch.Tensor, bytes_moved: int, kind: str) -> None:
    """Attach what bench/table.py needs to turn times into rates and side-by-side ratios."""
    benchmark.extra_info.update(elements=w.numel(), bytes=bytes_moved, kind=kind, device=str(w.device))


@pytest.fixture(scope="module")
def cpu_weights():
    return bench_tensor("cpu")
