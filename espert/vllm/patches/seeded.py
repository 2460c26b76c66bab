"""Seeded sampling on vLLM-CPU when a prompt is prefilled in chunks.

A request with ``SamplingParams(seed=...)`` gets its own ``torch.Generator``.  The token sampled for a
partial prefill is discarded, and vLLM (0.11 to 0.33) undoes its draw with ``gen.set_offset(gen.get_offset()
- 4)`` in ``GPUModelRunner._bookkeeping_sync``; torch's CPU generator has no offset, so the engine dies
(``EngineDeadError``).  The patch saves the state of each CPU generator whose token will be discarded
before ``_sample`` and puts it back after the step (held out of the rewind), so a request's samples do not
depend on how its prompt was chunked, as on GPU.  vLLM 0.34 samples from a hash of (seed, position): nothing
to rewind.  CUDA generators are left to vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from espert.vllm.patches import for_release, releases, wrap_once

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


@releases("0.12")
def _discarded_rows(runner: GPUModelRunner):
    """The batch rows whose sampled token vLLM will discard (partial prefills): a mask since vLLM 0.12."""
    return np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]


@releases("0.11", "0.11")
def _discarded_rows_0_11(runner: GPUModelRunner):
    """The same rows on vLLM 0.11, which lists them."""
    return runner.discard_request_indices.np[: runner.num_discarded_requests]


#: the one of the two above for the installed vLLM (set by install)
_DISCARDED = {"rows": _discarded_rows}


def _discarded_cpu_generators(runner: GPUModelRunner) -> dict:
    gens = runner.input_batch.generators
    out = {}
    for i in _DISCARDED["rows"](runner):
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

    _DISCARDED["rows"] = for_release(_discarded_rows, _discarded_rows_0_11)
    a = wrap_once(GPUModelRunner, "_sample", _sample)
    b = wrap_once(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync)
    return a or b
