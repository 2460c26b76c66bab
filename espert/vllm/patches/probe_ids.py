"""The self-test's probe tokens in vLLM's V2 model runner (``vllm.v1.worker.gpu``, vLLM 0.12 on).

:mod:`espert.vllm.engine.selftest` runs the engine's own dummy forward.  The V2 runner's dummy batch
(``InputBatch.make_dummy``) zeroes the ids, and over a padding embedding a probe proves little; so while
:func:`probe_ids` is active (the self-test's :func:`probe_forward` only) the dummy batch's ids are the
probe's, written into the same static buffer.  Every other dummy batch is vLLM's, untouched.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from espert.vllm.patches import wrap_once

if TYPE_CHECKING:  # the V2 model runner (tools/vllm_contract.py checks its members from this patch's first release)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

#: the ids the next dummy batch gets (set by :func:`probe_ids`, read by :func:`_make_dummy`)
_IDS: list[torch.Tensor] = []


@contextlib.contextmanager
def probe_ids(ids: torch.Tensor):
    """Within this block, vLLM's V2 dummy batches start with ``ids`` (int64 [n]) instead of zeros."""
    _IDS.append(ids)
    try:
        yield
    finally:
        _IDS.pop()


def probe_forward(runner: GPUModelRunner, ids: torch.Tensor) -> torch.Tensor:
    """The hidden states of ``ids`` (int64 [n]) through the V2 runner's own dummy forward (the compiled or
    captured path generation takes), with attention metadata (until 0.24 a V2 dummy run skipped it by default).
    Returns vLLM's output rows (at least n; the caller takes the first n)."""
    with probe_ids(ids):
        hidden, _ = runner._dummy_run(len(ids), skip_attn=False)
    return hidden


def _make_dummy(original, *args, **kwargs):
    batch = original(*args, **kwargs)
    if _IDS:
        ids = _IDS[-1]
        n = min(len(ids), batch.input_ids.shape[0])
        batch.input_ids[:n].copy_(ids[:n])
    return batch


def install() -> bool:
    """Wrap ``InputBatch.make_dummy`` (idempotent); True if installed now."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    return wrap_once(InputBatch, "make_dummy", _make_dummy)
