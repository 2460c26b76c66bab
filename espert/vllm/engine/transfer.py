"""espert as a vLLM weight-transfer engine (backend ``"espert"``): ES steps cross vLLM's RL weight-update API
(``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``)
as commands of a few dozen bytes, applied with espert's fused ops, in place, on the worker extension's
:class:`~espert.center.CenterStore` (:mod:`espert.vllm.engine.worker`, still needed: it installs the CPU
patches and registers this backend in every worker).  Usage, bytes and versions: docs/vllm.md, "vLLM's
weight-update API"; ``bench/vllm_transfer_client.py`` is a trainer written against vLLM's calls only.

Commands (``update_info``; each key belongs to one op, and a key another op takes is refused):

- ``{"op": "perturb", "seed": int in [0, 2^64), "sigma": float > 0, "sign": +1 | -1 (default 1)}``:
  live weights <- center + sign·σ·ε(seed); from restored weights (as ``es_perturb``);
- ``{"op": "restore"}``: live weights <- the exact center (as ``es_restore``);
- ``{"op": "update", "seeds": [N ints], "coeffs": [N floats], "decay": float > 0 (default 1),
  "lr": float > 0 | None, "anchor": {"norm": "l2" | "l1", "amount": float} | None}``: the ES step on the
  host master, then the anchored-weight-decay step (``init_info`` ``{"anchor": true}``), then restore (as
  ``es_update``).

A command is checked whole before anything is applied: a bad op, key or value raises one ValueError
naming it, and the weights are untouched (vLLM then ends the update session).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pickle
import sys
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from espert.ops.checks import check_sigma, check_sign, check_u64
from espert.update import Update

#: The name this engine is registered under (``WeightTransferConfig(backend=BACKEND)``).
BACKEND = "espert"

#: op -> {key: default}; ``...`` marks a required key.
OPS: dict[str, dict[str, Any]] = {
    "perturb": {"seed": ..., "sigma": ..., "sign": 1},
    "restore": {},
    "update": {"seeds": ..., "coeffs": ..., "decay": 1.0, "lr": None, "anchor": None},
}


def _setup_fields() -> list[tuple]:
    """(name, type, field with its default) of every keyword argument of ``es_setup``."""
    from espert.vllm.engine.worker import ESWorkerExtension

    params = list(inspect.signature(ESWorkerExtension.es_setup).parameters.values())[1:]  # after self
    return [(p.name, Any, dataclasses.field(default=p.default)) for p in params]


#: ``init_info`` of ``init_weight_transfer_engine``: the keyword arguments of
#: :meth:`espert.vllm.worker.ESWorkerExtension.es_setup` (see there), with its defaults, read from its
#: signature so the two cannot drift.  An unknown key is refused by vLLM's ``parse_init_info``.
ESInitInfo = dataclasses.make_dataclass("ESInitInfo", _setup_fields(), bases=(WeightTransferInitInfo,))


@dataclass
class ESUpdateInfo(WeightTransferUpdateInfo):
    """One checked command (build it with :func:`parse_command`): ``op`` and its arguments in ``args``
    (ints, floats and lists of them, ready for the worker extension's ``es_*`` method)."""

    op: str
    args: dict[str, Any]


def _real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r} ({type(v).__name__})")
    return float(v)


def _checked(name: str, check, v):
    """check(v), with the field named in the error (espert's checks name their own argument)."""
    try:
        return check(v)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None


def parse_command(update: Any) -> ESUpdateInfo:
    """Check one ``update_info`` dict (see the module docstring) and return it typed.

    Raises ValueError ("espert weight transfer: ...") naming the first bad op, key or value; nothing is
    applied by parsing.  Seeds: Python ints in [0, 2^64); sigma, coeffs, decay, lr: finite real numbers
    (bools and strings are refused, not converted).
    """
    try:
        if not isinstance(update, dict):
            raise ValueError(f"update_info must be a dict with an 'op', got {type(update).__name__}")
        op = update.get("op")
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} (expected one of {', '.join(OPS)})")
        spec = OPS[op]
        extra = sorted(set(update) - set(spec) - {"op"})
        if extra:
            raise ValueError(f"op {op!r} takes no {', '.join(map(repr, extra))} (its keys: {list(spec) or 'none'})")
        missing = [k for k, d in spec.items() if d is ... and k not in update]
        if missing:
            raise ValueError(f"op {op!r} needs {', '.join(map(repr, missing))}")
        a = {k: update.get(k, d) for k, d in spec.items()}
        if op == "perturb":
            a["seed"] = _checked("seed", lambda s: check_u64("seed", s), a["seed"])
            a["sigma"] = _checked("sigma", check_sigma, a["sigma"])
            a["sign"] = _checked("sign", check_sign, a["sign"])
        elif op == "update":
            for k in ("seeds", "coeffs"):
                if not isinstance(a[k], (list, tuple)):
                    raise ValueError(f"{k} must be a list, got {type(a[k]).__name__}")
            coeffs = [_real(f"coeffs[{i}]", c) for i, c in enumerate(a["coeffs"])]
            a = {
                "step": _checked("update", lambda v: Update(*v), (a["seeds"], coeffs, a["decay"], a["lr"], a["anchor"]))
            }
    except ValueError as e:
        raise ValueError(f"espert weight transfer: {e}") from None
    return ESUpdateInfo(op, a)


