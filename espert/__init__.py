"""espert: an evolution-strategies perturbation engine for LLMs.

Layers, bottom up: noise spec (``espert.noise``) -> kernels (``csrc/``, ``kernels/``)
-> one op surface (``espert.ops``) -> model adapters -> the ES loop (``espert.es``)
-> CLI, evaluation and benchmarks.
"""

__version__ = "0.1.0"
