"""vLLM's runtime layout -> ParamViews with logical (checkpoint) names and Blocks.

vLLM fuses checkpoint parameters (the model's ``packed_modules_mapping``: ``qkv_proj``, ``gate_up_proj``,
a mixture of experts' ``w13_weight``) and shards them under tensor parallelism.  The noise key comes from
the logical name and the noise index from the logical element (docs/noise.md), so every live tensor is
described as :class:`Piece` s, row ranges of the local tensor that are a block of one logical parameter:
transformers, vLLM TP=1 and TP=k then draw the same ε for the same logical element.  The layout of each
vLLM layer (vllm 0.32 ``layers/linear.py``, ``vocab_parallel_embedding.py``, ``RoutedExperts``): the table
in docs/vllm.md, "Logical noise for vLLM's layouts".

A parameter that cannot be mapped (another quantization method, an unknown fused linear, other expert
layers, added LoRA vocabulary, a prepacked (empty) weight) raises :class:`LayoutError` naming it; nothing
is silently skipped.  :func:`linear_pieces` and :func:`vocab_pieces` take plain numbers, so the TP>1
layouts are unit-tested with shards built by hand (tests/test_vllm_params.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from espert.ops import DTYPE_CODES, Block
from espert.params import ParamView, matches
from espert.quant.checkpoint import logical_shapes, quantization_config, weight_scheme
from espert.quant.formats import marlin_bias_order
from espert.tensorfile import checkpoint_files, read_header
from espert.vllm.patches import releases
from espert.vllm.patches.moe_prepack import expert_plain


class LayoutError(ValueError):
    """A vLLM parameter whose runtime layout espert cannot map to logical (checkpoint) coordinates."""


@dataclass(frozen=True)
class Piece:
    """Local rows ``[start, stop)`` of a live tensor = a block of logical parameter ``name``: × all local
    columns at ``block`` in the logical ``[R, C]`` matrix; of a 1-D tensor (a bias, a norm weight), elements
    forming one row at column offset ``block.col_offset`` of ``[1, C]``."""

    name: str
    start: int
    stop: int
    block: Block


# ---- pure layout rules (no vLLM needed) --------------------------------------------------------


@dataclass(frozen=True)
class LinearLayout:
    """A vLLM linear layer's tensor-parallel geometry: the layer attributes of the same names
    (vllm 0.32 ``layers/linear.py``); what a layer lacks keeps the default."""

    tp_rank: int = 0
    tp_size: int = 1
    output_sizes: Sequence[int] | None = None  # merged: the fused outputs' logical sizes
    num_heads: int | None = None  # qkv: this rank's heads, and the model's
    num_kv_heads: int | None = None
    total_num_heads: int | None = None
    total_num_kv_heads: int | None = None
    head_size: int | None = None
    v_head_size: int | None = None
    num_kv_head_replicas: int = 1

    @classmethod
    def of(cls, module) -> "LinearLayout":
        return cls(**{f.name: getattr(module, f.name, f.default) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class _Local:
    """The live tensor a linear layer's pieces cut: its name and shape (a 1-D bias is one row)."""

    name: str
    rows: int
    cols: int
    is_bias: bool

    def piece(
        self, name: str, start: int, stop: int, logical_rows: int, row_offset: int, col_offset=0, logical_cols=None
    ):
        if self.is_bias:  # a 1-D tensor is one row: the logical offset is a column offset
            return Piece(name, start, stop, Block(0, row_offset, 1, logical_rows))
        return Piece(name, start, stop, Block(row_offset, col_offset, logical_rows, logical_cols or self.cols))


def linear_pieces(
    kind: str, vllm_name: str, local_shape: Sequence[int], logical_names: Sequence[str] | None = None, **layer
) -> list[Piece]:
    """Pieces of one parameter (weight ``[N, K]`` or bias ``[N]``) of a vLLM linear layer.

    kind: ``"replicated" | "column" | "merged" | "qkv" | "row"``.  vllm_name: the live parameter's name.
    logical_names: checkpoint names of the fused outputs, in order (``[q, k, v]`` or ``[gate, up]``), for
    ``merged``/``qkv``.  layer: the attributes of :class:`LinearLayout` (``tp_rank=``, ``tp_size=`` ...).
    """
    is_bias = len(local_shape) == 1
    t = _Local(vllm_name, int(local_shape[0]), 1 if is_bias else int(local_shape[1]), is_bias)
    lay = LinearLayout(**layer)
    if kind == "replicated" or (kind == "row" and is_bias):  # a row-parallel bias lives whole on every rank
        return [t.piece(vllm_name, 0, t.rows, t.rows, 0)]
    if kind == "row":
        return [t.piece(vllm_name, 0, t.rows, t.rows, 0, lay.tp_rank * t.cols, t.cols * lay.tp_size)]
    if kind == "column":
        return [t.piece(vllm_name, 0, t.rows, t.rows * lay.tp_size, lay.tp_rank * t.rows)]
    if kind == "merged":
        return _merged_pieces(t, lay, logical_names)
    if kind == "qkv":
        return _qkv_pieces(t, lay, logical_names)
    raise LayoutError(f"{vllm_name}: unknown linear kind {kind!r}")


