"""vLLM-CPU's LoRA kernels, as GEMMs over the slots (the batched members of :mod:`espert.vllm.engine.lora`).

vLLM's CPU punica ops (vllm/lora/ops/torch_ops) gather every token's adapter, ``w[idx]`` of
[tokens, rank, in], and multiply token by token: on a 46 M model that makes one LoRA generate 2.5x
slower than plain generation (measured, bench/population.py), most of it in ``aten::index``.  espert's
members arrive in runs (a member's requests in a row), so each run is a view of the activations and
runs of one length are one batched GEMM; scattered tokens take one GEMM against all K slots at once
([tokens, in] @ [in, K·r]) and a pick of each token's block.  Same float32 math, another summation
order; tokens with index -1 (no adapter) get zero.
"""

from __future__ import annotations

import weakref

import torch

from espert.vllm.patches import replace_once

#: id of a LoRA layer's stacked buffer -> (a weak reference to it, the rank espert's slots use in it: the
#: columns past it stay zero, :class:`LoraSlots` resets every slot and writes only r), so a lowrank:4
#: population does not pay for vLLM's smallest allowed max_lora_rank of 8.  Other buffers are used whole;
#: the weak reference keeps a freed buffer's id (reused by a new tensor) from matching.
USED_RANK: dict[int, tuple] = {}


def _slot_weights(buf: torch.Tensor, rank_dim: int, dtype=None) -> torch.Tensor:
    """A stacked slot buffer as [K, a, b] (vLLM's [K, 1, a, b] squeezed), in ``dtype``, its rank axis
    (1 for lora_a's [K, r, in], 2 for lora_b's [K, out, r]) cut to the rank espert's slots use (USED_RANK)."""
    w = buf.squeeze(1) if buf.dim() == 4 else buf
    hit = USED_RANK.get(id(buf))
    if hit is not None and hit[0]() is buf:
        w = w.narrow(rank_dim, 0, hit[1])
    return w if dtype is None else w.to(dtype)


#: the last token -> slot indices (their bytes: vLLM makes them under inference mode, which keeps no version
#: counter) and K, with their runs: all layers of a forward step share them, so they are found once a step
_RUNS: dict[str, tuple] = {}


def _runs(indices: torch.Tensor, k: int):
    """``(slots, run lengths, slot tensor)`` when the tokens come in runs, one per slot (how espert's members
    arrive: a member's requests in a row), else None (scattered tokens, or tokens without an adapter).  Then
    a run is a view of the activations: equal runs are one batched GEMM ([slots, G, in] @ [slots, in, r]),
    unequal ones (a prefill chunk that cuts the last member) one small GEMM each, with no copy."""
    key = (k, indices.dtype, indices.cpu().numpy().tobytes())
    if _RUNS.get("key") == key:
        return _RUNS["value"]
    value = None
    if indices.numel() and bool((indices >= 0).all()):
        used, counts = torch.unique_consecutive(indices, return_counts=True)
        if used.numel() == torch.unique(used).numel():
            value = (used.tolist(), counts.tolist(), used)
    _RUNS.update(key=key, value=value)
    return value


def _run_gemms(x: torch.Tensor, w: torch.Tensor, runs) -> torch.Tensor:
    """``x[t] @ w[slot(t)]ᵀ`` over the runs of :func:`_runs`: x [T, a], w [K, b, a] -> [T, b].  Consecutive
    runs of one length are one batched GEMM on a view; a run on its own (a cut member) one GEMM."""
    slots, counts, used = runs
    out = x.new_empty(x.shape[0], w.shape[1])
    i = start = 0
    while i < len(slots):
        j = i
        while j + 1 < len(slots) and counts[j + 1] == counts[i]:
            j += 1
        n, g = j - i + 1, counts[i]
        rows = slice(start, start + n * g)
        if n == 1:
            torch.mm(x[rows], w[slots[i]].t(), out=out[rows])
        else:  # espert's slots are filled in order, so the slots of a block are usually a slice: no gather
            ws = w[slots[i] : slots[j] + 1] if slots[j] - slots[i] == j - i else w[used[i : j + 1]]
            out[rows] = torch.bmm(x[rows].reshape(n, g, -1), ws.transpose(1, 2)).reshape(n * g, -1)
        start, i = start + n * g, j + 1
    return out


