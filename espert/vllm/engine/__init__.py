"""The worker side: what runs inside each vLLM worker process, next to the live weights: the ``es_*`` RPCs
(``worker.py``), ES-at-Scale's names over them (``compat.py``), vLLM's weight-transfer API (``transfer.py``),
vLLM's layout as logical ParamViews (``params.py``), LoRA-slot members (``lora.py``), quantized centers
(``w8a8.py``), the repacking center (``repack.py``) and the check that edits reach the forward (``selftest.py``).
"""
