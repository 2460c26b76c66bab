"""`bash bench/gpu_check.sh --dry-run` runs the GPU check's whole flow on CPU (preflight, GPU tests with
interpreted Triton, the GPU benchmarks, the model-shaped check) so the script cannot rot before the
first GPU run.  About two minutes on the 2-core CI machine, most of it interpreted Triton."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_dry_run(tmp_path):
    # the script sets ESPERT_GPU_DRY_RUN; under pytest-xdist, pytest-benchmark in the script's own pytest would
    # see PYTEST_XDIST_WORKER and skip writing its JSON
    env = {k: v for k, v in os.environ.items() if k != "ESPERT_GPU_DRY_RUN" and not k.startswith("PYTEST_")}
    env["PYTHON"] = sys.executable
    res = subprocess.run(
        ["bash", str(ROOT / "bench/gpu_check.sh"), "--dry-run", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "all steps passed" in res.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tensors"] == 26 and report["parameters"] > 0
    assert set(report["backends"]) == {"cpu"} and "error" not in report["backends"]["cpu"]
    assert report["backends"]["cpu"]["perturb_launches"] == 1  # one multi-tensor call for 26 tensors
    assert report["store"]["member_ms"] > 0 and report["store"]["update_n32_host_s"] > 0
    graph = report["cuda_graph"]
    assert all(g["replay_matches_eager"] and g["restored_exactly"] for g in graph.values())
    tests = report["tests"]["gpu_tests.xml"]
    assert tests["failures"] == tests["errors"] == 0 and tests["tests"] - tests["skipped"] >= 60
    bench = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert {b["name"] for b in bench["benchmarks"]} == {
        "test_copy",
        "test_perturb[cpu]",
        "test_perturb_naive_torch",
        "test_update_n32[cpu]",
    }
    assert "| backend |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_refuses_bad_arguments(tmp_path):
    res = subprocess.run(
        ["bash", str(ROOT / "bench/gpu_check.sh"), "--frobnicate"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "unknown option --frobnicate" in res.stderr
    res = subprocess.run(
        ["bash", str(ROOT / "bench/gpu_check.sh")], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "output folder" in res.stderr


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu-sizes", "dry-run-sizes"])
def test_gpu_test_geometry_is_valid_at_both_sizes(cuda):
    """tests/test_gpu.py's Blocks and long-index runs are valid at the GPU run's sizes, not only at the dry
    run's: a run past 2^64 elements is refused by the geometry check before any kernel (the first GPU run
    would have lost 2 tests to `start = 2**64 - 4097` with n = 2^20 + 7).  Checked on meta tensors."""
    import torch
    from test_gpu import blocks, sizes

    from espert import ops

    sz = sizes(cuda)
    for start in sz["long_starts"]:
        ops._geometry(
            torch.empty(sz["long_n"], device="meta"), ops.Block(col_offset=start, logical_cols=start + sz["long_n"])
        )
    for cols, block in blocks(sz).values():
        ops._geometry(torch.empty(sz["rows"], cols, device="meta"), block)
