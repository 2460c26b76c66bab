"""The driver side: what runs in the training process and talks to engines by RPC.

``evaluator.py`` (:class:`~espert.vllm.driver.evaluator.VLLMEvaluator` over one engine, and
:func:`~espert.vllm.driver.evaluator.make_llm`), ``pool.py`` (:class:`~espert.vllm.driver.pool.EnginePool`,
engines in Ray actors that can die, hang, join and leave), ``actor.py`` (one engine's actor; no torch or
vLLM at import), ``chunks.py`` (a population in chunks, deadlines from observed times), ``membership.py``
(how a new engine catches up: the update log, replay or stream) and ``stream.py`` (a center out of the
workers in bounded chunks).
"""
