"""The driver side: what runs in the training process and talks to engines by RPC.

``evaluator.py`` (:class:`~espert.vllm.driver.evaluator.VLLMEvaluator` over one engine, and
:func:`~espert.vllm.driver.evaluator.make_llm`), ``pool.py`` (:class:`~espert.vllm.driver.pool.EnginePool`,
engines in Ray actors) and ``stream.py`` (a center out of the workers in bounded chunks).
"""
