"""SASS instruction budget of the perturb/update kernels, measured without a GPU: the CUDA kernels compiled
by nvcc to an sm_90 cubin and the Triton kernel by Triton's own compiler (as tests/test_cuda_ptx.py does
for PTX, with the 16-byte pointer alignment a launch specializes on), disassembled with cuobjdump.  For each
kernel the hot loops are found in the SASS (a loop: the instructions from a backward branch's target to the
branch) and counted statically, NOPs excluded, the same way on both backends:

- update, per member and element: the loop over the members that holds Philox, on the hot path;
- perturb, per element (one member): the hot path, whole interior units (inside the row, vector-aligned)
  with vector weight accesses only: either the loop around the member loop (CUDA Rademacher: a loop over
  interior chunks; Triton: its loop over a unit's chunks), or the member loop and the straight stores after
  it (CUDA Gaussian).  Its elements are read off the SASS: the bytes of its vector stores over the element
  size.  The row ends run code of their own, not counted (a row has at most two such units); nor is the
  per-unit setup (plan search, row and key), which a unit of 4096 elements shares on both backends.

It asserts no local memory (LDL/STL, LOCAL:0), a register ceiling, 64/128-bit weight accesses on the hot
path, and counts not above the values measured when a kernel last got faster (a regression budget; the
memory-bandwidth goal is 28-31 instructions per element).  No GPU has run these kernels: the counts are
static.
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
    # Triton since 2026-12-03, counted as CUDA is (the hot path, was the whole kernel: 135.375, 97.9375 and
    # 95.4375 perturb): units of 4096 elements in chunks, Philox's multiplies as one IMAD.WIDE.U32, Rademacher
    # one Philox call per 32 elements, bf16 added as 32-bit words, gaussian-icdf's row in one 16-byte load
    # (update was 67.9375, 35.75, 36.375)
    ("triton", "bf16", "gaussian"): (77.9375, 64.0),
    ("triton", "bf16", "rademacher"): (18.15625, 5.96875),
    ("triton", "bf16", "gaussian-icdf"): (43.1875, 29.1875),
    # gaussian-icdf (docs/noise.md §5.4), measured 2026-12-02
    ("cuda", "bf16", "gaussian-icdf"): (33.84375, 24.90625),
}
# Issue 21's targets (instructions per element; update: per member too), for both backends; the table says
# which are met.  The memory-bandwidth goal on an H200 is GOAL.
TARGET = {
    ("gaussian", "perturb"): 70,
    ("gaussian", "update"): 66,
    ("rademacher", "perturb"): 28,
    ("rademacher", "update"): 8,
    ("gaussian-icdf", "perturb"): 35,
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
    const = a.constexprs(dt, fam)
    sig = dict(a.SIGNATURE, **{c: "constexpr" for c in const})
    # as a launch specializes them: torch's allocations are 16-byte aligned
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(a.SIGNATURE.values()) if t.startswith("*")}
    k = triton.compile(ASTSource(fn=a._apply_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False, "num_warps": a.NUM_WARPS})
    path = f"{sys.argv[1]}/triton_{dt}_{fam}.cubin"
    open(path, "wb").write(k.asm["cubin"])
    out[f"{dt}/{fam}"] = path
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


VECTOR_STORE = r"\bSTG\.E(\.EF)?\.(64|128)\b"  # bf16/fp16: 4 or 8 weight elements, fp32: 4 (128 bits)


def _vector_elements(path: list[str], elem_bytes: int) -> int:
    return sum(int(m.group(2)) // (8 * elem_bytes) for t in path if (m := re.search(VECTOR_STORE, t)))


def hot_path(ls, ins, elem_bytes: int):
    """(member loop, instructions on the hot path, elements a thread handles on it) of a kernel.  The hot
    path runs whole interior units with vector weight accesses only: either the loop around a member loop
    (CUDA Rademacher: a loop over interior chunks; Triton: a unit's chunks), or a member loop and the
    straight code after it up to the next unconditional branch or exit (CUDA Gaussian: the members outside,
    a thread's groups stored after them).  Its elements: the bytes of its vector stores over
    ``elem_bytes``.  A kernel has more than one member loop (the row ends have their own, with element
    accesses): at most one of them may be on such a path.  None where the store code branches (fp16's
    software rounding): no straight hot path to count."""
    found = []
    for m in _innermost(ls):
        if _count(ins, m, PHILOX_MUL) < 16:
            continue
        around = [lp for lp in ls if lp != m and lp[0] <= m[0] and m[1] <= lp[1]]
        outer = min(around, key=lambda lp: lp[2]) if around else None
        if outer:
            rest = [t for a, t in ins if outer[0] <= a <= outer[1] and not m[0] <= a <= m[1]]
            if not any(re.search(SCALAR_ACCESS, t) for t in rest) and any(re.search(VECTOR_STORE, t) for t in rest):
                found.append((m, [t for a, t in ins if outer[0] <= a <= outer[1] and not t.startswith("NOP")]))
                continue
        after = [t for a, t in ins if a > m[1] and not t.startswith("NOP")]
        end = next(k for k, t in enumerate(after) if re.match(r"(BRA|EXIT)\b", t))  # unpredicated: the path ends
        tail = after[: end + 1]
        body = [t for a, t in ins if m[0] <= a <= m[1] and not t.startswith("NOP")]
        text = "\n".join(tail)
        if re.search(VECTOR_STORE, text) and not re.search(SCALAR_ACCESS, text):
            found.append((m, body + tail))
    assert len(found) <= 1, f"{len(found)} hot paths found (one expected)"
    if not found:
        return None
    m, path = found[0]
    return m, path, _vector_elements(path, elem_bytes)


def _bits(op: str) -> int:
    """Access width of a SASS global load/store opcode (LDG.E.64 -> 64, STG.E.U16 -> 16, LDG.E -> 32)."""
    m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}[m.group(1)] if m else 32


ELEM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def measure(fn: dict, dtype: str) -> dict:
    """Per-element counts of one kernel on its hot path (None where it has none)."""
    ins = fn["ins"]
    ls = loops(ins)
    text = "\n".join(t for _, t in ins)
    out = {"regs": fn["regs"], "local": fn["local"] or len(re.findall(r"\b(LDL|STL)\b", text))}
    hot = hot_path(ls, ins, ELEM_BYTES[dtype])
    if hot is None:
        return dict(out, perturb=None, update=None, ldg_bits=None, stg_bits=None)
    m, path, elems = hot
    # the weights' widest load and store on the hot path outside the member loop (.CONSTANT loads: seeds and
    # coefficients; gaussian-icdf's table loads are inside the member loop)
    body = {t for a, t in ins if m[0] <= a <= m[1]}
    weights = "\n".join(t for t in path if t not in body)
    width = {
        op: max([_bits(t) for t in re.findall(rf"\b{op}\.E[.\w]*", weights) if "CONSTANT" not in t] or [0])
        for op in ("LDG", "STG")
    }
    return dict(
        out,
        perturb=len(path) / elems,
        update=m[2] / elems,
        ldg_bits=width["LDG"] or None,
        stg_bits=width["STG"] or None,
    )


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sass")
    out = {}
    if NVCC is not None:
        cubin = nvcc(tmp, "csrc/cuda/apply_cuda.cu", "-cubin")
        for name, fn in sass_functions(cubin).items():
            m = re.search(r"apply_kernelILi(\d)ELi(\d)ELb0E", name)  # not the recording variants
            if m and int(m.group(2)) in FAMILIES:
                dt = DTYPES[int(m.group(1))]
                out[("cuda", dt, FAMILIES[int(m.group(2))])] = measure(fn, dt)
    try:
        import triton  # noqa: F401

        cases = [(2, 0), (2, 1), (2, 3)]
        for key, cubin in triton_compiled(TRITON_CUBIN, str(tmp), json.dumps(cases)).items():
            dt, fam = map(int, key.split("/"))
            (fn,) = sass_functions(Path(cubin)).values()
            out[("triton", DTYPES[dt], FAMILIES[fam])] = measure(fn, DTYPES[dt])
    except ImportError:
        pass
    return out


def table(m: dict) -> str:
    lines = [
        "| kernel | backend | SASS instructions / element (static) | budget here | issue 21's target | widest load/store |",
        "|---|---|---|---|---|---|",
    ]
    for (be, dt, fam), v in sorted(m.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        if dt != "bf16":
            continue
        b = BUDGET.get((be, dt, fam))
        bits = f"{v['ldg_bits']}/{v['stg_bits']} bits" if v["ldg_bits"] else "not told apart"
        for k, (op, what) in enumerate((("perturb", "perturb"), ("update", "update, per member"))):
            t = TARGET.get((fam, op))
            goal = f"{t}: {'met' if v[op] <= t else 'missed'}" if t else ""
            lines.append(f"| {fam} {what} ({dt}) | {be} | {v[op]:.2f} | {b and b[k]} | {goal} | {'' if k else bits} |")
    return "\n".join(lines) + f"\n(memory-bandwidth goal on an H200: {GOAL} per element)"


def test_sass_instruction_budget(measured, record_property):
    if not measured:
        pytest.skip("neither nvcc nor Triton available")
    record_property("table", table(measured))  # printed at the end of the run (tests/conftest.py)
    for key, v in measured.items():
        be = key[0]
        assert v["local"] == 0, f"{key}: local memory (spills) in the SASS"
        ceiling = REG_CEILING[be, key[2]]
        assert v["regs"] <= ceiling, f"{key}: {v['regs']} registers > {ceiling}"
        if key in BUDGET:
            assert v["perturb"] is not None, f"{key}: no hot path found in the SASS"
        if v["perturb"] is not None:
            # vectors of 4 elements or more: 64 bits (bf16/fp16) or 128
            want = (128,) if key[1] == "fp32" else (64, 128)
            assert v["ldg_bits"] == v["stg_bits"] and v["ldg_bits"] in want, (
                f"{key}: weight accesses {v['ldg_bits']}/{v['stg_bits']} bits"
            )
        if key in BUDGET:
            perturb, update = BUDGET[key]
            assert v["perturb"] <= perturb, f"{key}: perturb {v['perturb']:.2f} instructions/element > {perturb}"
            assert v["update"] <= update, f"{key}: update {v['update']:.2f} instructions/element/member > {update}"
    backends = {k[0] for k in measured}
    assert {k for k in BUDGET if k[0] in backends} <= set(measured)  # every budgeted kernel was found
    assert "triton" in backends and ("cuda" in backends or NVCC is None)


# Anchored weight decay (csrc/cuda/anchor_kernel.cuh): a grid-stride loop, memory-bound (master read and
# written, anchor read: 10 B per element in bf16).  Its hot loop is the one with the most stores (nvcc
# unrolls it); counted per stored element.  Measured 2026-12-04, nvcc 13, sm_90, with the norm a template
# parameter (it was a runtime argument: 24.75 bf16, 23.75 fp32, 37.75 fp16, either norm); fp16's anchor
# load converts in software.  (dtype, norm) -> SASS instructions per element.
ANCHOR_BUDGET = {
    ("fp32", "l2"): 16.75,
    ("fp32", "l1"): 20.25,
    ("fp16", "l2"): 36.75,
    ("fp16", "l1"): 40.5,
    ("bf16", "l2"): 17.25,
    ("bf16", "l1"): 21.75,
}


def anchor_per_element(fn: dict) -> float:
    """Instructions per stored element of the loop with the most global stores (NOPs excluded)."""
    ins = fn["ins"]
    best = max(
        ((lp[2], sum(1 for a, t in ins if lp[0] <= a <= lp[1] and re.search(r"\bSTG\b", t))) for lp in loops(ins)),
        key=lambda c: c[1],
    )
    assert best[1] > 0, "no loop that stores"
    return best[0] / best[1]


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_anchor_kernel_sass_budget(tmp_path, record_property):
    fns = sass_functions(nvcc(tmp_path, "csrc/cuda/anchor_cuda.cu", "-cubin"))
    seen = {}
    for name, fn in fns.items():
        m = re.search(r"anchor_kernelILi(\d)ELi(\d)E", name)
        assert m, f"{name}: an anchor kernel without its dtype and norm as template parameters"
        key = (DTYPES[int(m.group(1))], ("l2", "l1")[int(m.group(2))])
        assert fn["local"] == 0, f"{key}: local memory (spills) in the SASS"
        assert fn["regs"] <= 32, f"{key}: {fn['regs']} registers > 32"
        seen[key] = anchor_per_element(fn)
    record_property("table", "anchor_decay_ SASS instructions per element: " + ", ".join(
        f"{dt} {norm} {v:.2f} (budget {ANCHOR_BUDGET[dt, norm]})" for (dt, norm), v in sorted(seen.items())
    ))  # fmt: skip
    assert set(seen) == set(ANCHOR_BUDGET)
    for key, v in seen.items():
        assert v <= ANCHOR_BUDGET[key], f"{key}: {v:.2f} instructions/element > {ANCHOR_BUDGET[key]}"