def cpu_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0) -> None:
    """``output[t] = scaling · lora_a[indices[t]] @ inputs[t]``: inputs [T, in], lora_a [K, (1,) r, in],
    output [T, ≥r].  Replaces vLLM's ``bgmv_shrink``: tokens in runs per slot go through per-run GEMMs on
    views (:func:`_run_gemms`); scattered tokens through one GEMM against all K slots at once.  The
    arguments are named as vLLM names them (its shrink calls lora_a ``lora_b_weights``), so a call by
    keyword reaches the same one."""
    lora_a, output, indices = lora_b_weights, output_tensor, lora_indices_tensor
    w = _slot_weights(lora_a, 1, output.dtype)
    k, r, _ = w.shape
    t = inputs.shape[0]
    x = inputs.to(output.dtype)
    runs = _runs(indices, k)
    if runs is not None:
        picked = _run_gemms(x, w, runs)
    else:
        every = (x @ w.reshape(k * r, -1).t()).view(t, k, r)
        picked = every[torch.arange(t, device=inputs.device), indices.clamp(min=0)]
        picked = picked.masked_fill((indices < 0)[:, None], 0)
    output[:, :r] = scaling * picked


#: id of a lora_b buffer -> (a weak reference to it, its version, the [out, K·r] matrix of all slots):
#: rebuilt only after a fill (an in-place write bumps the version)
_EXPAND_CACHE: dict[int, tuple] = {}


def _all_slots_b(lora_b: torch.Tensor, dtype) -> torch.Tensor:
    w = _slot_weights(lora_b, 2)
    k, out, r = w.shape
    hit = _EXPAND_CACHE.get(id(lora_b))
    if hit is not None and hit[0]() is lora_b and hit[1] == lora_b._version and hit[2].dtype == dtype:
        if hit[2].shape == (out, k * r):
            return hit[2]
    flat = w.permute(1, 0, 2).reshape(out, k * r).to(dtype).contiguous()
    _EXPAND_CACHE[id(lora_b)] = (weakref.ref(lora_b), lora_b._version, flat)
    return flat


def _expand(inputs, lora_b, indices, dtype) -> torch.Tensor:
    k = lora_b.shape[0]
    runs = _runs(indices, k)
    if runs is not None:
        w = _slot_weights(lora_b, 2, dtype)
        return _run_gemms(inputs[:, : w.shape[2]].to(dtype), w, runs)
    t = inputs.shape[0]
    w = _all_slots_b(lora_b, dtype)
    r = w.shape[1] // k
    spread = torch.zeros(t, k, r, dtype=dtype, device=inputs.device)
    rows = torch.arange(t, device=inputs.device)
    ok = indices >= 0
    spread[rows[ok], indices[ok]] = inputs[ok, :r].to(dtype)
    return spread.view(t, k * r) @ w.t()


def cpu_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True) -> None:
    """``output[t] (+)= lora_b[indices[t]] @ inputs[t]``: inputs [T, r], lora_b [K, (1,) out, r], with the GEMMs
    of :func:`cpu_shrink`.  Replaces vLLM's ``bgmv_expand`` (same padding and broadcast rules, same names)."""
    output = output_tensor
    outputs = _expand(inputs, lora_b_weights, lora_indices_tensor, output.dtype)
    limit = 1 if outputs.shape[0] == 1 and output.shape[0] != 1 else output.shape[0]
    n = min(outputs.shape[1], output.shape[1])
    if add_inputs:
        output[:, :n] += outputs[:limit, :n]
    else:
        output[:, :n] = outputs[:limit, :n]


def cpu_expand_slice(
    inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int, slice_size: int, add_inputs=True
) -> None:
    """:func:`cpu_expand` into ``output[:, slice_offset : slice_offset + slice_size]``."""
    output = output_tensor
    outputs = _expand(inputs, lora_b_weights, lora_indices_tensor, output.dtype)
    if add_inputs:
        output[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output[:, slice_offset : slice_offset + slice_size] = outputs


_INSTALLED = False
#: vLLM's own ops, as they were before :func:`install` (tests compare against them)
VLLM_OPS: dict[str, object] = {}


def install() -> None:
    """Route vLLM's CPU LoRA ops (decode and, through them, prefill) to espert's versions above.  Idempotent;
    GPU platforms keep vLLM's punica kernels."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # a vLLM without these modules: its own kernels stay
        return
    VLLM_OPS.update({name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")})
    replace_once(lora_ops, "bgmv_shrink", cpu_shrink)
    replace_once(lora_ops, "bgmv_expand", cpu_expand)
    replace_once(lora_ops, "bgmv_expand_slice", cpu_expand_slice)
    replace_once(punica_cpu, "bgmv_shrink", cpu_shrink)  # punica_cpu imported vLLM's by name
    replace_once(punica_cpu, "bgmv_expand", cpu_expand)
    replace_once(punica_cpu, "bgmv_expand_slice", cpu_expand_slice)
    _INSTALLED = True
