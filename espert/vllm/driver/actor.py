"""One engine of an :class:`~espert.vllm.driver.pool.EnginePool`, in its own Ray actor.

The actor holds an *engine*: any object with the evaluator methods the pool calls,

    evaluate(members, sigma, prompts, answers) -> rewards      (and ``member_answers`` after it)
    evaluate_center(prompts, answers) -> rewards
    update(seeds, coeffs, decay, lr)
    checksum() -> [one dict per TP rank with the fields of wire.EXACT_FIELDS]
    center_state() -> {name: tensor}; load_center(state); rpc(method, *args); timings; info; close()

:class:`VLLMEngine` builds a :class:`~espert.vllm.driver.evaluator.VLLMEvaluator`; any picklable zero-argument
callable works (``EnginePool.of``; bench/pool_scaling.py's engines hash).  This module imports neither torch
nor vLLM, so a pool of light engines keeps its actor processes small.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class VLLMEngine:
    """A picklable recipe for one engine: ``VLLMEvaluator(model, score, llm_kwargs=..., **ev_kwargs)``."""

    model: str
    score: Callable
    ev_kwargs: dict = field(default_factory=dict)
    llm_kwargs: dict = field(default_factory=dict)

    def __call__(self):
        from espert.vllm.driver.evaluator import VLLMEvaluator

        return VLLMEvaluator(self.model, self.score, llm_kwargs=dict(self.llm_kwargs), **self.ev_kwargs)


class EngineActor:
    """One engine and the calls the pool makes on it, in its own process (a Ray actor).

    make_engine: builds the engine in this process.  env: environment set before it is built (e.g.
    vLLM's in-process engine, KV cache size, thread binding).
    """

    def __init__(self, make_engine: Callable, env: dict):
        os.environ.update({k: str(v) for k, v in env.items()})
        self.ev = make_engine()

    def ready(self) -> dict:
        """``{"pid", "node", "info", "checksum"}``: where this engine runs and the center it starts from."""
        import ray

        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "info": self.ev.info,
            "checksum": self.ev.checksum(),
        }

    def evaluate(self, members, sigma, prompts, answers) -> tuple[list[float], list | None]:
        """The members' rewards and their extracted answers (``member_answers``; None without ``extract``)."""
        rewards = self.ev.evaluate([tuple(m) for m in members], sigma, prompts, answers)
        return rewards, getattr(self.ev, "member_answers", None)

    def evaluate_center(self, prompts, answers) -> list[float]:
        return self.ev.evaluate_center(prompts, answers)

    def update(self, step) -> list[dict]:
        """Apply an :class:`~espert.update.Update` (as the pool sent it, through Ray's object store)."""
        self.ev.update(step)
        return self.ev.checksum()

    def checksum(self) -> list[dict]:
        return self.ev.checksum()

    def center_state(self) -> dict:
        """The center as packed tensors (``wire.pack_tensor``): what a new engine loads to catch up."""
        from espert.vllm.wire import pack_tensor

        return {k: pack_tensor(v) for k, v in self.ev.center_state().items()}

    def load_center(self, state: dict) -> list[dict]:
        from espert.vllm.wire import unpack_tensor

        self.ev.load_center({k: unpack_tensor(v) for k, v in state.items()})
        return self.ev.checksum()

    def catch_up(self, state: dict | None, updates: list) -> list[dict]:
        """Bring a new engine to the pool's center: load ``state`` (packed, as :meth:`center_state` gives
        it; None: keep the current center), then apply ``updates`` (:class:`~espert.update.Update`) in
        order.  Returns the checksum the pool compares with the live engines' at that point of the log."""
        if state is not None:
            self.load_center(state)
        for step in updates:
            self.ev.update(step)
        return self.ev.checksum()

    def rpc(self, method: str, *args):
        """Call a worker-extension method directly (streaming checkpoints, diagnostics and tests)."""
        return self.ev.rpc(method, *args)

    def timings(self) -> dict:
        return dict(self.ev.timings)

    def close(self) -> None:
        self.ev.close()
