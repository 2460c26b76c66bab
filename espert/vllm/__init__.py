"""espert inside vLLM, by process side.

    from espert.vllm import VLLMEvaluator, make_llm, EnginePool

- ``driver/``: the training process's side (the evaluator, the engine pool, center streaming);
- ``engine/``: what runs inside each vLLM worker (the ``es_*`` RPCs, the logical parameter map);
- ``wire.py``: the format the two exchange;
- ``patches/``: every patch of vLLM internals, installed by one version-gated ``install()``.

Importing this package does not import vLLM; the submodules do.  See docs/vllm.md.
"""

from __future__ import annotations

__all__ = ["VLLMEvaluator", "make_llm", "EnginePool", "quiet_logging"]


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
        from espert.vllm.driver import evaluator

        return getattr(evaluator, name)
    if name == "EnginePool":
        from espert.vllm.driver.pool import EnginePool

        return EnginePool
    raise AttributeError(name)
