"""The build: the module builds without CUDA.  (The CUDA sources' nvcc compile-check is in
tests/test_cuda_ptx.py.)"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
