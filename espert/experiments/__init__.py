"""Experiments built on the library: ``espert compare`` (ES against TRL's GRPO on one budget,
:mod:`espert.experiments.compare`) and ``espert sweep`` (one config over a grid,
:mod:`espert.experiments.sweep`).

Their heavy packages (TRL, datasets, matplotlib, Ray) are imported only when a command runs, so
``import espert`` and ``espert --help`` work without them.
"""
