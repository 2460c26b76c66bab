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
from typing import Iterable, Sequence

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


def torch_param_views(
    module: torch.nn.Module, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> list[ParamView]:
    """ParamViews of a plain torch module (transformers models included): one per parameter, identity layout.

    include / exclude: glob patterns on the parameter name (``*embed_tokens*``) or exact name
    components (``norm``); a parameter is kept if it matches some include (all, when None) and no
    exclude.  Tied parameters (same storage) appear once, under their first name.
    Raises ValueError when a selected parameter has a dtype the ops do not support, or when the
    filters select nothing.
    """
    views, seen = [], set()
    for name, p in module.named_parameters(remove_duplicate=True):
        if include and not matches(name, include):
            continue
        if exclude and matches(name, exclude):
            continue
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.dtype not in DTYPE_CODES:
            raise ValueError(
                f"parameter {name} has dtype {p.dtype}; espert perturbs float32/float16/bfloat16 only "
                f"(exclude it, or see the quantized formats)"
            )
        # detach(), not .data: the view shares the parameter's autograd version counter, so an in-place
        # op on it makes backward() through stale activations fail loudly instead of silently
        views.append(ParamView(name, p.detach()))
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
