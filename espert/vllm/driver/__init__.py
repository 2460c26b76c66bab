"""The driver side, in the training process, talking to engines by RPC: one engine (``evaluator.py``), engines
in Ray actors that can die, hang, join and leave (``pool.py``, ``actor.py``, ``chunks.py``, ``joining.py``,
``membership.py``), a center out of the workers in bounded chunks (``stream.py``) and ``evaluator: vllm`` from
a run config (``build.py``).
"""
