"""Exact restore and faithful updates (issue goals), measured next to the naive way."""

import tracemalloc

import exactness
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from espert import ops


# float16 with ESPERT_SLOW=1 (both take ~30 s of CPU): the restore copies the center back whatever the dtype,
# and bfloat16 (the README's claim) has the coarser grid
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.extended)])
def test_thousand_perturb_restore_cycles_are_exact(dtype):
    r = exactness.restore_exactness(dtype, cycles=1000, numel=1 << 18)
    assert r["espert_differ"] == 0
    # the naive subtract-restore really is wrong: the test would catch a center store that did that
    assert r["subtract_differ_frac"] > 0.1
    assert r["host_bytes_per_param"] == 2.0


def test_update_fidelity_of_the_float32_master():
    r = exactness.update_fidelity(steps=100, population=8, numel=1 << 15)
    assert r["espert_fp32_master"] <= 0.01  # goal: ≤ 1 %; measured ~3e-6
    assert r["naive_bf16_add"] > 0.1  # what existing tools get (measured ~0.4)
    assert r["master_host_bytes_per_param"] == 4.0


def _max_cpu_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_ops_allocate_nothing_proportional_to_the_tensor():
    w = torch.zeros(1 << 22, dtype=torch.bfloat16)  # 8 MiB
    center = torch.zeros(1 << 22, dtype=torch.float32)
    calls = [
        lambda: ops.perturb_(w, 1, 2, 1e-3),
        lambda: ops.es_update_(w, list(range(32)), [1e-4] * 32, 2),
        lambda: ops.restore_(w, center),
    ]
    torch_peak = max(_max_cpu_allocation(c) for c in calls)  # torch allocations
    tracemalloc.start()  # numpy / Python allocations
    for c in calls:
        c()
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert torch_peak < 4096, torch_peak
    assert py_peak < 1 << 20, py_peak
    # the check can fail: the naive way allocates a full-size noise tensor
    assert _max_cpu_allocation(lambda: w.add_(torch.randn_like(w), alpha=1e-3)) >= w.numel() * 2
