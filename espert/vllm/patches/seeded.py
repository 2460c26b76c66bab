"""Seeded sampling on vLLM-CPU when a prompt is prefilled in chunks.

A request with ``SamplingParams(seed=...)`` gets its own ``torch.Generator``.  When the batch's
prompts exceed the token budget of a step (``max_num_batched_tokens``), vLLM prefills a prompt over
several steps; the token sampled for a partial prefill is discarded, and vLLM 0.32 undoes its draw
with ``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``.  torch's CPU
generator (Mersenne Twister) has no offset: ``RuntimeError: CPU Generator does not use offset``, and
the engine dies (``EngineDeadError``).

The patch below undoes the draw on CPU the exact way: the state of each CPU generator whose token
will be discarded is saved before the step samples (``_sample``) and put back after it (the
generator is held out of ``_bookkeeping_sync``'s rewind), so a request's samples do not depend on
how its prompt was chunked, as on GPU.  Installed in every worker by the worker extensions
(:mod:`espert.vllm.engine.worker`, :mod:`espert.vllm.engine.sampling`); CUDA generators are left to vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from espert.vllm.patches import wrap_once

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


def _discarded_cpu_generators(runner: GPUModelRunner) -> dict:
    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    out = {}
    for i in np.nonzero(runner.discard_request_mask.np[:n])[0]:
        g = gens.get(int(i))
        if g is not None and g.device.type == "cpu":
            out[int(i)] = g
    return out


def _sample(original, runner: GPUModelRunner, *args, **kwargs):
    runner._espert_rewind = {i: (g, g.get_state()) for i, g in _discarded_cpu_generators(runner).items()}
    return original(runner, *args, **kwargs)


def _bookkeeping_sync(original, runner: GPUModelRunner, *args, **kwargs):
    saved = getattr(runner, "_espert_rewind", None) or {}
    runner._espert_rewind = None
    gens = runner.input_batch.generators
    held = {i: gens.pop(i) for i in saved if gens.get(i) is saved[i][0]}
    try:
        return original(runner, *args, **kwargs)
    finally:
        for i, g in held.items():
            g.set_state(saved[i][1])  # the discarded token's draw, undone
            gens[i] = g


def install() -> bool:
    """Wrap ``GPUModelRunner._sample`` and ``_bookkeeping_sync`` (idempotent); True if installed now."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    a = wrap_once(GPUModelRunner, "_sample", _sample)
    b = wrap_once(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync)
    return a or b
