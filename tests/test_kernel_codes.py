"""The quantized kernels' enum codes live in csrc/quant.h only: espert._C exports them, Python and
Triton derive theirs, and the C++ entry points reject a code they do not know (before, an unknown
element kind, layout or mode fell through a `default:` into another code's kernel)."""

import numpy as np
import pytest

from espert import _C

EXPORTS = {
    "QUANT_ELEM_CODES": {"int8", "fp8", "int4"},
    "QUANT_LAYOUT_CODES": {"nk", "kn", "gptq", "awq", "cpu_w4a16", "marlin"},
    "QUANT_SCALE_KIND_CODES": {"tensor", "channel", "grouped", "marlin_grouped", "marlin_channel"},
    "QUANT_MODE_CODES": {"perturb", "master", "naive"},
}


def test_codes_are_exported_once_and_distinct():
    for name, keys in EXPORTS.items():
        codes = getattr(_C, name)
        assert set(codes) == keys, name
        assert len(set(codes.values())) == len(codes), name
    assert set(_C.QUANT_UNIT_GROUPS) == EXPORTS["QUANT_LAYOUT_CODES"]


def test_python_tables_derive_from_the_exports():
    from espert.quant import ops as qops

    assert qops.ELEM_CODES == _C.QUANT_ELEM_CODES
    assert qops.LAYOUT_CODES == _C.QUANT_LAYOUT_CODES
    assert qops.SCALE_KINDS == _C.QUANT_SCALE_KIND_CODES
    assert qops.MODES == _C.QUANT_MODE_CODES


def test_triton_codes_derive_from_the_exports():
    pytest.importorskip("triton")
    from espert.kernels import quant as kq

    assert kq._ELEM == _C.QUANT_ELEM_CODES and kq._LAYOUT == _C.QUANT_LAYOUT_CODES
    assert kq._KIND == _C.QUANT_SCALE_KIND_CODES and kq._MODE == _C.QUANT_MODE_CODES
    assert kq.UNITS_G == {_C.QUANT_LAYOUT_CODES[k]: g for k, g in _C.QUANT_UNIT_GROUPS.items()}
    assert int(kq.FP8) == _C.QUANT_ELEM_CODES["fp8"] and int(kq.MARLIN) == _C.QUANT_LAYOUT_CODES["marlin"]


E, L, S, M = _C.QUANT_ELEM_CODES, _C.QUANT_LAYOUT_CODES, _C.QUANT_SCALE_KIND_CODES, _C.QUANT_MODE_CODES
F = _C.FAMILY_CODES
VALID = dict(
    elem=E["int8"], layout=L["nk"], scale_dtype=0, scale_kind=S["channel"], mode=M["perturb"], family=F["gaussian"]
)
BAD = [
    (dict(elem=7), "element kind code 7"),
    (dict(elem=-1), "element kind code -1"),
    (dict(layout=9), "layout code 9"),
    (dict(elem=E["int4"], layout=L["nk"]), "does not hold element kind"),  # an int8 layout for int4 codes
    (dict(layout=L["gptq"]), "does not hold element kind"),  # an int4 layout for int8 codes
    (dict(scale_kind=5), "scale kind code 5"),
    (dict(scale_dtype=3), "scale dtype code 3"),
    (dict(mode=3), "mode code 3"),
    (dict(family=9), "noise family code 9"),
    (dict(family=F["lowrank"]), "lowrank"),  # lowrank without rank and staged factors
]


def test_quant_row_is_built_from_the_exported_field_names():
    from espert.quant import ops as qops

    assert len(_C.QUANT_FIELDS) == 26 and len(set(_C.QUANT_FIELDS)) == 26
    fields = {name: i + 1 for i, name in enumerate(_C.QUANT_FIELDS)}
    fields["key"] = 2**64 - 1  # unsigned fields keep their bit patterns
    row = qops._quant_row(**fields)
    assert row.dtype == np.int64 and row[:-1].tolist() == list(range(1, 26)) and row.view(np.uint64)[-1] == 2**64 - 1
    with pytest.raises(ValueError, match="missing or unknown"):
        qops._quant_row(**dict(fields, extra=0))
    del fields["key"]
    with pytest.raises(ValueError, match="missing or unknown"):
        qops._quant_row(**fields)


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_cpu_kernel_rejects_unknown_codes_untouched(change, message):
    from espert.quant import ops as qops

    a = dict(VALID, **change)
    codes = np.arange(256, dtype=np.uint8)  # [4, 64] int8 codes (or [4, 16] int32 words)
    before = codes.copy()
    scales = np.full(64, 0.01, np.float32)
    master = np.zeros(256, np.float32)
    seeds, coeffs = np.array([5], np.uint64), np.array([1.0], np.float32)
    row = qops._quant_row(
        codes=codes.ctypes.data,
        elem=a["elem"],
        layout=a["layout"],
        N=4,
        K=64,
        ld=64,
        row_offset=0,
        col_offset=0,
        logical_cols=64,
        scales=scales.ctypes.data,
        scale_dtype=a["scale_dtype"],
        scale_kind=a["scale_kind"],
        group=64,
        scale_ld=4,
        master=master.ctypes.data,
        mode=a["mode"],
        family=a["family"],
        rank=0,  # lowrank only
        stage_a=0,  # staged A' (lowrank only)
        stage_b=0,  # staged B^T (lowrank only)
        qmin_bits=np.float32(-128.0).view(np.int32),
        qmax_bits=np.float32(127.0).view(np.int32),
        seeds=seeds.ctypes.data,
        coeffs=coeffs.ctypes.data,
        n=1,
        key=3,
    )
    with pytest.raises(ValueError, match=message):
        _C.quant_cpu(row.ctypes.data)
    assert np.array_equal(codes, before)


def test_units_per_row_is_the_ops_formula():
    """_C.units_per_row (csrc/apply.h: the CPU tiles, the CUDA launch) equals the units_per_row that
    espert.ops writes into a launch plan (``ops.plan.units_per_row``), over families, widths and unit sizes."""
    from espert.ops import plan

    cols = np.array(sorted(set(range(0, 3000)) | {2**k + d for k in range(12, 40) for d in (-255, -1, 0, 1, 127)}))
    for family in F.values():
        for unit_groups in (1, 3, 16, 64, 256, 1024, getattr(_C, "CUDA_UNIT_GROUPS", 1024)):
            want = plan.units_per_row(cols, np.full(len(cols), family), unit_groups).tolist()
            got = [_C.units_per_row(family, int(c), unit_groups) for c in cols]
            assert got == want, (family, unit_groups)
