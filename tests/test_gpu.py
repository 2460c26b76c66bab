"""GPU checks: the CUDA and Triton kernels bit for bit against the CPU kernel (itself checked against the
numpy reference) and the golden vectors, on aligned and misaligned Blocks, every noise family, the
multi-tensor ops, the quantized layouts, a tensor of more than 2^31 elements and a non-default stream;
plus no hidden device memory.

Run on a GPU machine by bench/gpu_check.sh, with TRITON_INTERPRET=0 (Triton decides at import time
whether its kernels are interpreted).  Without a GPU the module is skipped, except under
ESPERT_GPU_DRY_RUN=1 (``bash bench/gpu_check.sh --dry-run``): then the same tests run on CPU tensors
with small sizes, Triton interpreted (TRITON_INTERPRET=1) and the CUDA kernels' bodies run on the CPU
as the backend ``cuda_emulated`` (tests/cuda_host/emulated.py), so this file cannot rot unseen in CI.
"""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from espert import _C, noise, ops

CUDA = torch.cuda.is_available()
DRY = not CUDA and os.environ.get("ESPERT_GPU_DRY_RUN") == "1"
pytestmark = pytest.mark.skipif(not (CUDA or DRY), reason="needs a CUDA GPU (or ESPERT_GPU_DRY_RUN=1)")
DEV = "cuda" if CUDA else "cpu"
if CUDA:
    GPU_BACKENDS = ["triton"] + (["cuda"] if _C.has_cuda else [])
