"""The worker side: what runs inside each vLLM worker process, next to the live weights.

``worker.py`` (the ``es_*`` RPC surface, :class:`~espert.vllm.engine.worker.ESWorkerExtension`),
``compat.py`` (ES-at-Scale's method names over it), ``transfer.py`` (the same commands through vLLM's
weight-transfer API), ``params.py`` (vLLM's fused and sharded layout -> logical ParamViews),
``lora.py`` (batched members in LoRA slots), ``w8a8.py`` (the W8A8 int8 center), ``repack.py`` (the
center that marks packed layers stale) and ``selftest.py`` (edits must reach the forward pass).
"""
