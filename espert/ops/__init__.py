"""The one op surface: in-place perturb, exact restore and the fused ES update.

Every op validates its arguments completely before any backend touches memory, so a bad call
raises and leaves the weights untouched.  Backends are registered in ``BACKENDS`` with a capability
gate; ``backend=None`` picks the default for the tensor's device (``ESPERT_BACKEND`` overrides it):

    cpu     C++ kernels in espert._C (AVX-512, AVX2 or generic, chosen at run time)
    cuda    CUDA kernels in espert._C (when the module was built with nvcc)
    triton  Triton kernels in espert/kernels/ (GPU; CPU tensors only under TRITON_INTERPRET=1)

All three compute the same bits: see docs/noise.md.  The multi-tensor ops
(:func:`es_update_many_`, :func:`perturb_many_`) take a whole list of tensors and build one launch
plan per call (an int64 table, one row per tensor): one C++ call with one OpenMP region on CPU; on
CUDA and Triton one host-to-device copy of seeds, coefficients and the table, and one launch per
(dtype, family) present.  The single-tensor ops are thin wrappers over them.  ``COUNTERS`` /
:func:`counting` count kernel launches and host-to-device copies.  Quantized weights
(``espert.quant.QuantWeight``: int8, FP8, int4 GPTQ/AWQ/Marlin) go through the same three ops,
dispatched by layout to the lattice kernels of ``espert.quant`` (docs/quantized.md).  Inside
``torch.compile(fullgraph=True)`` the ops record their ``torch.ops.espert`` operators.

The package: :mod:`.checks` (argument rules, :class:`Block`), :mod:`.plan` (the typed plan row and
the launch plan), :mod:`.backends` (the registry and the runners), :mod:`.core` (the ops),
:mod:`.prepared` (a call planned once, for CUDA graphs), :mod:`.patch` (restore="patch": a perturb's
patch list) and :mod:`.torch_ops` (the torch operators).  Bounded temporaries: ``plan.STAGING_BYTES``
(tests and tuning set it there; every op reads it when it runs).
"""

from __future__ import annotations

from . import plan  # noqa: F401  (espert.ops.plan: the plan row, and STAGING_BYTES)
from .backends import (
    BACKENDS,
    COUNTERS,
    Backend,
    available_backends,
    counting,
    default_backend,
    lowrank_stage,
    register_quant_runner,
    sync_cpu_threads,
)
from .checks import (
    DTYPE_CODES,
    U64,
    Block,
    as_int64,
    check_members,
    check_scale,
    check_sigma,
    check_sign,
    check_u64,
    op_args,
)
from .core import (
    WeightType,
    cast_exact_,
    es_update_,
    es_update_many_,
    perturb_,
    perturb_many_,
    register_weight_type,
    restore_,
    restore_patched_many_,
)
from .patch import PatchList
from .plan import FAMILY_CODES, PLAN_DTYPE, PLAN_FIELDS, plan_table, units_per_row
from .prepared import Prepared
from .torch_ops import _es_update_op, _perturb_op, _restore_op  # noqa: F401  (registers torch.ops.espert.*)

__all__ = [
    "BACKENDS",
    "COUNTERS",
    "DTYPE_CODES",
    "FAMILY_CODES",
    "PLAN_DTYPE",
    "PLAN_FIELDS",
    "U64",
    "Backend",
    "Block",
    "PatchList",
    "Prepared",
    "WeightType",
    "as_int64",
    "available_backends",
    "cast_exact_",
    "check_members",
    "check_scale",
    "check_sigma",
    "check_sign",
    "check_u64",
    "counting",
    "default_backend",
    "es_update_",
    "es_update_many_",
    "lowrank_stage",
    "op_args",
    "perturb_",
    "perturb_many_",
    "plan_table",
    "register_quant_runner",
    "register_weight_type",
    "restore_",
    "restore_patched_many_",
    "sync_cpu_threads",
    "units_per_row",
]
