"""ES-at-Scale's drop-in as users write it in their configs
(``worker_extension_cls="espert.vllm.compat.ESAtScaleWorkerExtension"``); the class is
:class:`espert.vllm.engine.compat.ESAtScaleWorkerExtension`."""

from espert.vllm.engine.compat import ESAtScaleWorkerExtension, master_path

__all__ = ["ESAtScaleWorkerExtension", "master_path"]
