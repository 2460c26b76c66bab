"""Exact arithmetic in the GPU code, read from the PTX (no GPU needed): the Triton kernels compiled for
sm_90 by Triton's own compiler, and the CUDA kernels by nvcc.  No fused multiply-add, no approximate
division or square root, and no flush-to-zero (`.ftz`) anywhere: a flushed subnormal changes a bit that
the CPU kernel and the numpy references keep.  Plus Triton's exact floor on the values where `.ftz`
differs, run where Triton runs (interpreter or GPU)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")
#: nvcc's flags as CMakeLists.txt builds the kernels (sm_90 here), for the PTX and SASS checks
NVCC_FLAGS = ["-arch=sm_90", "-std=c++17", "-O3", "--fmad=false", "-DESPERT_WITH_CUDA"]


def triton_compiled(script: str, *args: str, timeout: int = 600):
    """The JSON that ``script`` prints, run in a subprocess without TRITON_INTERPRET (Triton's own
    compiler: under the interpreter @triton.jit returns functions it cannot compile)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


# Compiled in a subprocess: TRITON_INTERPRET=1 (set for the whole CI run) makes @triton.jit return
# interpreted functions, which Triton's compiler cannot take.
TRITON_QUANT_PTX = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from espert.kernels import quant as q

out = {}
for case in json.loads(sys.argv[1]):
    elem, layout, kind, mode, family = case
    shape = q.QuantShape(q._ELEM[elem], q._LAYOUT[layout], q._KIND[kind], q._C.DTYPE_CODES["float32"],
                         q._MODE[mode], q._C.FAMILY_CODES[family], q.UNITS_G[q._LAYOUT[layout]], 256)
    sig = dict(q.SIGNATURE, S="constexpr")
    out["/".join(case)] = triton.compile(ASTSource(fn=q._quant_kernel, signature=sig, constexprs={"S": shape}),
                                         target=GPUTarget("cuda", 90, 32),
                                         options={"enable_fp_fusion": False}).asm["ptx"]