else:  # dry run: Triton where it can run on CPU tensors, and the CUDA kernels' bodies emulated on the CPU
    GPU_BACKENDS = ["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else []
    if DRY:
        from cuda_host import emulated

        if emulated.CXX is not None:
            emulated.register()  # ops backend "cuda_emulated" (tests/cuda_host/emulated.py)
            GPU_BACKENDS.append("cuda_emulated")
if os.environ.get("ESPERT_GPU_BACKENDS"):  # bench/gpu_check.sh runs one pytest process per backend
    GPU_BACKENDS = [b for b in GPU_BACKENDS if b in os.environ["ESPERT_GPU_BACKENDS"].split(",")]
KEY = noise.param_key("model.layers.7.self_attn.o_proj.weight")


def sizes(cuda: bool) -> dict:
    """The sizes of the GPU run (cuda=True) and of the dry run: tests/test_gpu_check.py checks the geometry
    of both on CPU, since size decides validity (a Block past 2^64 elements is refused)."""
    rows, cols, aligned = (1000, 4099, 4096) if cuda else (3, 259, 256)  # dry run: ~4 ms per interpreted program
    long_n = (1 << 20) + 7 if cuda else 263
    return dict(
        rows=rows,
        cols=cols,
        aligned_cols=aligned,
        members=[1, 32] if cuda else [1, 3],
        long_n=long_n,
        long_starts=[0, 3, 2**40 + 5, 2**64 - long_n - 1],  # the last: the run ends at index 2^64 - 2
    )


SIZES = sizes(CUDA)
ROWS, COLS, ALIGNED_COLS, MEMBERS = SIZES["rows"], SIZES["cols"], SIZES["aligned_cols"], SIZES["members"]

backends = pytest.mark.parametrize("backend", GPU_BACKENDS)


def _bits(t):
    t = t.cpu()
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _weights(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(dtype)
    # zeros of both signs, a subnormal, NaN and inf: every backend must store a NaN's own bits
    special = torch.tensor([0.0, -0.0, 1e-40, float("nan"), float("inf"), -3e-39]).to(dtype)
    w.view(-1)[:6] = special[: w.numel()]
    # NaNs with their own bits (signaling, negative with a payload): the GPU kernels must keep them, as the
    # CPU kernel does (tests/test_ops.py), not write a canonical NaN
    nans = {
        torch.float32: ([0x7F800001, -0x003EDCBB], torch.int32),  # sNaN; 0xFFC12345
        torch.float16: ([0x7C01, -0x01A3], torch.int16),  # sNaN; 0xFE5D
        torch.bfloat16: ([0x7F81, -0x005D], torch.int16),  # sNaN; 0xFFA3
    }[dtype]
    flat = w.view(-1).view(nans[1])
    n = min(2, max(0, w.numel() - 6))
    flat[6 : 6 + n] = torch.tensor(nans[0][:n], dtype=nans[1])
    return w


# Blocks: the aligned whole tensor (16-byte vector loads on the GPU, what real models take), an aligned
# shard at an offset, and misaligned shards whose rows start inside a Philox group.
def blocks(sz: dict) -> dict:
    rows, cols, aligned = sz["rows"], sz["cols"], sz["aligned_cols"]
    return {
        "aligned": (aligned, None),
        "aligned-shard": (
            aligned,
            ops.Block(row_offset=8, col_offset=2 * aligned, logical_rows=rows + 8, logical_cols=3 * aligned),
        ),
        "misaligned": (cols, ops.Block(5, 3, rows + 5, cols + 5)),
        "misaligned-row": (cols, None),  # cols % 4 != 0: every row after the first starts mid-group
    }


BLOCKS = blocks(SIZES)


@backends
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", MEMBERS)
@pytest.mark.parametrize("where", list(BLOCKS))
def test_gpu_matches_cpu_bitwise(backend, dtype, n, where):
    cols, block = BLOCKS[where]
    w = _weights(ROWS, cols, dtype)
    seeds, coeffs = list(range(100, 100 + n)), list(np.linspace(-1e-3, 1e-3, n))
    cpu = w.clone()
    ops.es_update_(cpu, seeds, coeffs, KEY, block=block, backend="cpu")
    gpu = w.clone().to(DEV)
    ops.es_update_(gpu, seeds, coeffs, KEY, block=block, backend=backend)
    assert torch.equal(_bits(gpu), _bits(cpu))
    assert not torch.equal(_bits(gpu), _bits(w))


@backends
def test_gpu_golden_normals(backend):
    golden = json.loads((Path(__file__).parent / "golden" / "noise_v1.json").read_text())
    for case in golden["cases"]:
        n = len(case["normal_bits"])
        w = torch.zeros(n, device=DEV)
        ops.es_update_(
            w,
            [case["seed"]],
            [1.0],
            case["key"],
            block=ops.Block(col_offset=case["start"], logical_cols=case["start"] + n),
            backend=backend,
        )
        assert w.cpu().numpy().view(np.uint32).tolist() == case["normal_bits"]


@backends
def test_gpu_golden_families(backend):
    """Every noise family's golden vectors (tests/golden/families_v1.json) on the GPU backends."""
    from test_golden_families import CASES, noise_bits

    for case in CASES:
        assert noise_bits(case, backend, DEV) == case["noise_hex"], (case["family"], case["block"])


@backends
@pytest.mark.parametrize("start", SIZES["long_starts"])
def test_gpu_normals_long_runs_match_reference(backend, start):
    """Long runs (the golden vectors hold <= 64 elements), unaligned starts, the top of the index space."""
    n = SIZES["long_n"]
    w = torch.zeros(n, device=DEV)
    ops.es_update_(
        w, [2**64 - 1], [1.0], KEY, block=ops.Block(col_offset=start, logical_cols=start + n), backend=backend
    )
    want = noise.normal(2**64 - 1, KEY, np.arange(n, dtype=np.uint64) + np.uint64(start))
    assert np.array_equal(w.cpu().numpy().view(np.uint32), want.view(np.uint32))


@backends
@pytest.mark.parametrize("family", ["gaussian-icdf", "rademacher", "lowrank:1", "lowrank:4"])
@pytest.mark.parametrize("where", ["aligned", "misaligned"])
def test_gpu_noise_families_match_cpu(backend, family, where):
    cols, block = BLOCKS[where]
    w = _weights(ROWS, cols, torch.bfloat16, seed=1)
    seeds, coeffs = [7, 2**63 + 1, 11], [1e-3, -2e-3, 5e-4]
    cpu = w.clone()
    ops.es_update_(cpu, seeds, coeffs, KEY, block=block, backend="cpu", noise=family)
    gpu = w.clone().to(DEV)
    ops.es_update_(gpu, seeds, coeffs, KEY, block=block, backend=backend, noise=family)
    assert torch.equal(_bits(gpu), _bits(cpu))


@backends
@pytest.mark.parametrize("family", ["gaussian", "gaussian-icdf", "rademacher", "lowrank:2"])
def test_gpu_multi_tensor_matches_cpu(backend, family):
    """One call over a model-like list: matrices, vectors, odd shapes, a shard, every dtype."""
    shapes = [(64, 96), (96,), (33, 7), (5, 1000), (1,), (128, 64)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    ws = [_weights(*(s if len(s) == 2 else (1, s[0])), dtypes[i % 3], seed=i).reshape(s) for i, s in enumerate(shapes)]
    keys = [noise.param_key(f"p{i}") for i in range(len(ws))]
    blocks = [None] * len(ws)
    blocks[3] = ops.Block(row_offset=2, col_offset=24, logical_rows=9, logical_cols=1100)
    cpu = [w.clone() for w in ws]
    gpu = [w.clone().to(DEV) for w in ws]
    ops.perturb_many_(list(zip(cpu, keys, blocks)), 9, 2e-3, -1, noise=family, backend="cpu")
    ops.perturb_many_(list(zip(gpu, keys, blocks)), 9, 2e-3, -1, noise=family, backend=backend)
    for c, g in zip(cpu, gpu):
        assert torch.equal(_bits(g), _bits(c))


@backends
@pytest.mark.parametrize("family", ["gaussian", "gaussian-icdf", "rademacher", "lowrank:2"])
def test_gpu_patch_restore_matches_cpu(backend, family):
    """restore="patch": the recording perturb lists as many elements as the CPU's (the records hold device
    addresses) into pinned host memory on a GPU, and subtraction + the list gives back every bit."""
    shapes = [(64, 96), (96,), (33, 7), (5, 1000)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    ws = [_weights(*(s if len(s) == 2 else (1, s[0])), dtypes[i % 3], seed=i).reshape(s) for i, s in enumerate(shapes)]
    keys = [noise.param_key(f"p{i}") for i in range(len(ws))]
    counts = []
    for be, dev in (("cpu", "cpu"), (backend, DEV)):
        live = [w.clone().to(dev) for w in ws]
        items = list(zip(live, keys, [None] * len(ws)))
        patch = ops.PatchList(sum(w.numel() for w in ws), dev)
        assert patch.records.device.type == "cpu" and patch.records.is_pinned() == (dev == "cuda")
        ops.perturb_many_(items, 9, 1e-2, 1, noise=family, backend=be, record=patch)
        counts.append(patch.misses())
        assert ops.restore_patched_many_(items, 9, 1e-2, 1, patch, noise=family, backend=be)
        for w, x in zip(ws, live):
            assert torch.equal(_bits(x), _bits(w))
    assert counts[1] == counts[0] > 0


# ---- quantized kernels ------------------------------------------------------------------------------

Q_CASES = [
    ("int8", {}),
    ("int8", {"per_tensor": True}),
    ("fp8", {}),
    ("fp8", {"scale_dtype": torch.bfloat16}),
    ("gptq", {}),
    ("awq", {}),
    ("cpu_w4a16", {}),
    ("marlin", {}),
    ("marlin", {"group": -1}),
]


@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS])
@pytest.mark.parametrize("mode", ["perturb", "master", "naive"])
@pytest.mark.parametrize("fmt,kw", Q_CASES, ids=[f"{f}-{'-'.join(map(str, k.values()))}" for f, k in Q_CASES])
def test_gpu_quantized_match_cpu(backend, mode, fmt, kw):
    from espert import ops
    from espert.quant import quantize_weight
    from espert.quant.center import initial_master

    kw = dict(kw)
    group = kw.pop("group", 32)
    n, k = (256, 512) if CUDA else (64, 64)
    base = quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.02, fmt, group, **kw)

    def run(qw, be):
        master = initial_master(qw) if mode == "master" else None
        if mode == "perturb":
            ops.perturb_(qw, 5, KEY, 2e-3, -1, backend=be)
        else:
            ops.es_update_(qw, [1, 2**64 - 1, 3], [3e-3, -2e-3, 1e-3], KEY, master=master, backend=be)
        return qw, master

    want, m_want = run(base.clone(), "cpu")
    moved = dataclasses.replace(base.clone(), qweight=base.qweight.clone().to(DEV), scales=base.scales.clone().to(DEV))
    got, m_got = run(moved, backend)
    assert torch.equal(got.qweight.cpu().view(torch.uint8), want.qweight.view(torch.uint8))
    if mode == "master":
        assert torch.equal(m_got.cpu().view(torch.int32), m_want.view(torch.int32))


@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS])
@pytest.mark.parametrize("fmt", ["marlin", "gptq"])
def test_gpu_int4_piece_of_wider_storage_matches_cpu(backend, fmt):
    """A fused layer's piece on a GPU (vLLM's Marlin qkv: output channels [64, 192) of 256) is a column slice of
    the layer's words with the layer's row stride: edited like the CPU kernel edits it, the rest untouched."""
    from espert import ops
    from espert.ops import Block
    from espert.quant import QuantWeight, quantize_weight

    k = 512 if CUDA else 64
    full = quantize_weight(torch.randn(256, k, generator=torch.Generator().manual_seed(4)) * 0.02, fmt, 32)
    per = 2 if fmt == "marlin" else 1
    lo, hi = 64 * per, 192 * per

    def run(words, be):
        qw = QuantWeight(fmt, words[:, lo:hi], full.scales[:, 64:192].contiguous().to(words.device), 128, k, 32)
        ops.perturb_(qw, 5, KEY, 2e-3, -1, block=Block(64, 0, 256, k), backend=be)
        return words.cpu()

    want = run(full.qweight.clone(), "cpu")
    got = run(full.qweight.clone().to(DEV), backend)
    assert torch.equal(got, want) and not torch.equal(want[:, lo:hi], full.qweight[:, lo:hi])
    assert torch.equal(got[:, :lo], full.qweight[:, :lo]) and torch.equal(got[:, hi:], full.qweight[:, hi:])


