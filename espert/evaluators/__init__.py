"""Evaluators: rollout engines behind one small interface (see :mod:`espert.evaluators.base`).

``ESConfig.evaluator`` names one.  Each name maps to the import path of its builder
``fn(cfg: ESConfig, model_path: str, score) -> Evaluator``, imported on first use, so importing
this package costs nothing and an optional engine (vLLM) is only needed when it is chosen.  A builder
that also takes a keyword ``extract`` (the task's answer extractor) is given it, and its evaluator
fills ``member_answers`` (the loop's answer-diversity diagnostic); the built-in ones do.
Built in: ``"torch"`` (transformers ``generate``) and ``"vllm"``.  Third parties add theirs with
:func:`register_evaluator` (a builder or its ``"module:function"`` path).

Names below (``Evaluator``, ``ModelEvaluator``, ``TorchEvaluator``, ...) are loaded on first access.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import pickle
from typing import TYPE_CHECKING, Callable, Iterator, Union

if TYPE_CHECKING:  # pragma: no cover
    from espert.config import ESConfig

    from .base import Evaluator

Builder = Callable[["ESConfig", str, Callable], "Evaluator"]
#: Evaluator name -> builder, or the ``"module:function"`` path of one (imported on first use).
EVALUATORS: dict[str, Union[str, Builder]] = {
    "torch": "espert.evaluators.torch_model:build",
    "vllm": "espert.vllm.driver.build:build_from_config",
}


def register_evaluator(name: str, builder: Union[str, Builder]) -> None:
    """Make ``builder`` (a callable or its ``"module:function"`` import path) available as ``ESConfig.evaluator == name``."""
    EVALUATORS[name] = builder


def get_builder(name: str) -> Builder:
    """The builder registered as ``name``, importing it if needed; ValueError when unknown or not importable."""
    if name not in EVALUATORS:
        raise ValueError(f"unknown evaluator {name!r}; known: {sorted(EVALUATORS)} (register_evaluator adds one)")
    b = EVALUATORS[name]
    if isinstance(b, str):
        mod, _, fn = b.partition(":")
        try:
            b = getattr(importlib.import_module(mod), fn)
        except ImportError as e:
            raise ValueError(f"evaluator {name!r} is not available here: {e}") from e
        EVALUATORS[name] = b
    return b


def build_evaluator(cfg: "ESConfig", model_path: str, score: Callable, extract: Callable | None = None) -> "Evaluator":
    """The evaluator named by ``cfg.evaluator`` for the model at ``model_path`` and reward ``score``;
    ``extract`` (a Task's ``extract``) goes to builders that take it (module docstring).  A quantized checkpoint
    in a scheme espert cannot edit is refused first (:class:`espert.quant.checkpoint.UnsupportedScheme`)."""
    from espert.quant.checkpoint import quantization_config, weight_scheme

    builder = get_builder(cfg.evaluator)
    weight_scheme(quantization_config(model_path), cfg.evaluator)
    if extract is not None and "extract" in inspect.signature(builder).parameters:
        return builder(cfg, model_path, score, extract=extract)
    return builder(cfg, model_path, score)


@contextlib.contextmanager
def loading_model(what: str, evaluator: str, note: str = "") -> Iterator[None]:
    """Any failure to load the model at ``what`` inside the block becomes one ValueError line naming it, the
    evaluator and the first line of the cause, then ``note``: the one check that ``espert train`` (the
    evaluator) and ``espert eval`` (the sampler) share.  An environment failure (an OSError with an errno:
    a full disk, ...) passes unchanged.  A weights pickle that torch's safe loader (``weights_only``)
    refuses is named as such, with the fix: it is never loaded unsafely."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - transformers, tokenizers, safetensors, torch: each its own type
        if isinstance(e, OSError) and e.errno is not None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if isinstance(e, pickle.UnpicklingError):
            first = (
                "torch's safe loader (weights_only) refuses a weights pickle: it holds more than tensors, or is "
                "damaged; espert never loads it unsafely, which could run code; use safetensors weights"
            )
        raise ValueError(
            f"the model at {what} could not be loaded by evaluator {evaluator!r} ({type(e).__name__}: {first}){note}"
        ) from e


_LAZY = {
    "Evaluator": ".base",
    "ModelEvaluator": ".base",
    "Member": ".base",
    "score_members": ".base",
    "TorchEvaluator": ".torch_model",
    "load_model": ".torch_model",
    "model_center": ".torch_model",
    "torch_dtype": ".torch_model",
    "config_center": ".torch_model",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Evaluator",
    "ModelEvaluator",
    "Member",
    "TorchEvaluator",
    "build_evaluator",
    "loading_model",
    "register_evaluator",
    "get_builder",
    "EVALUATORS",
    "load_model",
    "model_center",
    "config_center",
    "torch_dtype",
]