def _merged_pieces(t: _Local, lay: LinearLayout, logical_names) -> list[Piece]:
    sizes = lay.output_sizes
    if sizes is None or logical_names is None or len(logical_names) != len(sizes):
        raise LayoutError(
            f"{t.name}: merged layer needs output_sizes and one logical name per output (got {sizes}, {logical_names})"
        )
    out, start = [], 0
    for name, size in zip(logical_names, sizes):
        if size % lay.tp_size:
            raise LayoutError(f"{t.name}: output size {size} is not divisible by tp_size {lay.tp_size}")
        part = size // lay.tp_size
        out.append(t.piece(name, start, start + part, size, lay.tp_rank * part))
        start += part
    if start != t.rows:
        raise LayoutError(
            f"{t.name}: fused outputs {list(sizes)}/tp={lay.tp_size} cover {start} rows, the live tensor has {t.rows}"
        )
    return out


def _qkv_pieces(t: _Local, lay: LinearLayout, logical_names) -> list[Piece]:
    need = ("num_heads", "num_kv_heads", "head_size", "total_num_heads", "total_num_kv_heads")
    missing = [k for k in need if getattr(lay, k) is None]
    if missing or logical_names is None or len(logical_names) != 3:
        raise LayoutError(f"{t.name}: QKV layer needs {missing or ''} and three logical names (got {logical_names})")
    hs = lay.head_size
    vhs = lay.v_head_size or hs
    q, k, v = lay.num_heads * hs, lay.num_kv_heads * hs, lay.num_kv_heads * vhs
    kv_shard = lay.tp_rank // lay.num_kv_head_replicas
    out = [
        t.piece(logical_names[0], 0, q, lay.total_num_heads * hs, lay.tp_rank * q),
        t.piece(logical_names[1], q, q + k, lay.total_num_kv_heads * hs, kv_shard * k),
        t.piece(logical_names[2], q + k, q + k + v, lay.total_num_kv_heads * vhs, kv_shard * v),
    ]
    if q + k + v != t.rows:
        raise LayoutError(f"{t.name}: q/k/v sizes {q}+{k}+{v} do not match the live tensor's {t.rows} rows")
    return out


def wna16_kernel(module):
    """The mixed-precision kernel (vLLM's ``MPLinearKernel``) running an int4 weight-only layer, or None: a
    compressed-tensors W4A16 layer keeps it on its scheme, a GPTQ or AWQ layer on its quant method."""
    for owner in (getattr(module, "scheme", None), getattr(module, "quant_method", None)):
        kernel = getattr(owner, "kernel", None)
        if any(c.__name__ == "MPLinearKernel" for c in type(kernel).__mro__):
            return kernel
    return None


def is_w4a16(module) -> bool:
    """An int4 weight-only layer (llm-compressor's W4A16, GPTQ, AWQ), whose codes :mod:`espert.vllm.engine.w8a8`
    edits."""
    return wna16_kernel(module) is not None


def marlin_bias(module, p: torch.Tensor) -> torch.Tensor | None:
    """A logical-order copy of an int4 layer's bias that vLLM's Marlin keeps permuted (``marlin_permute_bias``),
    made once per layer (None for any other parameter): the views edit it and
    :class:`~espert.vllm.engine.repack.RepackingCenter` writes it back in Marlin's order after each edit."""
    if p is not getattr(module, "bias", None) or type(wna16_kernel(module)).__name__ != "MarlinLinearKernel":
        return None
    if getattr(module, "_espert_bias", None) is None:
        module._espert_bias = marlin_bias_order(p.data).reshape(-1)
    return module._espert_bias


def layer_pieces(module, kind: str, vllm_name: str, local_shape: Sequence[int], logical_names) -> list:
    """:func:`linear_pieces` with the tensor-parallel geometry read from the vLLM layer's attributes."""
    return linear_pieces(kind, vllm_name, local_shape, logical_names, **vars(LinearLayout.of(module)))


