"""espert inside vLLM: worker extension, logical param map, CPU patch, evaluator, engine pool.

    from espert.vllm import VLLMEvaluator, make_llm, EnginePool

Importing this package does not import vLLM; the submodules do.  See docs/vllm.md.
"""

from __future__ import annotations

WORKER_EXTENSION = "espert.vllm.worker.ESWorkerExtension"

__all__ = ["WORKER_EXTENSION", "VLLMEvaluator", "make_llm", "EnginePool"]


def __getattr__(name):  # lazy: keep `import espert.vllm` free of the vllm import
    if name in ("VLLMEvaluator", "make_llm"):
        from espert.vllm import evaluator

        return getattr(evaluator, name)
    if name == "EnginePool":
        from espert.vllm.pool import EnginePool

        return EnginePool
    raise AttributeError(name)
