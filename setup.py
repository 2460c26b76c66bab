"""Build espert: the Python package, the Triton kernels in kernels/ (installed as espert.kernels),
and the compiled module espert._C from csrc/ through CMakeLists.txt (pybind11 + ninja)."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
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
    packages=find_packages(include=["espert", "espert.*"]) + ["espert.kernels"],
    package_dir={"espert.kernels": "kernels"},
    ext_modules=[CMakeExtension("espert._C")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["torch>=2.4", "numpy", "safetensors", "tqdm", "pyyaml"],
    extras_require={
        "triton": ["triton>=3.4"],
        "eval": ["transformers", "tokenizers", "matplotlib", "math-verify", "datasets", "gguf"],
        "gguf": ["transformers", "gguf"],  # GGUF base models (espert/runs/gguf.py)
        "vllm": ["vllm"],
        # python -m espert.compare: ES vs GRPO (trl.GRPOTrainer); trl needs accelerate
        "compare": ["trl>=1.16", "accelerate", "transformers", "tokenizers", "matplotlib", "math-verify", "datasets"],
        "dev": ["pytest", "pytest-benchmark", "pybind11>=2.12", "ninja", "cmake>=3.18", "scipy"],
    },
    entry_points={"console_scripts": ["espert=espert.cli:run"]},
)
