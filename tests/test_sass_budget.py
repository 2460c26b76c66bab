"""SASS instruction budget of the perturb/update kernels, measured without a GPU: the CUDA kernels compiled
by nvcc to an sm_90 cubin and the Triton kernel by Triton's own compiler (as tests/test_cuda_ptx.py does
for PTX), disassembled with cuobjdump.  For each kernel the hot loops are found in the SASS (a loop: the
instructions from a backward branch's target to the branch) and counted statically, NOPs excluded:

- update, per member and element: the loop over the members that holds Philox, on the hot path;
- perturb, per element (one member): CUDA: the hot path, whole interior units (inside the row, vector-
  aligned) with vector weight accesses only, either the loop over a thread's groups around the member
  loop (Rademacher) or the member loop and the stores after it (Gaussian); its elements are read off the
  SASS, 4 per vector store.  The row ends run code of their own, not counted (a row has at most two such
  units).  Triton: the whole kernel (one program is one pass, both branches of its store), over
  4·BLOCK / (32·num_warps) elements.

It asserts no local memory (LDL/STL, LOCAL:0), a register ceiling, 64/128-bit weight accesses on the CUDA
hot path, and counts not above the values measured when a kernel last got faster (a regression budget;
the memory-bandwidth goal is 28-31 instructions per element).  No GPU has run these kernels: the counts
are static.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_cuda_ptx import NVCC, nvcc, triton_compiled

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str | None:
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if p.exists():
            return str(p)
    except ImportError:
        pass
    return shutil.which(name)


CUOBJDUMP = _tool("cuobjdump")
pytestmark = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found (comes with Triton's CUDA backend)")

DTYPES = {0: "fp32", 1: "fp16", 2: "bf16"}
FAMILIES = {0: "gaussian", 1: "rademacher", 3: "gaussian-icdf"}
# (backend, dtype, family) -> (perturb per element, update per member and element): measured 2026-12-01
# with nvcc 13 and the Triton in the venv, sm_90; perturb lowered 2026-12-02 (a created NaN narrows to a
# constant, docs/noise.md §3).  Lower them when a kernel gets faster.
# CUDA lowered 2026-12-02 again: __umulhi in Philox, __ldcs/__stcs vector accesses, a hot path over whole
# interior units with no bounds checks (Gaussian: the members outside a thread's 4 groups), and
# Rademacher's Philox calls shared across the warp.
BUDGET = {
    ("cuda", "bf16", "gaussian"): (69.78125, 60.5625),  # 8 groups per thread (was 71.4375, 62.0 with 4)
    ("cuda", "bf16", "rademacher"): (17.5625, 6.125),
    # Triton perturb: the whole kernel (search, prologue, both store branches).  Since 2026-12-02 the aligned
    # interior branch has 128-bit accesses (were 16-bit: 138.375 Gaussian, 96.0 gaussian-icdf); Rademacher's
    # whole-kernel count rose 95.6875 -> 97.9375, its unaligned rows now sharing the masked branch
    ("triton", "bf16", "gaussian"): (135.375, 67.9375),
    ("triton", "bf16", "rademacher"): (97.9375, 35.75),
    # gaussian-icdf (docs/noise.md §5.4), measured 2026-12-02: the goal was <= 35 per element (CUDA)
    ("cuda", "bf16", "gaussian-icdf"): (33.84375, 24.90625),
    ("triton", "bf16", "gaussian-icdf"): (95.4375, 36.375),
}
# Registers per thread.  CUDA Rademacher holds a chunk's 32 sums and its 8 vector loads at once (126-128:
# 2 blocks of 256 threads per SM, 64 B of loads in flight per thread); the normal families 8 groups per thread.
REG_CEILING = {
    ("cuda", "gaussian"): 96,  # 91-94 (8 groups per thread): 5 blocks of 128 threads per SM
    ("cuda", "rademacher"): 128,
    ("cuda", "gaussian-icdf"): 96,  # 84-86: 5 blocks of 128 threads (8 groups each) per SM
    ("triton", "gaussian-icdf"): 128,
    ("triton", "gaussian"): 128,
    ("triton", "rademacher"): 128,
}
GOAL = "28-31"

TRITON_CUBIN = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from espert.kernels import apply as a
out = {}
for dt, fam in json.loads(sys.argv[2]):
    sig = {"plan_ptr": "*i64", "n_entries": "i32", "n_search": "i32", "seeds_ptr": "*i64", "coeffs_ptr": "*fp32",
           "icdf_ptr": "*fp32", "rec_ptr": "*i64", "capacity": "i64", "count_ptr": "*i64"}
    const = dict(DTYPE=dt, FAMILY=fam, BLOCK=a.DEFAULT_BLOCK, F16_HW=a.FP16_HW_CVT, RECORD=False)
    sig.update({c: "constexpr" for c in const})
    k = triton.compile(ASTSource(fn=a._apply_kernel, signature=sig, constexprs=const),
                       target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False, "num_warps": a.NUM_WARPS})
    path = f"{sys.argv[1]}/triton_{dt}_{fam}.cubin"
    open(path, "wb").write(k.asm["cubin"])
    out[f"{dt}/{fam}"] = {"cubin": path, "elems_per_thread": 4 * a.DEFAULT_BLOCK // (32 * a.NUM_WARPS)}
print(json.dumps(out))
"""