# ---- sizes, streams, devices, memory (GPU only) -----------------------------------------------------

gpu_only = pytest.mark.skipif(not CUDA, reason="GPU only")


@gpu_only
@backends
def test_gpu_beyond_2_31_elements(backend):
    """Indices and pointer offsets past 2^31 elements (4 GiB of bf16): the tail gets its own noise."""
    n = (1 << 31) + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 2 * n * 2 + (1 << 30):
        pytest.skip(f"needs {2 * n * 2 >> 30} GiB of free device memory, {free >> 30} GiB free")
    w = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    ops.perturb_(w, 77, KEY, 1e-2, backend=backend)
    for start in (0, (1 << 31) - 2050, n - 4096):
        got = w[start : start + 4096].cpu().view(torch.int16).numpy().view(np.uint16)
        want = noise.perturb_reference(
            np.zeros(4096, np.uint16), "bfloat16", 77, KEY, 1e-2, col_offset=start, logical_cols=n
        )
        assert np.array_equal(got, want), start
    del w
    torch.cuda.empty_cache()


@gpu_only
@backends
def test_gpu_non_default_stream(backend):
    """Kernels are enqueued on the caller's current stream, after the work already queued there."""
    w0 = _weights(ROWS, ALIGNED_COLS, torch.bfloat16)
    want = w0.clone()
    ops.perturb_(want, 4, KEY, 1e-3, backend="cpu")
    big = torch.randn(1 << 26, device="cuda")  # queue a long kernel first, so an unordered launch would race
    src = w0.cuda()
    w = torch.empty_like(src)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(20):
            big.mul_(1.0)
        w.copy_(src)
        ops.perturb_(w, 4, KEY, 1e-3, backend=backend)
    s.synchronize()
    assert torch.equal(_bits(w), _bits(want))


@gpu_only
@backends
def test_gpu_ops_run_on_the_weights_device(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    w0 = _weights(64, 256, torch.bfloat16)
    want = w0.clone()
    ops.perturb_(want, 4, KEY, 1e-3, backend="cpu")
    w = w0.to("cuda:1")
    with torch.cuda.device(0):
        ops.perturb_(w, 4, KEY, 1e-3, backend=backend)
    torch.cuda.synchronize(1)
    assert torch.equal(_bits(w), _bits(want))


@gpu_only
@backends
def test_no_hidden_device_memory(backend):
    w = torch.zeros(1 << 29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    center = torch.zeros(w.shape, dtype=torch.float32)  # host
    ops.perturb_(w, 1, KEY, 1e-3, backend=backend)  # warm-up: compile, load
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ops.perturb_(w, 2, KEY, 1e-3, backend=backend)
    ops.es_update_(w, list(range(32)), [1e-4] * 32, KEY, backend=backend)
    ops.restore_(w, center)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= (64 << 20) + (1 << 20), extra  # restore_ stages <= 64 MiB; the ops' own uploads are O(N)
    assert torch.count_nonzero(w) == 0
