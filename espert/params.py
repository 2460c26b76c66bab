"""Param maps: a model -> the list of ParamViews, the only thing the ops see.

A ParamView is one logical parameter (named as in the checkpoint, e.g.
``model.layers.0.self_attn.q_proj.weight``) or a block of it, and the live tensor
that holds that block.  The logical name fixes the noise key, the block fixes the
logical element indices, so a weight gets the same noise whether it lives in a
plain torch module, in a fused vLLM parameter or in a tensor-parallel shard.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from espert.noise import param_key
from espert.ops import DTYPE_CODES, Block


@dataclass(frozen=True)
class LogicalParam:
    """A logical (checkpoint) parameter name and the noise key it fixes: ``key = param_key(name)``."""

    name: str
    key: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "key", param_key(self.name))


@dataclass(frozen=True)
class ParamView(LogicalParam):
    """One logical parameter (or a block of it) and the live tensor that holds it.

    name: logical (checkpoint) name, the source of the noise key.
    tensor: the live weight block (a view into the model's storage; edited in place).
    block: where ``tensor`` sits inside the logical parameter (None: it is all of it).
    """

    tensor: torch.Tensor
    block: Block | None = None

    @property
    def numel(self) -> int:
        return self.tensor.numel()


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``name`` matches a glob pattern (``*embed_tokens*``) or equals one of its dot-separated
    components (``norm``, ``bias``)."""
    return any(fnmatch.fnmatchcase(name, p) or p in name.split(".") for p in patterns)


def checkpoint_layout(module: torch.nn.Module) -> Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """``(runtime name, tensor) -> [(checkpoint name, view of tensor)]`` for a torch module's parameters.

    transformers 5 renames and fuses some checkpoint tensors at load, by the model's conversion mapping
    (``transformers.conversion_mapping``): a mixture of experts' ``experts.{e}.gate_proj.weight`` and
    ``experts.{e}.up_proj.weight`` ``[I, H]`` become one ``experts.gate_up_proj`` ``[E, 2I, H]``, its
    ``experts.{e}.down_proj.weight`` one ``experts.down_proj`` ``[E, H, I]``, and Mixtral's ``block_sparse_moe``
    is renamed ``mlp``.  The noise key is the checkpoint name, so each fused parameter is cut back into the
    views its checkpoint tensors are, with the names transformers' own reverse mapping gives them (as
    ``save_pretrained`` writes them): rows ``[k·R/n, (k+1)·R/n)`` of expert ``e`` for the ``k``-th of ``n``
    concatenated names.  A conversion other than these stacks and concatenations raises ValueError naming the
    parameter.  Modules that are not transformers models, or that transformers converts nothing of, keep
    their parameter names.
    """
    convert = _reverse_conversions(module)
    if convert is None:
        return lambda name, t: [(name, t)]
    renamings, converters = convert

    def layout(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import rename_source_key

        ckpt, fused = rename_source_key(name, renamings, converters, reverse=True)
        if fused is None:
            return [(ckpt, t)]
        conv = next(c for c in converters if fused in c.source_patterns)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in conv.operations]
        names = [ckpt.replace(conv.target_patterns[0], p) for p in conv.target_patterns]
        n = len(names)
        if ops not in ([("SplitModulelist", 0)], [("Chunk", 1), ("SplitModulelist", 0)]) or t.dim() != 3:
            raise ValueError(
                f"{name}: transformers converts it by {ops}, which espert does not map to checkpoint names"
            )
        if t.shape[1] % n or (n > 1 and ops[0][0] != "Chunk"):
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not split into {n} checkpoint tensors {names}")
        rows = t.shape[1] // n
        return [
            (nm.replace("*", str(e)), t[e, k * rows : (k + 1) * rows])
            for e in range(t.shape[0])
            for k, nm in enumerate(names)
        ]

    return layout


def _reverse_conversions(module: torch.nn.Module):
    """``(renamings, converters)``: transformers' reverse of the conversion mapping ``module`` was loaded with
    (as ``revert_weight_conversion`` builds it), or None when there is none."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:
        return None
    if not isinstance(module, PreTrainedModel):
        return None
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is None:  # built, not loaded: the model's registered mapping, as save_pretrained uses it
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = [
            c for c in get_model_conversion_mapping(module, add_legacy=False) if not isinstance(c, PrefixChange)
        ]
    if not conversions:
        return None
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    return [c for c in reverse if isinstance(c, WeightRenaming)], [c for c in reverse if isinstance(c, WeightConverter)]


def torch_param_views(
    module: torch.nn.Module, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> list[ParamView]:
    """ParamViews of a torch module (transformers models included), named by checkpoint names: one per parameter,
    or one per checkpoint tensor of a parameter transformers fused at load (:func:`checkpoint_layout`).

    include / exclude: glob patterns on the checkpoint name (``*embed_tokens*``) or exact name
    components (``norm``); a parameter is kept if it matches some include (all, when None) and no
    exclude.  Tied parameters (same storage) appear once, under their first name.
    Raises ValueError when a selected parameter has a dtype the ops do not support, or when the
    filters select nothing.
    """
    views, seen = [], set()
    to_checkpoint = checkpoint_layout(module)
    for runtime_name, p in module.named_parameters(remove_duplicate=True):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        # detach(), not .data: the view shares the parameter's autograd version counter, so an in-place
        # op on it makes backward() through stale activations fail loudly instead of silently
        for name, t in to_checkpoint(runtime_name, p.detach()):
            if (include and not matches(name, include)) or (exclude and matches(name, exclude)):
                continue
            if p.dtype not in DTYPE_CODES:
                raise ValueError(
                    f"parameter {name} has dtype {p.dtype}; espert perturbs float32/float16/bfloat16 only "
                    f"(exclude it, or see the quantized formats)"
                )
            views.append(ParamView(name, t))
    if not views:
        raise ValueError(f"no parameters selected (include={include}, exclude={exclude})")
    return views


def total_numel(views: Iterable[ParamView]) -> int:
    return sum(v.numel for v in views)


def lora_carried(model: torch.nn.Module, views: Sequence[ParamView]) -> list[ParamView]:
    """The views a vLLM LoRA adapter carries, for ``vllm_members: batched`` (:mod:`espert.vllm.engine.lora`): the
    weights of ``nn.Linear`` layers with more than one output row, except the output embeddings (lm_head).
    Embeddings, norms and biases are left out.  The torch side of the rule (replay, exports): tests check it
    selects what vLLM's LoRA layers hold."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = {
        m.weight.data_ptr()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not out_emb and m.weight.dim() == 2 and m.weight.shape[0] > 1
    }
    return [v for v in views if v.tensor.dim() == 2 and v.tensor.data_ptr() in linear]
