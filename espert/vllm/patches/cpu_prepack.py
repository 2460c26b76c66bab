"""vLLM-CPU prepacks Linear weights; espert keeps the plain weight beside the packed copy and repacks after edits.

At load, vLLM-CPU's ``dispatch_cpu_unquantized_gemm(layer, remove_weight)`` reorders every unquantized
Linear's (and lm_head's) weight into a private oneDNN copy in C++ memory, sets ``layer.cpu_linear`` to a
closure over it and empties ``layer.weight``: an in-place edit would be silently ignored.  :func:`install`
wraps it (before the model loads; vLLM looks the function up at call time): vLLM's own prepack runs
unchanged, the plain ``(N, K)`` Parameter is put back as ``layer.weight`` (the packed kernels ignore it) for
espert's ops to edit, and ``layer.cpu_linear`` becomes a :class:`_LazyLinear` that, once
:class:`~espert.vllm.engine.repack.RepackingCenter` marks it stale, repacks from the live plain weight with
vLLM's own call at its next forward (a restore then the next member's perturb repack once).  The oneDNN
layout is chosen at run time for the CPU's ISA, so there is no stable layout to edit through an index map.
Cost: one more copy of the weights in host memory and a repack per edited layer per weight change.  On GPU
the patch is inert.  docs/vllm.md, "The traps" 1, 5 and 6.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import time
import types
import weakref

import torch

from espert.vllm.patches import on_model_loaded, wrap_once

log = logging.getLogger("espert.vllm")

#: torch's thread count at this process's first prepack; every later prepack runs at it (see pack_threads).
_PACK_THREADS: int | None = None


@contextlib.contextmanager
def pack_threads():
    """Run a oneDNN prepack at the torch thread count of the process's first prepack: a weight packed at
    another thread count computes wrong products (measured on vLLM-CPU 0.32; docs/vllm.md, trap 1).
    torch._C's setter, because an in-process engine makes ``torch.set_num_threads`` a no-op."""
    global _PACK_THREADS
    now = torch.get_num_threads()
    if _PACK_THREADS is None:
        _PACK_THREADS = now
    if now == _PACK_THREADS:
        yield
        return
    torch._C.set_num_threads(_PACK_THREADS)
    try:
        yield
    finally:
        torch._C.set_num_threads(now)


