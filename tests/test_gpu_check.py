"""`bash bench/gpu_check.sh --dry-run` runs the GPU check's whole flow on CPU (preflight, the CMake/nvcc
build for sm_90 into its own folder, GPU tests with interpreted Triton, the GPU benchmarks, the
model-shaped check) so the script cannot rot before the first GPU run.  About two and a half minutes
on the 2-core CI machine, most of it interpreted Triton."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cuda_ptx import NVCC

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
    assert "all steps passed" in res.stdout and any(
        line.startswith("SUMMARY") for line in res.stdout.splitlines()[-12:]
    )
    log = (tmp_path / "gpu_check_log.txt").read_text()
    if NVCC is not None:  # the dry run builds as the GPU run does (CMake, nvcc), into its own folder
        assert "CUDA kernels for sm_90 |" in log, log[-3000:]
        assert list((tmp_path / "build/lib/espert").glob("_C*.so"))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tensors"] == 26 and report["parameters"] > 0
    assert set(report["backends"]) == {"cpu"} and "error" not in report["backends"]["cpu"]
    assert report["backends"]["cpu"]["perturb_launches"] == 1  # one multi-tensor call for 26 tensors
    assert set(report["backends"]["cpu"]["families"]) == {"gaussian-icdf", "rademacher"}
    assert report["store"]["member_ms"] > 0 and report["store"]["update_n32_host_s"] > 0
    patch = report["patch"]  # restore="patch" timed next to the copy, and exact
    assert patch["exact"] and patch["patched"] >= 1 and patch["records_per_member"] > 0
    graph = report["cuda_graph"]
    assert all(g["replay_matches_eager"] and g["restored_exactly"] for g in graph.values())
    # issue 21 §1.5: one captured step serves every member by rewriting the staged seed
    assert graph["Prepared perturb-forward-restore, members switched between replays"]["members"] == [True] * 3
    # one pytest process per backend: interpreted Triton, and the CUDA kernels' bodies emulated on the CPU
    assert set(report["tests"]) == {"gpu_tests_triton.xml", "gpu_tests_cuda_emulated.xml"}
    for tests in report["tests"].values():
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
    from espert.ops.checks import geometry

    sz = sizes(cuda)
    for start in sz["long_starts"]:
        geometry(
            torch.empty(sz["long_n"], device="meta"), ops.Block(col_offset=start, logical_cols=start + sz["long_n"])
        )
    for cols, block in blocks(sz).values():
        geometry(torch.empty(sz["rows"], cols, device="meta"), block)


def _gpu_step_limits(text: str) -> tuple[int | None, list[tuple[str, int]]]:
    """(BUDGET_S, [(what, seconds)]) of the GPU (non-dry) path of gpu_check.sh, read from its text: every
    `timeout` and every `run NAME LIMIT`, the per-backend test step once per backend."""
    import re

    gpu = text[text.index('if [ "$DRY" = 0 ]; then\n  # GPU step limits') :]
    gpu_branch = gpu[: gpu.index("\nelse\n")]
    env = {k: int(v) for k, v in re.findall(r"\b(T_[A-Z]+|BUDGET_S)=(\d+)", gpu_branch)}
    backends = re.search(r"BACKENDS=\(([^)]*)\)", gpu_branch).group(1).split()

    def value(tok: str) -> int:
        tok = tok.strip('"')
        return env[tok[1:]] if tok.startswith("$") else int(tok)

    steps = [("timeout " + t, value(t)) for t in re.findall(r"\btimeout (\S+)", gpu_branch)]
    steps += [("check_built", env["T_PRE"])] * len(re.findall(r"^\s*check_built ", gpu_branch, re.M))
    rest = text[text.index("# ---- GPU tests") :]
    for name, limit in re.findall(r'\brun "([^"]+)" (\S+)', rest):
        steps += [(name, value(limit))] * (len(backends) if "$be" in name else 1)
    return env.get("BUDGET_S"), steps


def test_gpu_check_fits_one_device_command():
    """One device command may run at most 600 s: the GPU path's step limits sum to <= 540 s by design (the
    script also cuts each limit to what is left of BUDGET_S).  It was 950 s (300 + 300 + 150 + 200)."""
    text = (ROOT / "bench/gpu_check.sh").read_text()
    assert "# GPU step limits" in text, "gpu_check.sh: the GPU branch must declare its step limits in one place"
    budget, steps = _gpu_step_limits(text)
    total = sum(s for _, s in steps)
    print("\n".join(f"{s:5d} s  {n}" for n, s in steps), f"\n{total:5d} s  total (budget {budget})")
    assert budget is not None and budget <= 540
    assert total <= budget, steps
    assert sum(1 for n, _ in steps if n.startswith("GPU tests")) == 2  # one process per backend


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "bench/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_keeps_earlier_numbers_when_a_section_fails(tmp_path, monkeypatch, capsys):
    """A failing CenterStore section is recorded and the graph section still runs; the kernel numbers
    before it are in the JSON, and the compact summary is the last thing printed."""
    gc = _gpu_check_module()

    class Broken:
        def __init__(self, *a, **k):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    monkeypatch.setattr(gc, "CenterStore", Broken)
    rc = gc.main([str(tmp_path), "--dry-run"])
    assert rc == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["backends"]["cpu"]["perturb_ms"] > 0 and report["backends"]["cpu"]["update_n32_ms"] > 0
    assert "illegal memory access" in report["store"]["error"]
    assert "cuda_graph" in report  # it ran after the failure (and failed the same way: it builds a CenterStore)
    out = capsys.readouterr().out.rstrip().splitlines()
    last = max(i for i, line in enumerate(out) if line.startswith("SUMMARY"))
    assert not any(line.startswith("|") for line in out[last:])  # nothing of the table after the summary
    assert any(line.startswith("store: ERROR") for line in out[last:]) and len(out) - last < 12


def test_gpu_check_writes_its_json_after_every_section(tmp_path, monkeypatch):
    """Killed in the last section (as by the device command's limit): the earlier sections are on disk."""
    gc = _gpu_check_module()

    def killed(device):
        raise KeyboardInterrupt("killed at the limit (simulated)")

    monkeypatch.setattr(gc, "graph_checks", killed)
    with pytest.raises(KeyboardInterrupt):
        gc.main([str(tmp_path), "--dry-run"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["backends"]["cpu"]["perturb_ms"] > 0
    assert report["store"]["member_ms"] > 0 and report["store"]["update_n32_host_s"] > 0
    assert report["ceilings"]["device_copy_ms"] > 0
