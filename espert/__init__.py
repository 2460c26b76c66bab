"""espert: an evolution-strategies perturbation engine for LLMs.

Layers, bottom up (docs/architecture.md; tests/test_layering.py enforces them): config
(``espert.config``) -> noise spec (``espert.noise``) -> kernels and the op surface
(``espert.ops``) -> params and centers -> evaluators -> the ES algorithm (``espert.es``) ->
runs and the training loop (``espert.trainer``) -> CLI and evaluation.

``espert.train(config, run_dir, task=...)`` and ``espert.ESConfig`` are loaded on first use, so
``import espert`` imports neither torch nor the compiled module.
"""

__version__ = "0.1.0"

_LAZY = {"train": ("espert.trainer", "train"), "ESConfig": ("espert.config", "ESConfig")}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'espert' has no attribute {name!r}")
