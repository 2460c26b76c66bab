"""The build: the module builds without CUDA.  (The CUDA sources' nvcc compile-check is in
tests/test_cuda_ptx.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.extended  # ESPERT_SLOW=1 (a full build, ~45 s of CPU): by default .ci/install_check builds the
# CPU-only module (`pip install .` with ESPERT_CUDA=0) and a newcomer's `bash .ci/setup` does too
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


def _setup_py(monkeypatch) -> dict:
    """setup.py's namespace (its classes), without running setup()."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    return runpy.run_path(str(ROOT / "setup.py"), run_name="espert_setup")


def _build_py(ns: dict, lib: Path, editable: bool):
    from setuptools.dist import Distribution

    dist = Distribution({"name": "espert", "packages": ["espert"]})
    dist.script_name = str(ROOT / "setup.py")
    cmd = ns["BuildPy"](dist)
    cmd.initialize_options()
    cmd.build_lib, cmd.editable_mode = str(lib), editable
    cmd.finalize_options()
    return cmd


def test_an_editable_install_builds_without_a_traceback_and_a_wheel_records_its_commit(tmp_path, monkeypatch):
    # pip install -e . runs build_py in editable mode into a build folder it leaves empty: writing
    # build_lib/espert/_build.py there raised FileNotFoundError (a 40-line traceback, exit code 0)
    monkeypatch.chdir(ROOT)
    ns = _setup_py(monkeypatch)
    (tmp_path / "editable").mkdir()
    _build_py(ns, tmp_path / "editable", editable=True).run()
    assert list((tmp_path / "editable").iterdir()) == []  # the checkout's git answers `espert env`
    _build_py(ns, tmp_path / "wheel", editable=False).run()
    assert 'GIT_COMMIT = "' in (tmp_path / "wheel/espert/_build.py").read_text()


def test_an_in_tree_build_is_kept_unless_the_compilers_changed(tmp_path, monkeypatch):
    """.ci/setup rebuilt espert._C from scratch on every run (93 s with CUDA): an in-tree build keeps its
    CMake cache and objects (ninja recompiles what changed); other compilers mean a fresh configure."""
    ns = _setup_py(monkeypatch)
    prepare = ns["_prepare_build_dir"]
    (tmp_path / "CMakeCache.txt").write_text("CMAKE_COMMAND:INTERNAL=/usr/bin/true\n")
    (tmp_path / "build.ninja").write_text("")
    (tmp_path / "espert-build.txt").write_text("c++: g++ 14\nargs: -DESPERT_CUDA=OFF")
    assert not prepare(tmp_path, "c++: g++ 14\nargs: -DESPERT_CUDA=OFF")  # nothing to configure
    assert prepare(tmp_path, "c++: g++ 14\nargs: -DESPERT_CUDA=ON")  # other flags: configure again...
    assert (tmp_path / "CMakeCache.txt").exists()  # ...over the same cache and objects
    assert prepare(tmp_path, "c++: g++ 15\nargs: -DESPERT_CUDA=OFF")  # another compiler: from scratch
    assert not (tmp_path / "CMakeCache.txt").exists()
