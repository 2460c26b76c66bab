"""Evaluators: model backends behind one small interface (see :mod:`espert.evaluators.base`).

Backends register a builder ``fn(cfg: ESConfig, model_path: str, score) -> Evaluator`` under a
name; ``ESConfig.backend`` picks one.  Built in: ``"torch"`` (transformers ``generate``).  The vLLM
backend (``espert.vllm.evaluator``) registers ``"vllm"`` with :func:`register_evaluator` when it is
imported, which :func:`build_evaluator` does on first use of ``--backend vllm``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .base import Evaluator, Member, ModelEvaluator, apply_update
from .torch_model import TorchEvaluator, load_model, model_center, torch_dtype

if TYPE_CHECKING:  # pragma: no cover
    from espert.es import ESConfig

Builder = Callable[["ESConfig", str, Callable], Evaluator]
EVALUATORS: dict[str, Builder] = {}
#: Backends that live in modules imported on first use (name -> module).
LAZY_BACKENDS = {"vllm": "espert.vllm.evaluator"}


def register_evaluator(name: str, builder: Builder) -> None:
    """Make ``builder`` available as ``ESConfig.backend == name``."""
    EVALUATORS[name] = builder


def _torch_builder(cfg: "ESConfig", model_path: str, score: Callable) -> TorchEvaluator:
    model, tok = load_model(model_path, device=cfg.device, dtype=cfg.dtype)
    if cfg.quant != "none":
        from espert.quant import quantize_model
        from espert.quant.evaluator import QuantTorchEvaluator

        quantize_model(model, cfg.quant, group_size=cfg.quant_group_size)
        return QuantTorchEvaluator(model, tok, score, max_new_tokens=cfg.max_new_tokens,
                                   batch_size=cfg.generation_batch_size, chat_template=cfg.chat_template,
                                   member_errors=cfg.member_errors)
    return TorchEvaluator(model, tok, score, include=cfg.include, exclude=cfg.exclude,
                          max_new_tokens=cfg.max_new_tokens, batch_size=cfg.generation_batch_size,
                          chat_template=cfg.chat_template, member_errors=cfg.member_errors)


register_evaluator("torch", _torch_builder)


def build_evaluator(cfg: "ESConfig", model_path: str, score: Callable) -> Evaluator:
    """The evaluator named by ``cfg.backend`` for the model at ``model_path`` and reward ``score``."""
    if cfg.backend not in EVALUATORS and cfg.backend in LAZY_BACKENDS:
        import importlib

        try:
            importlib.import_module(LAZY_BACKENDS[cfg.backend])
        except ImportError as e:
            raise ValueError(f"evaluator backend {cfg.backend!r} is not available here: {e}") from e
    if cfg.backend not in EVALUATORS:
        raise ValueError(f"unknown evaluator backend {cfg.backend!r}; known: {sorted(EVALUATORS)}")
    return EVALUATORS[cfg.backend](cfg, model_path, score)


__all__ = ["Evaluator", "ModelEvaluator", "Member", "TorchEvaluator", "apply_update", "build_evaluator",
           "register_evaluator", "EVALUATORS", "load_model", "model_center", "torch_dtype"]
