"""Register espert's backend (:class:`espert.vllm.engine.transfer.ESWeightTransferEngine`) with vLLM's
weight-transfer factory, under the name ``"espert"``.

The registration is lazy (a module path), so nothing more is imported until vLLM creates the engine in
``load_model``; vLLM imports the worker extension module, which installs this, in every worker first.
"""

from __future__ import annotations


def install() -> bool:
    """Register the backend (idempotent); False on a vLLM without the weight-transfer API."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    except ImportError:  # the es_* RPCs work without it
        return False
    try:
        WeightTransferEngineFactory.register_engine("espert", "espert.vllm.engine.transfer", "ESWeightTransferEngine")
    except ValueError:  # registered already: installed before in this process
        pass
    return True