def _constructing_worker(model: torch.nn.Module):
    """The vLLM worker whose ``load_model`` is creating this engine: the ``self`` of a caller frame whose model runner
    holds exactly ``model`` (None when there is none).  The factory hands an engine only the model, but the
    center lives on the worker."""
    from espert.vllm.engine.worker import ESWorkerExtension

    f = sys._getframe(1)
    while f is not None:
        w = f.f_locals.get("self")
        if isinstance(w, ESWorkerExtension):
            runner = getattr(w, "model_runner", None)
            if runner is not None and w._es_model() is model:
                return w
        f = f.f_back
    return None


class ESWeightTransferEngine(WeightTransferEngine[ESInitInfo, ESUpdateInfo]):
    """vLLM weight-transfer engine whose updates are espert commands (seeds and coefficients), one per worker (TP
    rank), created by vLLM in ``load_model``; it drives that worker's ``es_*`` methods, so the center is the one
    ``collective_rpc("es_*")`` sees.  ``payload_bytes``: the pickled size of each command received."""

    init_info_cls = ESInitInfo
    update_info_cls = ESUpdateInfo
    supports_draft_weight_update = False  # the center maps the target model only

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker = _constructing_worker(model)
        if self.worker is None:
            raise ValueError(
                f"weight transfer backend {BACKEND!r} needs worker_extension_cls="
                "'espert.vllm.engine.worker.ESWorkerExtension' (the center lives in the worker extension)"
            )
        self.payload_bytes: list[int] = []

    def init_transfer_engine(self, init_info: ESInitInfo) -> None:
        """``es_setup(**init_info)``: map the live weights and snapshot the center (replaces a previous one)."""
        self.worker.es_setup(**vars(init_info))

    def start_weight_update(self) -> None:
        """Nothing to prepare: commands edit the live tensors in place (no layerwise reload)."""

    def finish_weight_update(self) -> None:
        """Nothing to finalize: each command has finished (synchronized) when ``update_weights`` returns."""

    def parse_update_info(self, update_dict: dict[str, Any]) -> ESUpdateInfo:
        """:func:`parse_command`: one ValueError naming the bad op, key or value."""
        return parse_command(update_dict)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Check one command, then apply it; the base class's ``torch.accelerator.synchronize()`` is replaced
        by the worker extension's own sync (the CUDA stream; nothing on CPU, where there is no accelerator)."""
        cmd = self.parse_update_info(update_info)
        if getattr(self.worker, "_es_center", None) is None:
            raise RuntimeError("espert weight transfer: call init_weight_transfer_engine first (it runs es_setup)")
        self.payload_bytes.append(len(pickle.dumps(update_info)))
        self.receive_weights(cmd)

    def receive_weights(self, update_info: ESUpdateInfo) -> None:
        """Apply a checked command through the worker extension (in place; synchronized on return)."""
        a = update_info.args
        if update_info.op == "perturb":
            self.worker.es_perturb(a["seed"], a["sigma"], a["sign"])
        elif update_info.op == "restore":
            self.worker.es_restore()
        else:
            self.worker.es_update(*a["step"].wire())

    def shutdown(self) -> None:
        """Nothing to release (no communicator); the center stays with the worker extension."""


def received_bytes(worker) -> list[int]:
    """``llm.collective_rpc(received_bytes)``: per rank, the pickled size in bytes of every command its
    engine received (ints, in order).  A module function, so it pickles by reference into the workers
    (an engine core in its own process takes a function only with VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""
    return list(worker.weight_transfer_engine.payload_bytes)
