"""The build: CUDA sources compile-check with nvcc (exact arithmetic only), and the module also
builds without CUDA."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_cuda_kernel_compiles_to_exact_ptx(tmp_path):
    ptx = tmp_path / "apply.ptx"
    subprocess.run(
        [
            NVCC,
            "-ptx",
            "-arch=sm_90",
            "-std=c++17",
            "-O3",
            "--fmad=false",
            "-DESPERT_WITH_CUDA",
            str(ROOT / "csrc/cuda/apply_cuda.cu"),
            "-o",
            str(ptx),
        ],
        check=True,
        capture_output=True,
    )
    text = ptx.read_text()
    assert "apply_kernel" in text
    # exactness: no fused multiply-add and no approximate division/sqrt in the kernels
    assert not re.search(r"\bfma\.rn\.f32|\bmad\.f32", text)
    assert not re.search(r"\b(div|sqrt|rcp)\.approx", text)
    assert re.search(r"\bdiv\.rn\.f32", text) and re.search(r"\bsqrt\.rn\.f32", text)


def test_cpu_only_build_without_cuda(tmp_path):
    import pybind11

    build = tmp_path / "build"
    build.mkdir()
    env = dict(os.environ)
    subprocess.run(
        [
            "cmake",
            str(ROOT),
            "-G",
            "Ninja",
            "-DESPERT_CUDA=OFF",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={tmp_path}",
        ],
        cwd=build,
        check=True,
        capture_output=True,
        env=env,
    )
    subprocess.run(["cmake", "--build", "."], cwd=build, check=True, capture_output=True)
    out = subprocess.run(
        [sys.executable, "-c", "import _C; print(_C.has_cuda, _C.cpu_isa())"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out[0] == "False" and out[1] in ("avx512", "avx2", "generic")
