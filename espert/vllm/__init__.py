"""espert inside vLLM: worker extension, logical param map, CPU patch, evaluator, engine pool.

    from espert.vllm import VLLMEvaluator, make_llm, EnginePool

Importing this package does not import vLLM; the submodules do.  See docs/vllm.md.
"""

from __future__ import annotations

WORKER_EXTENSION = "espert.vllm.worker.ESWorkerExtension"

__all__ = ["WORKER_EXTENSION", "VLLMEvaluator", "make_llm", "EnginePool", "quiet_logging"]


def quiet_logging(verbose: bool = False) -> None:
    """vLLM logs warnings only, unless ``verbose`` (its INFO lines, e.g. one "Successfully reset prefix
    cache" per weight change, flood the progress bar).  A ``VLLM_LOGGING_LEVEL`` the user set wins.

    Call before vLLM is imported (its worker processes read the variable); an imported vLLM's
    ``vllm`` logger is set too."""
    import logging
    import os

    ours = os.environ.get("_ESPERT_VLLM_LOGGING_LEVEL")
    if "VLLM_LOGGING_LEVEL" not in os.environ or os.environ["VLLM_LOGGING_LEVEL"] == ours:
        os.environ["VLLM_LOGGING_LEVEL"] = os.environ["_ESPERT_VLLM_LOGGING_LEVEL"] = "INFO" if verbose else "WARNING"
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())


def __getattr__(name):  # lazy: keep `import espert.vllm` free of the vllm import
    if name in ("VLLMEvaluator", "make_llm"):
        from espert.vllm import evaluator

        return getattr(evaluator, name)
    if name == "EnginePool":
        from espert.vllm.pool import EnginePool

        return EnginePool
    raise AttributeError(name)