def sass_functions(cubin: Path) -> dict[str, dict]:
    """name -> {"ins": [(address, text)], "regs": int, "local": int} of every kernel in a cubin."""
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:\d+ SHARED:\d+ LOCAL:(\d+)", res)
    }
    out = {}
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", chunk)]
        regs, local = usage[name]
        out[name] = {"ins": ins, "regs": regs, "local": local}
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int, int]]:
    """(target, branch address, instructions without NOPs) of every backward branch."""
    out = []
    for a, t in ins:
        m = re.search(r"\bBRA\b[^0-9]*0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            out.append((lo, a, sum(1 for x, s in ins if lo <= x <= a and not s.startswith("NOP"))))
    return out


PHILOX_MUL = r"IMAD\.(HI|WIDE)\.U32"  # Philox4x32-10: 20 per call
SCALAR_ACCESS = r"\b(LD|ST|LDG|STG)\.E(\.U16)?\s"  # a weight element by itself (not .64/.128, not .CONSTANT)


def _count(ins, lp, pattern: str) -> int:
    return sum(1 for a, t in ins if lp[0] <= a <= lp[1] and re.search(pattern, t))


def _innermost(ls):
    return [lp for lp in ls if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in ls)]


def member_loop(ls, ins):
    """The loop over the members: of the loops that contain no other loop, the one with the most Philox
    multiplies (ties: the larger)."""
    return max(_innermost(ls), key=lambda lp: (_count(ins, lp, PHILOX_MUL), lp[2]))


VECTOR_STORE = r"\bSTG\.E(\.EF)?\.(64|128)\b"  # 4 weight elements (bf16/fp16: 64 bits, fp32: 128)


def hot_path(ls, ins):
    """(member loop, instructions on the hot path, elements a thread handles on it) of a CUDA kernel.  The
    hot path runs whole interior units with vector weight accesses only: either the loop around a member
    loop (Rademacher: a loop over interior chunks), or a member loop and the straight code after it up to
    the next unconditional branch (Gaussian: the members outside, a thread's 4 groups stored after them).
    Its elements are 4 per vector store on it.  A kernel has more than one member loop (the row ends
    have their own, with element accesses): at most one of them may be on such a path.  None where the
    store code branches (fp16's software rounding): no straight hot path to count."""
    found = []
    for m in _innermost(ls):
        if _count(ins, m, PHILOX_MUL) < 16:
            continue
        around = [lp for lp in ls if lp != m and lp[0] <= m[0] and m[1] <= lp[1]]
        outer = min(around, key=lambda lp: lp[2]) if around else None
        if outer and _count(ins, outer, SCALAR_ACCESS) == 0 and _count(ins, outer, VECTOR_STORE):
            found.append((m, [t for a, t in ins if outer[0] <= a <= outer[1] and not t.startswith("NOP")]))
            continue
        after = [t for a, t in ins if a > m[1] and not t.startswith("NOP")]
        end = next(k for k, t in enumerate(after) if re.match(r"BRA\b", t))  # unpredicated: the path ends
        tail = after[: end + 1]
        body = [t for a, t in ins if m[0] <= a <= m[1] and not t.startswith("NOP")]
        text = "\n".join(tail)
        if re.search(VECTOR_STORE, text) and not re.search(SCALAR_ACCESS, text):
            found.append((m, body + tail))
    assert len(found) <= 1, f"{len(found)} hot paths found (one expected)"
    if not found:
        return None
    m, path = found[0]
    return m, path, 4 * sum(1 for t in path if re.search(VECTOR_STORE, t))


def _bits(op: str) -> int:
    """Access width of a SASS global load/store opcode (LDG.E.64 -> 64, STG.E.U16 -> 16, LDG.E -> 32)."""
    m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}[m.group(1)] if m else 32