print(json.dumps(out))
"""

QUANT_CASES = [
    ("int8", "nk", "channel", "perturb", "gaussian"),
    ("fp8", "kn", "tensor", "perturb", "rademacher"),
    ("int4", "gptq", "grouped", "master", "lowrank"),
    ("int4", "marlin", "marlin_channel", "naive", "gaussian"),
    ("int8", "nk", "channel", "perturb", "gaussian-icdf"),
]


def assert_exact_ptx(name: str, ptx: str, icdf: bool = False) -> None:
    """No contraction, approximation or flush-to-zero.  The only fused multiply-adds are the ones
    gaussian-icdf's spec makes: tagged by noise.h's ffma (CUDA), or in a Triton gaussian-icdf kernel
    (``icdf``: tl.fma, three per normal)."""
    fma = [ln for ln in ptx.splitlines() if re.search(r"\bfma\.rn\.f32|\bmad\.f32", ln)]
    if icdf:
        assert fma and len(fma) % 3 == 0 and not any("mad" in ln for ln in fma), f"{name}: {len(fma)} fma"
    else:
        untagged = [ln for ln in fma if "espert ffma" not in ln]
        assert not untagged, f"{name}: fused multiply-add {untagged[:3]}"
    assert not re.search(r"\.approx\b", ptx), f"{name}: approximate division or square root"
    ftz = sorted(set(re.findall(r"\b[\w.]*\.ftz[\w.]*", ptx)))
    assert not ftz, f"{name}: flush-to-zero instructions {ftz}"


def test_triton_quant_kernel_ptx_is_exact():
    import json

    ptx = triton_compiled(TRITON_QUANT_PTX, json.dumps(QUANT_CASES))
    assert len(ptx) == len(QUANT_CASES)
    for name, text in ptx.items():
        assert ".entry" in text
        assert_exact_ptx(name, text, icdf=name.endswith("gaussian-icdf"))
        assert re.search(r"\bdiv\.rn\.f32", text), name


def nvcc_ptx(tmp_path: Path, source: str) -> str:
    """PTX of a CUDA source compiled the way the build compiles it (sm_90, no FMA contraction)."""
    return nvcc(tmp_path, source, "-ptx").read_text()


def nvcc(tmp_path: Path, source: str, kind: str) -> Path:
    """``source`` compiled by nvcc with the build's flags (sm_90) to ``kind`` (``-ptx`` or ``-cubin``)."""
    out = tmp_path / (Path(source).stem + "." + kind.lstrip("-"))
    res = subprocess.run([NVCC, kind, *NVCC_FLAGS, str(ROOT / source), "-o", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("source", ["csrc/cuda/apply_cuda.cu", "csrc/cuda/quant_cuda.cu", "csrc/cuda/anchor_cuda.cu"])
def test_cuda_kernels_ptx_has_no_flush_to_zero(tmp_path, source):
    assert_exact_ptx(source, nvcc_ptx(tmp_path, source))


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_cuda_kernel_compiles_to_exact_ptx(tmp_path):
    text = nvcc_ptx(tmp_path, "csrc/cuda/apply_cuda.cu")
    assert "apply_kernel" in text
    # fused multiply-adds in gaussian-icdf's kernels (family 3) only, three per normal
    for entry in re.split(r"\.entry ", text)[1:]:
        name = entry.split("(", 1)[0]
        fmas = len(re.findall(r"\bfma\.rn\.f32", entry))
        icdf = re.search(r"apply_kernelILi\dELi3E", name) is not None
        assert (fmas > 0 and fmas % 3 == 0) if icdf else fmas == 0, (name, fmas)
    # the exact operations are there (not only the forbidden ones absent)
    assert re.search(r"\bdiv\.rn\.f32", text) and re.search(r"\bsqrt\.rn\.f32", text)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_quant_cuda_kernel_compiles_to_exact_ptx(tmp_path):
    text = nvcc_ptx(tmp_path, "csrc/cuda/quant_cuda.cu")
    assert text.count(".entry") >= 24  # 3 modes x (2 x 2 eight-bit + 4 int4 layouts)
    assert re.search(r"\bdiv\.rn\.f32", text) and re.search(r"\bcvt\.rmi\.f32\.f32", text)
    assert ".local" not in text  # everything in registers


# IEEE floor where flush-to-zero differs (negative subnormals), at the sign of zero, at 2^23, inf, NaN
FLOOR_INPUTS = np.array(
    [
        -1e-40,
        -1.4e-45,
        1e-40,
        -0.0,
        0.0,
        -0.5,
        0.5,
        -1.0,
        1.0,
        -2.5,
        2.5,
        -8388607.5,
        8388607.5,
        -8388608.0,
        8388609.0,
        -1e30,
        1e30,
        -np.inf,
        np.inf,
        np.nan,
        -0.999999940,
        12582911.5,
    ],
    dtype=np.float32,
)


def _triton_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return None


try:
    import triton
    import triton.language as tl

    from espert.kernels.quant import _floor

    @triton.jit
    def _floor_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, _floor(tl.load(x_ptr + o, mask=m, other=0.0)), mask=m)
except ImportError:
    _floor_kernel = None


@pytest.mark.skipif(
    _floor_kernel is None or _triton_device() is None, reason="Triton needs a GPU or TRITON_INTERPRET=1"
)
def test_triton_exact_floor():
    dev = _triton_device()
    x = torch.from_numpy(FLOOR_INPUTS).to(dev)
    y = torch.empty_like(x)
    _floor_kernel[(1,)](x, y, x.numel(), BLOCK=32, enable_fp_fusion=False)
    want = np.floor(FLOOR_INPUTS)
    assert np.array_equal(y.cpu().numpy().view(np.uint32), want.view(np.uint32)), (y.cpu().numpy(), want)
