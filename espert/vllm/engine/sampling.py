"""The worker extension of espert's sampling-only engines (``espert eval`` with ``--evaluator vllm``).

It has no methods: importing it in each worker installs the seeded-sampling patch
(:mod:`espert.vllm.patches.seeded`) and nothing else, because these engines never edit weights (no
plain copy beside the packed one, as the ES worker extension keeps).
"""

from espert.vllm import patches

#: ``worker_extension_cls`` of a sampling engine.
EXTENSION = "espert.vllm.engine.sampling.SeededCPUExtension"

patches.install(only=("seeded",))


class SeededCPUExtension:
    """A worker extension with no methods (see the module docstring)."""
