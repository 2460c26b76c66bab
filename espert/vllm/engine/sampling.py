"""The worker extension of espert's sampling-only engines (``espert eval`` with ``--evaluator vllm``).

It has no methods: importing it in each worker installs the seeded-sampling patch
(:mod:`espert.vllm.patches.seeded`) and the counting of vLLM's repeated warnings
(:mod:`espert.vllm.patches.quiet`), and nothing else: these engines never edit weights (no plain copy beside
the packed one, as the ES worker extension keeps), so their compiled graphs are plain vLLM's and keep its
compile-cache key.
"""

from espert.vllm import patches

#: ``worker_extension_cls`` of a sampling engine.
EXTENSION = "espert.vllm.engine.sampling.SeededCPUExtension"

patches.install(only=("seeded", "quiet"))


class SeededCPUExtension:
    """A worker extension with no methods (see the module docstring)."""
