"""torch.library: the ops as torch operators, ``torch.ops.espert.es_update_ / perturb_ / restore_``.

torch.compile (fullgraph), CUDA graphs and the profiler see these; the torch-free compiled module
stays underneath.  The schemas mark the mutated weights (``Tensor(a!)[]``), as vLLM's op schemas do,
so functionalization knows the weights change in place.  Arguments travel flattened
(:func:`espert.ops.checks.op_args`: uint64 seeds and keys as their int64 bits, four ints per block).
Each operator runs the eager op, which validates everything before any write.  A meta tensor among real
ones sends a call to the fake kernel (the dispatcher picks the Meta key), which then refuses it
(:func:`espert.ops.checks.check_meta_mix`) instead of returning without writing.  Inside
``torch.compile`` ``espert.ops.perturb_ / es_update_ / restore_`` record these operators themselves.
"""

from __future__ import annotations

import torch

from .checks import check_meta_mix, from_int64, from_op_args
from .core import es_update_many_, perturb_many_, restore_


@torch.library.custom_op("espert::es_update_", mutates_args=("ws",))
def _es_update_op(
    ws: list[torch.Tensor],
    keys: list[int],
    blocks: list[int],
    seeds: torch.Tensor,
    coeffs: torch.Tensor,
    scales: list[float] | None = None,
    noise: str = "gaussian",
    backend: str | None = None,
) -> None:
    """``torch.ops.espert.es_update_``: :func:`es_update_many_` as a torch operator.
    seeds: int64 [N] (uint64 bits) and coeffs: float32 or float64 [N], host tensors, uploaded once per call."""
    if seeds.device.type != "cpu" or coeffs.device.type != "cpu":
        raise ValueError("seeds and coeffs must be host tensors (the op uploads them once per call)")
    # a float seed would be truncated to some integer by tolist(): refuse it, like the Python ops do
    if seeds.dtype != torch.int64 or seeds.dim() != 1:
        raise TypeError(
            f"seeds must be a 1-d int64 tensor (uint64 bits), got {seeds.dtype} of shape {list(seeds.shape)}"
        )
    if coeffs.dtype not in (torch.float32, torch.float64) or coeffs.dim() != 1:
        raise TypeError(
            f"coeffs must be a 1-d float32 or float64 tensor, got {coeffs.dtype} of shape {list(coeffs.shape)}"
        )
    es_update_many_(
        from_op_args(ws, keys, blocks),
        [from_int64(s) for s in seeds.tolist()],
        coeffs.tolist(),
        noise=noise,
        scales=scales,
        backend=backend,
    )


@_es_update_op.register_fake
def _(ws, keys, blocks, seeds, coeffs, scales=None, noise="gaussian", backend=None) -> None:
    check_meta_mix("es_update_", [*ws, seeds, coeffs])
    return None


@torch.library.custom_op("espert::perturb_", mutates_args=("ws",))
def _perturb_op(
    ws: list[torch.Tensor],
    keys: list[int],
    blocks: list[int],
    seed: int,
    sigma: float,
    sign: int = 1,
    scales: list[float] | None = None,
    noise: str = "gaussian",
    backend: str | None = None,
) -> None:
    """``torch.ops.espert.perturb_``: :func:`perturb_many_` as a torch operator (one member: scalars)."""
    perturb_many_(
        from_op_args(ws, keys, blocks), from_int64(seed), sigma, sign, noise=noise, scales=scales, backend=backend
    )


@_perturb_op.register_fake
def _(ws, keys, blocks, seed, sigma, sign=1, scales=None, noise="gaussian", backend=None) -> None:
    check_meta_mix("perturb_", ws)
    return None


@torch.library.custom_op("espert::restore_", mutates_args=("w",))
def _restore_op(w: torch.Tensor, center: torch.Tensor, non_blocking: bool = False) -> None:
    """``torch.ops.espert.restore_``: :func:`restore_` as a torch operator."""
    restore_(w, center, non_blocking=non_blocking)


@_restore_op.register_fake
def _(w, center, non_blocking=False) -> None:
    check_meta_mix("restore_", [w, center])
    return None