def measure(fn: dict, backend: str, elems: int | None = None) -> dict:
    """Per-element counts of one kernel; elems: a Triton thread's elements (CUDA: read off its hot path)."""
    ins = fn["ins"]
    ls = loops(ins)
    if backend == "cuda":
        hot = hot_path(ls, ins)
        if hot is None:
            return {
                "perturb": None,
                "update": None,
                "regs": fn["regs"],
                "local": fn["local"],
                "ldg_bits": None,
                "stg_bits": None,
            }
        m, path, elems = hot
        perturb = len(path)
        loop = "\n".join(path)
    else:  # one program is one pass: everything but the self-branch at the end
        m = member_loop(ls, ins)
        perturb = sum(1 for a, t in ins if not t.startswith("NOP")) - 1
        # the widest accesses: 128-bit ones are the weights' (the plan's are at most 64, seeds' .CONSTANT)
        loop = "\n".join(t for _, t in ins)
    text = "\n".join(t for _, t in ins)
    # widest global load and store in the perturb loop; .CONSTANT loads are the seeds and coefficients
    width = {
        op: max([_bits(t) for t in re.findall(rf"\b{op}\.E[.\w]*", loop) if "CONSTANT" not in t] or [0])
        for op in ("LDG", "STG")
    }
    return {
        "perturb": perturb / elems,
        "update": m[2] / elems,
        "regs": fn["regs"],
        "local": fn["local"] or len(re.findall(r"\b(LDL|STL)\b", text)),
        "ldg_bits": width["LDG"] or None,
        "stg_bits": width["STG"] or None,
    }


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sass")
    out = {}
    if NVCC is not None:
        cubin = nvcc(tmp, "csrc/cuda/apply_cuda.cu", "-cubin")
        for name, fn in sass_functions(cubin).items():
            m = re.search(r"apply_kernelILi(\d)ELi(\d)ELb0E", name)  # not the recording variants
            if m and int(m.group(2)) in FAMILIES:
                out[("cuda", DTYPES[int(m.group(1))], FAMILIES[int(m.group(2))])] = measure(fn, "cuda")
    try:
        import triton  # noqa: F401

        cases = [(2, 0), (2, 1), (2, 3)]
        for key, v in triton_compiled(TRITON_CUBIN, str(tmp), json.dumps(cases)).items():
            dt, fam = map(int, key.split("/"))
            (fn,) = sass_functions(Path(v["cubin"])).values()
            out[("triton", DTYPES[dt], FAMILIES[fam])] = measure(fn, "triton", v["elems_per_thread"])
    except ImportError:
        pass
    return out


def table(m: dict) -> str:
    lines = [
        "| kernel | backend | SASS instructions / element (static) | budget here | goal (bandwidth) | widest load/store |",
        "|---|---|---|---|---|---|",
    ]
    for (be, dt, fam), v in sorted(m.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        if dt != "bf16":
            continue
        b = BUDGET.get((be, dt, fam))
        bits = f"{v['ldg_bits']}/{v['stg_bits']} bits" if v["ldg_bits"] else "not told apart"
        lines.append(f"| {fam} perturb ({dt}) | {be} | {v['perturb']:.2f} | {b and b[0]} | {GOAL} | {bits} |")
        lines.append(f"| {fam} update, per member ({dt}) | {be} | {v['update']:.2f} | {b and b[1]} | {GOAL} | |")
    return "\n".join(lines)


def test_sass_instruction_budget(measured):
    if not measured:
        pytest.skip("neither nvcc nor Triton available")
    print("\n" + table(measured))
    for key, v in measured.items():
        be = key[0]
        assert v["local"] == 0, f"{key}: local memory (spills) in the SASS"
        ceiling = REG_CEILING[be, key[2]]
        assert v["regs"] <= ceiling, f"{key}: {v['regs']} registers > {ceiling}"
        if key in BUDGET:
            assert v["perturb"] is not None, f"{key}: no hot path found in the SASS"
        if v["perturb"] is not None:
            # CUDA's hot path: 4-element vectors (LDG/STG.E.64, fp32 .128); Triton's aligned interior
            # branch: 16 bytes per access (8 bf16)
            want = 128 if be == "triton" or key[1] == "fp32" else 64
            assert v["ldg_bits"] == v["stg_bits"] == want, (
                f"{key}: weight accesses {v['ldg_bits']}/{v['stg_bits']} bits"
            )
        if key in BUDGET:
            perturb, update = BUDGET[key]
            assert v["perturb"] <= perturb, f"{key}: perturb {v['perturb']:.2f} instructions/element > {perturb}"
            assert v["update"] <= update, f"{key}: update {v['update']:.2f} instructions/element/member > {update}"
    backends = {k[0] for k in measured}
    assert {k for k in BUDGET if k[0] in backends} <= set(measured)  # every budgeted kernel was found
    assert "triton" in backends and ("cuda" in backends or NVCC is None)
