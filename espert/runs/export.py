"""The base model's files (a directory or a Hugging Face Hub id) and the export of a center in its format."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil

import torch

from espert.files import WEIGHT_SUFFIXES, fsync_dir, kill_point, naming
from espert.progress import bar
from espert.quant.checkpoint import (
    STORED_AS,
    act_orders,
    checkpoint_columns,
    encode,
    logical_shapes,
    quantization_config,
    weight_scheme,
)
from espert.runs.gguf import gguf_model_dir, is_gguf
from espert.tensorfile import ST_TORCH, FileChunks, TensorFileWriter, as_chunks, read_header


def is_hub_id(ref: str) -> bool:
    """A Hugging Face Hub id (``name`` or ``org/name``) rather than a path."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", ref)) and ".." not in ref


def resolve_model_dir(ref: str, echo=None) -> str:
    """A local directory holding the model files of ``ref``: a directory, a GGUF file (its converted
    directory, :func:`espert.runs.gguf.gguf_model_dir`), or a Hub id (local cache first).

    Fails fast with one clear message when the model is neither a directory nor in the local cache
    and the Hub does not answer, or has no such model.
    """
    if os.path.isdir(ref):
        return ref
    if is_gguf(ref):
        if not os.path.isfile(ref):
            raise FileNotFoundError(f"GGUF file not found: {ref}")
        return gguf_model_dir(ref, echo)
    if not is_hub_id(ref):
        raise FileNotFoundError(f"model directory not found: {ref}")
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
    try:
        return snapshot_download(ref, allow_patterns=patterns, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: ask the Hub below
        pass
    where = f"the Hugging Face Hub ({constants.ENDPOINT})"
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"model {ref!r} is not a local directory and not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:  # one short request first, so an unreachable Hub costs seconds, not a minute of retries
        HfApi().model_info(ref, timeout=10)
    except GatedRepoError:
        raise FileNotFoundError(
            f"model {ref!r} on {where} is gated: accept its license and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {ref!r}: no such local directory, and no such model on {where} "
            f"(or it is private: log in with hf auth login)"
        ) from None
    except HfHubHTTPError as e:
        code = getattr(getattr(e, "response", None), "status_code", None)
        raise FileNotFoundError(
            f"model {ref!r} is not a local directory or cached, and {where} answered "
            f"HTTP {code}: {str(e).splitlines()[0]}"
        ) from None
    except Exception as e:  # noqa: BLE001 - network errors come from several libraries
        raise FileNotFoundError(
            f"model {ref!r} is not a local directory or cached, and {where} cannot be "
            f"reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return snapshot_download(ref, allow_patterns=patterns)


def base_identity(ref: str) -> str:
    """The path whose files the run's fingerprint covers: a GGUF file itself (not its conversion), else the
    model directory of ``ref``."""
    return ref if is_gguf(ref) else resolve_model_dir(ref)


def _cast(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Center values as ``dtype`` (round to nearest even; elementwise, so a chunk casts like its tensor)."""
    from espert.quant.center import master_codes

    c = c.detach().to("cpu")
    if not dtype.is_floating_point and (c.dtype.is_floating_point or c.dtype == torch.int16):
        # integer codes from a code-domain master (float, or int16 fixed): round, don't truncate
        info = torch.iinfo(dtype)
        c = master_codes(c).clamp(info.min, info.max)
    return c.to(dtype)


#: ``export_dtype`` names -> torch dtypes (``base``: each tensor in its dtype in the base checkpoint)
EXPORT_DTYPES = {"base": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _write_note(tmp: str, note: dict) -> None:
    """espert_export.json beside the weights, then every file of the export and its folder synced."""
    with (
        naming(os.path.join(tmp, "espert_export.json")),
        open(os.path.join(tmp, "espert_export.json"), "w", encoding="utf-8") as fh,
    ):
        json.dump(note, fh, indent=2)
    for f in os.listdir(tmp):
        with open(os.path.join(tmp, f), "rb+") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)


def export_model(
    state,
    base_ref: str,
    out_dir: str,
    iteration: int | None = None,
    note: dict | None = None,
    dtype: str = "base",
) -> str:
    """Write the center in the base model's own format to ``out_dir`` (replaced atomically as a whole).

    state: ``{name: tensor}`` (an evaluator's ``export_state()``) or a chunk source
    (:mod:`espert.tensorfile`, e.g. ``center_stream()``; driver memory: about one chunk).
    Entries named ``optim.*`` (optimizer state) are not weights and are skipped.  Copies the base
    model's non-weight files (config, tokenizer, generation config, chat template) and rewrites
    each of its ``*.safetensors`` files with every tensor named in ``state`` replaced by the center,
    cast (round to nearest even) chunk by chunk to that tensor's dtype in the base file; the other
    tensors are copied.  The shard layout and index stay those of the base, so
    ``AutoModelForCausalLM.from_pretrained`` and vLLM load the result like the base.  Raises (before
    writing) if a center name is missing from the base checkpoint or has another shape there.
    dtype: ``"base"`` (each tensor in its dtype in the base file) or a float dtype name
    (:data:`EXPORT_DTYPES`): every floating tensor of the export in it, ``config.json``'s dtype saying so; of a
    quantized base, a float model in it, dequantized (:func:`_write_dequantized`).
    """
    from espert.center import OPTIM_PREFIX

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    source = as_chunks(state)
    names = {n: shape for n, (shape, _) in source.layout.items() if not n.startswith(OPTIM_PREFIX)}
    base = resolve_model_dir(base_ref)
    heads, where = _base_shards(base, names)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp, old = f"{out_dir}.tmp-{os.getpid()}", f"{out_dir}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write_export(tmp, base, heads, where, source, EXPORT_DTYPES[dtype])
        _write_note(tmp, {"iteration": iteration, "base_model": base_ref, **(note or {})})
        if os.path.exists(out_dir):
            os.replace(out_dir, old)
            kill_point("export-swap", iteration)
        os.replace(tmp, out_dir)
        fsync_dir(parent)
    except OSError as e:  # named by the export's own path, not the temporary directory's
        for attr in ("filename", "filename2"):
            name = str(getattr(e, attr))
            if name.startswith(tmp):
                setattr(e, attr, out_dir + name[len(tmp) :])
        e.filename = e.filename or out_dir
        raise
    finally:
        if os.path.exists(old) and not os.path.exists(out_dir):  # the new one never came: the old stays
            os.replace(old, out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def check_exportable(layout: dict, base_ref: str) -> None:
    """Refuse (ValueError, one line) a center that :func:`export_model` could not write in the base's format:
    a name missing from the base checkpoint or of another shape there, or a base without safetensors weights.
    layout: ``{name: (shape, dtype)}`` (a chunk source's ``layout``).  A run calls it before its first
    iteration, so an export that cannot be written never costs a finished run."""
    from espert.center import OPTIM_PREFIX

    names = {n: shape for n, (shape, _) in layout.items() if not n.startswith(OPTIM_PREFIX)}
    _base_shards(resolve_model_dir(base_ref), names)


def _base_shards(base: str, names: dict) -> tuple[dict, dict[str, tuple[str, str, str | None]]]:
    """``(headers by shard, {center name: (its shard, the base tensor it replaces, its int4 format or None)})`` of
    the base's safetensors files; ValueError (before anything is written) when a center name is missing there, has
    another shape, or a dtype cannot be stored.  An int4 weight ``X.weight`` [N, K] replaces the packed words its
    format stores (``X.weight_packed``, GPTQ's or AWQ's ``X.qweight``: :mod:`espert.quant.checkpoint`)."""
    shards = sorted(f for f in os.listdir(base) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"{base} has no *.safetensors weights; export needs a safetensors checkpoint")
    scheme = weight_scheme(quantization_config(base))  # packed codes are written only in a scheme espert knows
    fmt = scheme["format"] if scheme and scheme["format"] in STORED_AS else None
    heads = {shard: read_header(os.path.join(base, shard)) for shard in shards}
    where: dict[str, tuple[str, str, str | None]] = {}
    for shard, (_, entries, _) in heads.items():
        for k, e in entries.items():
            ((name, shape),) = logical_shapes({k: tuple(e["shape"])}, fmt).items()
            if name in names:
                if tuple(names[name]) != shape:
                    raise ValueError(f"center {name} has shape {tuple(names[name])}, base has {shape}")
                where[name] = (shard, k, fmt if name != k else None)
            if e["dtype"] not in ST_TORCH:
                raise ValueError(f"{os.path.join(base, shard)}: cannot store {k} of dtype {e['dtype']} in safetensors")
    missing = sorted(set(names) - set(where))
    if missing:
        raise ValueError(
            f"the base checkpoint {base} has no tensors named {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}; cannot export in its format"
        )
    return heads, where


def _write_export(
    tmp: str, base: str, heads: dict, where: dict[str, tuple[str, str]], source, dtype: torch.dtype | None = None
) -> None:
    """The base's non-weight files, then each shard with the center's tensors (cast to the base's dtypes, or
    every floating tensor to ``dtype``) in place of the base's; the other tensors are copied (cast alike).  A
    quantized base in a float ``dtype``: :func:`_write_dequantized`."""
    if dtype is not None and weight_scheme(quantization_config(base)) is not None:
        return _write_dequantized(tmp, base, source, dtype)
    for f in sorted(os.listdir(base)):
        src = os.path.join(base, f)
        if os.path.isfile(src) and not f.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(src, os.path.join(tmp, f))
    if dtype is not None:
        _set_config_dtype(os.path.join(tmp, "config.json"), dtype)
    piece = max(1, int(source.chunk_bytes))
    size = sum(math.prod(shape) * dt.itemsize for shape, dt in source.layout.values())
    with (
        contextlib.ExitStack() as stack,  # every shard open at once: the center's chunks come in its order
        bar("[espert] exporting the weights", size, "B") as shown,
    ):
        writers: dict[str, TensorFileWriter] = {}
        for shard, (meta, _, _) in heads.items():
            replaced = {k for s_, k, _ in where.values() if s_ == shard}
            others = FileChunks(os.path.join(base, shard), piece, skip=replaced)  # the base's other tensors
            layout = {
                k: (shape, dtype if dtype is not None and dt.is_floating_point else dt)
                for k, (shape, dt) in others.layout.items()
            }
            w = TensorFileWriter(os.path.join(tmp, shard), layout, meta or {"format": "pt"}, piece)
            writers[shard] = stack.enter_context(w)
            for k, offset, flat in others:
                w.write(k, offset, _cast(flat, layout[k][1]))
        packing: dict[str, list] = {}  # an int4 weight's codes gathered whole (its format packs across rows), count
        orders = act_orders(base)
        for k, offset, flat in source:
            if k in where:
                shard, stored, fmt = where[k]
                w = writers[shard]
                if fmt is None:
                    w.write(k, offset, _cast(flat, w.layout[k][1]))
                else:
                    whole = packing.setdefault(k, [torch.empty(source.layout[k][0], dtype=flat.dtype), 0])
                    whole[0].view(-1)[offset : offset + flat.numel()] = flat
                    whole[1] += flat.numel()
                    if whole[1] == whole[0].numel():
                        w.write(stored, 0, encode(fmt, packing.pop(k)[0], orders.get(k)).reshape(-1))
            shown.update(flat.numel() * flat.element_size())
            del flat  # a streamed chunk is freed before the next one arrives


@torch.no_grad()
def _write_dequantized(tmp: str, base: str, source, dtype: torch.dtype) -> None:
    """A quantized base's export in a float ``dtype`` (asked for by ``export_dtype``): the model as espert's torch
    evaluator loads it (QuantLinear over the checkpoint's codes), the center's values put in, each QuantLinear a
    Linear whose weight is its codes dequantized with the checkpoint's own scales and zero points, in its input
    order; saved by transformers without a quantization config.  Holds the float model in memory once."""
    from espert.center import OPTIM_PREFIX
    from espert.evaluators.torch_model import load_model
    from espert.quant import QuantLinear, dequantize, pack_codes_
    from espert.quant.center import master_codes

    model, tok = load_model(base)
    center: dict[str, torch.Tensor] = {}
    for k, offset, flat in source:
        if not k.startswith(OPTIM_PREFIX):
            whole = center.setdefault(k, torch.empty(source.layout[k][0], dtype=flat.dtype))
            whole.view(-1)[offset : offset + flat.numel()] = flat
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]:
        qw = mod.qw
        if name + ".weight" in center:
            pack_codes_(qw, master_codes(center.pop(name + ".weight")).clamp(*qw.code_range))
        w = checkpoint_columns(dequantize(qw), mod.in_order)  # an act-order GPTQ layer keeps its columns grouped
        linear = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        linear.weight.copy_(w)
        if mod.bias is not None:
            linear.bias.copy_(mod.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
    for k, value in center.items():  # the float tensors: embeddings, norms, biases
        model.get_parameter(k).copy_(value)
    model.config.__dict__.pop("quantization_config", None)  # (GPTQ's and AWQ's loader dropped it already)
    model.hf_quantizer = None  # compressed-tensors: transformers would compress the weights again on save
    model.to(dtype).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _set_config_dtype(os.path.join(tmp, "config.json"), dtype)


def _set_config_dtype(path: str, dtype: torch.dtype) -> None:
    """``config.json``'s dtype (``dtype``, and ``torch_dtype`` where an older transformers wrote it) set to
    ``dtype``: loaders with ``dtype="auto"`` (transformers, vLLM) then load the export as it is stored."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def export_iteration(export_dir: str) -> int | None:
    """The iteration an export directory holds (None: absent or unreadable)."""
    try:
        with open(os.path.join(export_dir, "espert_export.json"), encoding="utf-8") as f:
            it = json.load(f).get("iteration")
    except (OSError, ValueError, AttributeError):
        return None
    return it if isinstance(it, int) else None