#: glibc's mallopt parameters (malloc.h) and the size up to which freed blocks stay in the heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _KEEP_BYTES = -1, -3, 2**31 - 1
_MALLOC: dict[str, bool] = {}


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks of up to 2 GiB in the heap (its mmap and trim thresholds), once per
    process; True when set now.  A repack's new packed copies then reuse the old ones' pages instead of
    faulting in fresh mappings (a 0.5 B member's repack: two thirds less; docs/vllm.md, trap 1), at the cost
    of the engine keeping its high-water mark.  Left alone when ``GLIBC_TUNABLES`` or an ``LD_PRELOAD``
    allocator already decides, or without glibc."""
    if _MALLOC or os.environ.get("GLIBC_TUNABLES") or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    _MALLOC["done"] = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1
    except (OSError, AttributeError):  # not glibc
        return False
    if ok:
        log.info("espert: glibc malloc keeps freed blocks up to 2 GiB, so repacks reuse memory")
    return ok


#: The repacking layers of this process, by the address of their plain weight (weak references).
_LAYERS: dict[int, "weakref.ref[_LazyLinear]"] = {}


@torch.library.custom_op("espert::cpu_packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The packed GEMM of the layer whose plain weight is ``weight``, repacked first if stale, as one opaque operator.

    Dynamo traced :meth:`_LazyLinear.__call__` once, baking the ``stale`` test and the handler of that moment
    into the graph (edits were silently ignored; docs/vllm.md, trap 5); through this operator the graph holds
    only the call.  The layer is found from its weight, a graph input, so a graph vLLM loads from its cache
    for another engine of the same model finds that engine's layers.
    """
    ref = _LAYERS.get(weight.data_ptr())
    lazy = ref() if ref is not None else None
    if lazy is None or lazy.layer.weight.data_ptr() != weight.data_ptr():
        raise RuntimeError(
            "espert: no repacking layer holds this weight (was the model loaded without espert's patch?)"
        )
    return lazy.run(x, weight, bias)


@_packed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class _LazyLinear:
    """``layer.cpu_linear``: vLLM's packed GEMM, rebuilt from the plain weight first when the layer is stale."""

    def __init__(self, layer: torch.nn.Module, prepack):
        self.layer = layer
        self.prepack = prepack  # vLLM's original dispatch, bound to (layer, remove_weight=False)
        self.packed = None
        self.stale = True
        self.seconds = 0.0  # time spent repacking
        self.repacks = 0
        _LAYERS[layer.weight.data_ptr()] = weakref.ref(self)

    def repack(self) -> None:
        t0 = time.perf_counter()
        layer, mine = self.layer, self.layer.cpu_linear
        with pack_threads():
            self.prepack()  # sets layer.cpu_linear to vLLM's closure over a fresh handler
        self.packed, layer.cpu_linear = layer.cpu_linear, mine
        self.stale = False
        self.seconds += time.perf_counter() - t0
        self.repacks += 1

    def run(self, x, weight, bias):
        if self.stale:
            self.repack()
        return self.packed(x, weight, bias)

    def __call__(self, x, weight, bias):
        if torch.compiler.is_compiling():  # a traced graph must not bake in the handler (see the op above)
            return torch.ops.espert.cpu_packed_linear(x, weight, bias)
        return self.run(x, weight, bias)


def _dispatch(original, layer: torch.nn.Module, remove_weight: bool) -> None:
    keep_freed_memory()  # before the first packed copy: every later repack reuses freed blocks
    w = getattr(layer, "weight", None)
    with pack_threads():
        original(layer, remove_weight)
    if not (isinstance(w, torch.nn.Parameter) and w.dim() == 2 and not w.is_meta):
        return  # meta weights, MoE 3-D weights, conv weights: vLLM's way
    if layer.weight is not w:  # vLLM dropped the plain weight: keep it (the packed kernel ignores it)
        layer.weight = w
    lazy = _LazyLinear(layer, functools.partial(original, layer, False))
    lazy.packed, lazy.stale = layer.cpu_linear, False  # the copy vLLM just packed is current
    layer.cpu_linear = lazy


def install() -> bool:
    """Wrap ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (idempotent); False when vLLM is
    not importable."""
    try:
        from vllm.model_executor.layers import utils as vutils
    except ImportError:  # pragma: no cover - vllm missing
        return False
    if wrap_once(vutils, "dispatch_cpu_unquantized_gemm", _dispatch):
        log.info("espert: vLLM-CPU prepacked weights keep their plain copy and are repacked after edits")
    on_model_loaded(watch)
    return True


#: The methods that hand a model's parameters out (to a loader that may write them through ``p.data``, which
#: bumps no version counter espert could read): each call marks every repacking layer of the model stale.
HANDED_OUT = ("named_parameters", "parameters", "state_dict", "load_state_dict")


def watch(model: torch.nn.Module) -> None:
    """Mark ``model``'s repacking layers stale whenever the model hands its parameters out (:data:`HANDED_OUT`),
    so the next forward repacks them from what was written (ES-at-Scale's ``load_weights_from_disk``).  Only the
    top-level model is watched, with bound methods (the modules vLLM compiles are left as they are); a write
    through a parameter reached another way is not seen.  docs/vllm.md, trap 6."""
    lazy = [m.cpu_linear for _, m in packed_layers(model)]
    for name in HANDED_OUT if lazy else ():
        method = getattr(model, name, None)
        if method is not None and not getattr(method, "_espert_watch", False):
            setattr(model, name, types.MethodType(_handing_out(getattr(type(model), name), lazy), model))


def _handing_out(function, lazy: list):
    @functools.wraps(function)
    def handed_out(self, *args, **kwargs):
        for z in lazy:
            z.stale = True
        return function(self, *args, **kwargs)

    handed_out._espert_watch = True
    return handed_out


def installed() -> bool:
    try:
        from vllm.model_executor.layers import utils as vutils
    except ImportError:  # pragma: no cover
        return False
    return bool(getattr(vutils.dispatch_cpu_unquantized_gemm, "_espert_patched", False))


def packed_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every layer whose GEMM runs on a prepacked copy that espert repacks."""
    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "cpu_linear", None), _LazyLinear)]


def check_model(model: torch.nn.Module) -> None:
    """Raise if any layer of a loaded model computes from a private copy espert cannot refresh: every module with
    a ``cpu_linear`` must use ``F.linear`` on its live ``weight`` or be one of espert's repacking layers with a
    non-empty plain weight.  On GPU (no ``cpu_linear``) a no-op."""
    bad = []
    for name, m in model.named_modules():
        fn = getattr(m, "cpu_linear", None)
        if fn is None:
            continue
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() > 2:  # conv / MoE weights: never selected by espert
            continue
        if w.numel() == 0 or not (fn is torch.nn.functional.linear or isinstance(fn, _LazyLinear)):
            bad.append(name)
    if bad:
        raise RuntimeError(
            f"vLLM-CPU prepacked the weights of {len(bad)} layers ({bad[:3]}...) without espert's repack hook: "
            f"in-place edits would be silently ignored.  espert.vllm.patches.install() must run before the "
            f"model loads (pass worker_extension_cls='espert.vllm.worker.ESWorkerExtension' to LLM(...))"
        )
