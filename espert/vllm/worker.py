"""The worker extension's class path as users write it in their configs
(``worker_extension_cls="espert.vllm.worker.ESWorkerExtension"``); the class is
:class:`espert.vllm.engine.worker.ESWorkerExtension`."""

from espert.vllm.engine.worker import ESWorkerExtension

__all__ = ["ESWorkerExtension"]
