"""Golden vectors of every noise family (tests/golden/families_v1.json; docs/noise.md §5): gaussian,
rademacher and lowrank:r on Blocks, 1-D and 2-D, and at the top of the index space near 2^64.  The
numpy reference regenerates the file exactly, and every backend CI can run (the C++ CPU kernel and
interpreted Triton; tests/test_gpu.py adds CUDA and compiled Triton on a GPU) writes those bits."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from espert import noise, ops

GOLDEN = Path(__file__).parent / "golden" / "families_v1.json"
CASES = json.loads(GOLDEN.read_text())["cases"]
BACKENDS = ["cpu"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available() else [])


def _ids(c):
    return f"{c['family']}-{'x'.join(map(str, c['block'][:2]))}@{c['block'][2]},{c['block'][3]}"


def noise_bits(case, backend, device="cpu"):
    """ε of a golden case as es_update_ with coefficient 1 writes it into float32 zeros (hex strings)."""
    rows, cols, r0, c0, lr, lc = case["block"]
    if rows == 1 and lr == 1:
        w, block = torch.zeros(cols, device=device), ops.Block(col_offset=c0, logical_cols=lc)
    else:
        w, block = torch.zeros(rows, cols, device=device), ops.Block(r0, c0, lr, lc)
    ops.es_update_(w, [case["seed"]], [1.0], case["key"], block=block, backend=backend, noise=case["family"])
    return [f"{int(b):08x}" for b in w.cpu().numpy().reshape(-1).view(np.uint32)]


def test_golden_file_covers_every_family_blocks_and_the_top_of_the_index_space():
    fams = {c["family"] for c in CASES}
    assert {"gaussian", "gaussian-icdf", "rademacher"} <= fams and sum(f.startswith("lowrank:") for f in fams) >= 2
    assert max((c["block"][2] + c["block"][0]) * c["block"][5] for c in CASES) > 2**63  # indices past 2^63
    assert any(c["block"][0] > 1 and (c["block"][2] or c["block"][3]) for c in CASES)  # a 2-D shard


def test_reference_regenerates_the_golden_file():
    assert json.loads(GOLDEN.read_text()) == noise.family_golden_vectors()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backends_write_the_golden_bits(backend, case):
    assert noise_bits(case, backend) == case["noise_hex"]
