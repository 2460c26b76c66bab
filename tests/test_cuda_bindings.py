"""Every CUDA binding of espert._C, called with nothing to do, returns before any CUDA call.

The CUDA kernels are compiled into the CPU machine's build too (.ci/setup, nvcc), so these bindings are
importable here, where there is no GPU and no driver: a call that reached the CUDA runtime would fail
(cudaErrorNoDevice / InsufficientDriver).  The ops never launch an empty call, but a binding that only
works when the ops filter for it would break the first caller that does not.
"""

import numpy as np
import pytest
import torch

from espert import _C

pytestmark = pytest.mark.skipif(not _C.has_cuda, reason="espert._C was built without CUDA kernels")


def test_apply_many_cuda_with_zero_entries_touches_no_cuda():
    assert _C.apply_many_cuda(0, 0, 0, 1, 0, 0, 0) is None
    assert _C.apply_many_cuda(0, 0, 0, 0, 0, 0, 0) is None  # no members either


def test_apply_many_cuda_with_only_empty_rows_touches_no_cuda():
    from espert.ops.plan import FAMILY_CODES, plan_table, units_per_row

    cols = 64
    for family in ("gaussian", "gaussian-icdf", "rademacher"):
        fam = FAMILY_CODES[family]
        upr = int(units_per_row(cols, fam, _C.CUDA_UNIT_GROUPS))
        table = np.ascontiguousarray(plan_table(2, rows=0, cols=cols, dtype=2, family=fam, units_per_row=upr))
        assert _C.apply_many_cuda(table.ctypes.data, 0, 2, 1, 0, 0, 0) is None


@pytest.mark.parametrize("elem, layout", [("int8", "nk"), ("fp8", "kn"), ("int4", "gptq"), ("int4", "marlin")])
def test_quant_cuda_with_zero_elements_touches_no_cuda(elem, layout):
    from espert.quant import ops as qops

    fields = {name: 0 for name in _C.QUANT_FIELDS}
    fields.update(
        elem=qops.ELEM_CODES[elem], layout=qops.LAYOUT_CODES[layout], scale_dtype=qops.SCALE_DTYPE_CODES[torch.float32]
    )
    row = qops._quant_row(**fields)
    assert _C.quant_cuda(row.ctypes.data, 0) is None