def expert_pieces(
    vllm_name: str,
    local_shape: Sequence[int],
    names: dict[tuple[int, str], str],
    *,
    local_experts: Sequence[int],
    intermediate: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[Piece]:
    """Pieces of a fused expert weight of vLLM's ``RoutedExperts``, over its rows ``[E·R, C]`` (3-D seen as 2-D).

    ``w13_weight [E, 2·I/tp, H]``: expert e's rows ``[0, I/tp)`` are a row block of its ``w1`` (gate) ``[I, H]``
    from row ``tp_rank·I/tp``, the next ``I/tp`` of its ``w3`` (up); a non-gated MoE's holds ``w1`` alone.
    ``w2_weight [E, H, I/tp]``: a column block of ``w2`` (down) ``[H, I]`` from column ``tp_rank·I/tp``.
    names: ``{(global expert id, "w1" | "w2" | "w3"): checkpoint name}``; local_experts: the global id of each
    local expert; intermediate: ``I``, the checkpoint's intermediate size.
    """
    e_local, rows, cols = (int(x) for x in local_shape)
    if len(local_experts) != e_local or intermediate % tp_size:
        raise LayoutError(
            f"{vllm_name}: {e_local} local experts, {len(local_experts)} placed; I={intermediate}, tp={tp_size}"
        )
    part = intermediate // tp_size
    down = vllm_name.endswith("w2_weight")
    shards = ["w2"] if down else [s for s in ("w1", "w3") if (local_experts[0], s) in names]
    if (cols if down else rows) != part * len(shards):
        raise LayoutError(
            f"{vllm_name}: shape {tuple(local_shape)} is not {len(shards)}×{part} rows or columns per expert "
            f"(vLLM padded or repacked it in a layout espert does not map)"
        )
    out = []
    for e, g in enumerate(local_experts):
        for k, shard in enumerate(shards):
            if down:
                block = Block(0, tp_rank * part, rows, intermediate)
                out.append(Piece(names[g, shard], e * rows, (e + 1) * rows, block))
            else:
                start = e * rows + k * part
                out.append(Piece(names[g, shard], start, start + part, Block(tp_rank * part, 0, intermediate, cols)))
    return out


def _expert_names(prefix: str, module) -> dict[tuple[int, str], str]:
    """``{(global expert, shard): checkpoint name}`` of a RoutedExperts module at ``prefix``, from vLLM's own
    expert mapping (its ``(param, "experts.{e}.gate_proj.", e, "w1")`` rows name tensors of the MoE block)."""
    block = prefix.removesuffix(".routed_experts").removesuffix("experts")
    return {(e, shard): f"{block}{weight}weight" for _, weight, e, shard in module.get_expert_mapping()}


def routed_experts(module) -> bool:
    """Whether ``module`` is vLLM's ``RoutedExperts`` (0.25 on), the holder of a mixture of experts' fused weights."""
    return type(module).__name__ == "RoutedExperts" and hasattr(module, "get_expert_mapping")


@releases("0.25")  # RoutedExperts and its expert mapping; before, MoE layers are refused
def _expert_param_pieces(pname: str, p: torch.Tensor, module, prefix: str, leaf: str) -> list[Piece]:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    if not isinstance(module, RoutedExperts):
        raise LayoutError(f"{pname}: MoE expert layer {type(module).__name__} has a layout espert does not map")
    qm = getattr(module, "quant_method", None)
    if not isinstance(qm, UnquantizedFusedMoEMethod):
        raise LayoutError(
            f"{pname}: experts run by {type(qm).__name__} (not vLLM's unquantized method) have a layout espert does not map through "
            f"vLLM; exclude them"
        )
    if leaf not in ("w13_weight", "w2_weight") or p.dim() != 3:
        raise LayoutError(f"{pname}: expert parameter {leaf!r} of shape {tuple(p.shape)} is not mapped")
    cfg = module.moe_config
    par = cfg.moe_parallel_config
    emap = module.expert_map
    local = list(range(module.global_num_experts)) if emap is None else _local_to_global(emap)
    return expert_pieces(
        pname,
        tuple(p.shape),
        _expert_names(prefix, module),
        local_experts=local,
        intermediate=cfg.intermediate_size_per_partition * par.tp_size,
        tp_rank=par.tp_rank,
        tp_size=par.tp_size,
    )


def _local_to_global(expert_map: torch.Tensor) -> list[int]:
    """vLLM's expert map (global id -> local slot, -1 elsewhere) as the global id of each local slot."""
    pairs = sorted((int(slot), g) for g, slot in enumerate(expert_map.tolist()) if slot >= 0)
    return [g for _, g in pairs]


def vocab_pieces(
    vllm_name: str,
    local_shape: Sequence[int],
    *,
    org_vocab_start: int,
    org_vocab_end: int,
    org_vocab_size: int,
    num_added: int = 0,
) -> list[Piece]:
    """Pieces of a (vocab-parallel, padded) embedding or LM head ``[rows_padded, D]``: the real vocabulary rows only."""
    if num_added:
        raise LayoutError(f"{vllm_name}: added (LoRA) vocabulary rows are not mapped to checkpoint rows")
    n = org_vocab_end - org_vocab_start
    if not 0 <= n <= local_shape[0]:
        raise LayoutError(
            f"{vllm_name}: vocab shard [{org_vocab_start}, {org_vocab_end}) does not fit the live "
            f"tensor of {local_shape[0]} rows"
        )
    if n == 0:
        return []
    return [Piece(vllm_name, 0, n, Block(org_vocab_start, 0, org_vocab_size, int(local_shape[1])))]


def piece_views(
    tensor: torch.Tensor, pieces: Sequence[Piece], rename: Callable[[str], str] | None = None
) -> list[ParamView]:
    """ParamViews (views into ``tensor``'s storage, never copies) for the pieces of one live tensor."""
    out = []
    for p in pieces:
        t = tensor[p.start : p.stop]
        out.append(ParamView(rename(p.name) if rename else p.name, t, p.block))
    return out


# ---- reading a live vLLM model ----------------------------------------------------------------


def _linear_kind(module) -> str | None:
    """The layout kind of a vLLM linear layer, or None when the module is not one we know."""
    from vllm.model_executor.layers import linear as L

    # exact class checks first: subclasses with extra fused outputs must not pass as their base
    exact = {
        L.ReplicatedLinear: "replicated",
        L.ColumnParallelLinear: "column",
        L.MergedColumnParallelLinear: "merged",
        L.QKVParallelLinear: "qkv",
        L.RowParallelLinear: "row",
    }
    if type(module) not in exact and isinstance(module, L.ReplicatedLinear):
        return "replicated"  # a MoE router (GateLinear): whole on every rank, one output, nothing to fuse
    return exact.get(type(module))


def _check_quant(name: str, module) -> None:
    qm = getattr(module, "quant_method", None)
    if qm is None:
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if name.endswith(".bias") and is_w4a16(module):  # an int4 layer's float bias, read by its kernel each call
        return
    if not isinstance(qm, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
        raise LayoutError(
            f"{name}: quantization method {type(qm).__name__} has a runtime layout espert does not "
            f"map (only unquantized weights are supported through vLLM; exclude it)"
        )


def _logical_names(prefix: str, leaf: str, packed: dict[str, list[str]]) -> list[str] | None:
    """``model.layers.0.self_attn.qkv_proj`` + ``weight`` -> [``...q_proj.weight``, ``...k_proj.weight``, ...]."""
    mod_path, _, last = prefix.rpartition(".")
    if last not in packed:
        return None
    base = f"{mod_path}." if mod_path else ""
    return [f"{base}{sub}.{leaf}" for sub in packed[last]]


def vllm_param_views(
    model: torch.nn.Module,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    rename: Callable[[str], str] | None = None,
) -> list[ParamView]:
    """ParamViews of a loaded vLLM model (``worker.model_runner.model``), named by checkpoint names.

    include / exclude: patterns as in :func:`espert.params.torch_param_views`, matched against the
    **logical** names (``*q_proj*`` selects the q block of ``qkv_proj``).  rename: vLLM's unfused names ->
    checkpoint names, where they differ beyond packing.  Tied parameters appear once, under their first
    name.  Raises :class:`LayoutError` naming a parameter it cannot map, ValueError when nothing is selected.
    """
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules())
    views: list[ParamView] = []
    seen: set[int] = set()
    for pname, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
        prefix, _, leaf = pname.rpartition(".")
        module = modules.get(prefix, model)
        # LoRA-enabled engines wrap each layer (``qkv_proj.base_layer.weight``); the checkpoint name has no wrapper
        pname, prefix = pname.replace(".base_layer.", "."), prefix.removesuffix(".base_layer")
        if hasattr(module, "_espert_codes") or (is_w4a16(module) and leaf != "bias"):  # espert.vllm.engine.w8a8
            continue  # the codes, scales and zero points; an int4 layer's float bias is a float view like any
        live = marlin_bias(module, p) if leaf == "bias" else None
        live = p.data if live is None else live
        if routed_experts(module):  # pieces are rows of [E·R, C]; on vLLM-CPU, of the plain (unpacked) copy
            live = expert_plain(p.data)
            live = (p.data if live is None else live).reshape(-1, p.shape[-1])
        for pc in _param_pieces(pname, p, module, prefix, leaf, packed):
            lname = rename(pc.name) if rename else pc.name
            if (include and not matches(lname, include)) or (exclude and matches(lname, exclude)):
                continue
            t = live[pc.start : pc.stop]
            views.append(ParamView(lname, t, pc.block if pc.block != Block(0, 0, None, None) else None))
    if not views:
        raise ValueError(f"no parameters selected (include={include}, exclude={exclude})")
    return views


def _param_pieces(pname: str, p: torch.Tensor, module, prefix: str, leaf: str, packed: dict) -> list[Piece]:
    """The pieces of one live parameter ``pname`` of ``module`` (after the checks of :func:`_check_param`)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if routed_experts(module) and p.dtype in DTYPE_CODES:
        return _expert_param_pieces(pname, p, module, prefix, leaf)
    kind = _check_param(pname, p, module, prefix, leaf)
    if kind is not None:
        names = _logical_names(prefix, leaf, packed) if kind in ("merged", "qkv") else None
        if kind in ("merged", "qkv") and names is None:
            raise LayoutError(
                f"{pname}: fused layer {prefix} is not in the model's packed_modules_mapping, so "
                f"its checkpoint names are unknown"
            )
        pieces = layer_pieces(module, kind, pname, tuple(p.shape), names)
        if kind == "merged" and len(pieces) != len(names):
            raise LayoutError(f"{pname}: {len(pieces)} fused outputs but {len(names)} checkpoint names")
        return pieces
    if isinstance(module, VocabParallelEmbedding):
        if leaf != "weight" or p.dim() != 2:
            raise LayoutError(f"{pname}: unexpected vocab-parallel parameter of shape {tuple(p.shape)}")
        si = module.shard_indices
        return vocab_pieces(
            pname,
            tuple(p.shape),
            org_vocab_start=si.org_vocab_start_index,
            org_vocab_end=si.org_vocab_end_index,
            org_vocab_size=module.org_vocab_size,
            num_added=si.num_added_elements,
        )
    tp = getattr(module, "tp_size", 1)
    if tp != 1:
        raise LayoutError(f"{pname}: {type(module).__name__} is sharded (tp_size={tp}) in a way espert does not map")
    n = p.shape[0] if p.dim() >= 1 else 1
    return [Piece(pname, 0, n, Block(0, 0, 1, n) if p.dim() == 1 else None)]


def _check_param(pname: str, p: torch.Tensor, module, prefix: str, leaf: str) -> str | None:
    """Refuse (LayoutError naming it) a parameter espert cannot map; returns its linear kind (None: not a linear)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if p.dtype not in DTYPE_CODES:
        raise LayoutError(
            f"{pname}: dtype {p.dtype} (quantized or packed storage) cannot be perturbed through vLLM by espert; "
            f"exclude it"
        )
    kind = _linear_kind(module)
    if kind is None and isinstance(module, LinearBase):
        raise LayoutError(
            f"{pname}: linear layer type {type(module).__name__} has a layout espert does not "
            f"map (known: Replicated/Column/MergedColumn/QKV/RowParallelLinear)"
        )
    if kind is None and (type(module).__name__ in ("FusedMoE", "SharedFusedMoE") or "experts" in prefix.split(".")):
        raise LayoutError(f"{pname}: MoE expert layer {type(module).__name__} has a layout espert does not map")
    mapped = kind is not None or isinstance(module, VocabParallelEmbedding)
    if mapped:
        _check_quant(pname, module)
    if p.numel() == 0:
        raise LayoutError(
            f"{pname}: the live weight is empty, so it was repacked at load (vLLM-CPU prepacks "
            f"Linear weights unless espert.vllm.patches.install() ran before the model loaded)"
        )
    if leaf not in ("weight", "bias") and mapped:
        raise LayoutError(f"{pname}: unexpected parameter {leaf!r} on {type(module).__name__}")
    return kind


# ---- the checkpoint the logical names must match ----------------------------------------------


def checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` from the headers of the ``*.safetensors`` files of a local directory or a
    cached Hub id (no tensor is read); None when there are none (then names cannot be checked)."""
    files = checkpoint_files(model)
    if files is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update({k: tuple(v["shape"]) for k, v in read_header(f)[1].items()})
    scheme = weight_scheme(quantization_config(os.path.dirname(files[0])))
    return logical_shapes(shapes, scheme and scheme["format"])  # packed int4 under its float name and shape
