"""The center out of vLLM's workers in bounded chunks: straight into a safetensors file, or into logical tensors.

A center can be tens of GB (a 7 B model's float32 master is 28 GB).  Sending it as one RPC result
costs the blob plus 2–3 driver-side copies.  Here every TP rank cuts its center pieces into chunks
of at most ``chunk_bytes`` (flat element ranges of one local tensor), and the driver asks for the
k-th chunk of every rank in one ``collective_rpc("es_center_chunk", k, chunk_bytes)``; each answer
is ``(view index, start, stop, raw bytes)`` or None when that rank is done.

- :class:`CenterStream` is the center as a chunk source (:mod:`espert.tensorfile`): ``Run.checkpoint``
  writes the checkpoint and the export from it (``VLLMEvaluator.center_stream``), each chunk at its
  place in a preallocated safetensors file (a block of a TP-sharded tensor lands as row segments at
  computed offsets): the driver never holds more than one chunk of the center.  The bytes are
  exactly those of :func:`espert.tensorfile.write_safetensors` for the same tensors and metadata
  (sorted header, tensors ordered by element size then name), so checkpoint hashes do not depend on
  the route.  :func:`write_center` writes one file from it.
- :func:`pull_center` fills preallocated logical tensors chunk by chunk (one copy: the result).

Pieces replicated over ranks (k/v heads when tp > kv heads) are written by each rank that holds
them; :func:`pull_center` checks that they agree bit for bit.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from espert.tensorfile import CHUNK_BYTES, read_header, write_chunks
from espert.vllm.params import PIECE_DTYPES, bits, logical_shape, tuple_to_block


def chunk_plan(numels: list[int], esizes: list[int], chunk_bytes: int):
    """Yield ``(view index, start, stop)`` flat element ranges of at most ``chunk_bytes`` bytes, in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    for i, (n, e) in enumerate(zip(numels, esizes)):
        per = max(1, chunk_bytes // e)
        for a in range(0, n, per):
            yield i, a, min(n, a + per)


def _layouts(rpc: Callable) -> list[list[tuple]]:
    """Per rank: ``[(name, local shape, block tuple, dtype name)]``."""
    return rpc("es_center_layout")


def _logical(layouts) -> dict[str, tuple[tuple[int, ...], str]]:
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for rank in layouts:
        for name, shape, bt, dt in rank:
            ls = logical_shape(shape, tuple_to_block(bt))
            if out.setdefault(name, (ls, dt)) != (ls, dt):
                raise ValueError(f"{name}: ranks disagree on the logical tensor ({out[name]} vs {(ls, dt)})")
    return out


def _segments(shape, bt, logical, a: int, b: int):
    """``(logical flat offset, local flat start, local flat stop)`` runs covering local elements [a, b)."""
    block = tuple_to_block(bt)
    cols = int(shape[-1]) if len(shape) else 1
    if block is None or block.logical_rows is None:
        yield a, a, b
        return
    ro, co = (0, block.col_offset) if len(shape) == 1 else (block.row_offset, block.col_offset)
    lcols = int(logical[-1])
    if co == 0 and cols == lcols:  # whole rows: one contiguous run
        yield ro * lcols + a, a, b
        return
    i = a
    while i < b:
        r, c = divmod(i, cols)
        j = min(b, (r + 1) * cols)
        yield (ro + r) * lcols + co + c, i, j
        i = j


def _chunks(rpc: Callable, chunk_bytes: int):
    k = 0
    while True:
        got = rpc("es_center_chunk", k, int(chunk_bytes))
        if all(g is None for g in got):
            return
        yield got
        del got  # not held while the next chunk arrives
        k += 1


class CenterStream:
    """The workers' center as a chunk source (:mod:`espert.tensorfile`): ``layout`` holds every logical
    piece the workers list (``es_center_layout``), and each pass over it streams the center anew in
    chunks of at most ``chunk_bytes``, yielding ``(logical name, logical flat offset, 1-D tensor)``
    segments (a TP column block arrives as row segments).  Pieces replicated over ranks come once per
    rank that holds them."""

    def __init__(self, rpc: Callable, chunk_bytes: int = CHUNK_BYTES):
        self.rpc, self.chunk_bytes = rpc, int(chunk_bytes)
        self.layouts = _layouts(rpc)
        self._logical = _logical(self.layouts)
        self.layout = {n: (tuple(s), PIECE_DTYPES[dt]) for n, (s, dt) in self._logical.items()}

    def __iter__(self):
        for got in _chunks(self.rpc, self.chunk_bytes):
            for rank, g in enumerate(got):
                if g is None or g[2] <= g[1]:
                    continue
                i, a, b, raw = g
                name, shape, bt, dt = self.layouts[rank][i]
                src = torch.frombuffer(bytearray(raw), dtype=PIECE_DTYPES[dt])
                for lo, s0, s1 in _segments(shape, bt, self._logical[name][0], a, b):
                    yield name, lo, src[s0 - a : s1 - a]
                del src, raw
            del got  # not held while the next chunk arrives


def write_center(
    rpc: Callable, path: str, metadata: dict[str, str] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> str:
    """Stream the workers' center into a safetensors file at ``path``; returns its sha256.

    rpc: ``VLLMEvaluator.rpc``.  metadata: the header's ``__metadata__`` (string values).
    Peak extra driver memory: one chunk (plus the header).
    """
    return write_chunks(path, CenterStream(rpc, chunk_bytes), metadata)


def pull_center(rpc: Callable, chunk_bytes: int = CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """The workers' center as logical tensors (host), filled chunk by chunk; replicated pieces must agree."""
    layouts = _layouts(rpc)
    logical = _logical(layouts)
    out = {n: torch.empty(s, dtype=PIECE_DTYPES[dt]) for n, (s, dt) in logical.items()}
    seen = {n: torch.zeros(int(torch.Size(s).numel()), dtype=torch.bool) for n, (s, _) in logical.items()}
    for got in _chunks(rpc, chunk_bytes):
        for rank, g in enumerate(got):
            if g is None:
                continue
            i, a, b, raw = g
            name, shape, bt, dt = layouts[rank][i]
            src = (
                torch.frombuffer(bytearray(raw), dtype=PIECE_DTYPES[dt])
                if b > a
                else torch.empty(0, dtype=PIECE_DTYPES[dt])
            )
            flat, cov = out[name].view(-1), seen[name]
            for lo, s0, s1 in _segments(shape, bt, logical[name][0], a, b):
                piece, dst = src[s0 - a : s1 - a], flat[lo : lo + (s1 - s0)]
                done = cov[lo : lo + (s1 - s0)]
                if done.any() and not torch.equal(bits(dst[done]), bits(piece[done])):
                    raise ValueError(f"{name}: replicated pieces differ between ranks")
                dst.copy_(piece)
                done.fill_(True)
    for name, c in seen.items():
        if not bool(c.all()):
            raise ValueError(f"{name}: {int((~c).sum())} logical elements are not covered by any rank")
    return out


def _checkpoint_files(model: str) -> list[str] | None:
    """The ``*.safetensors`` files of a local model directory or a Hub id already in the local cache (None:
    none found)."""
    d = model if os.path.isdir(model) else None
    if d is None:
        try:
            from huggingface_hub import snapshot_download

            d = snapshot_download(model, allow_patterns=["*.safetensors", "*.json"], local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached / not a Hub id: nothing to check against
            return None
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    return [os.path.join(d, f) for f in files] or None


def checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]] | None:
    """``{tensor name: shape}`` from the headers of a checkpoint's ``*.safetensors`` files (no tensor is read).

    model: a local directory, or a Hub id already in the local cache.  None when no safetensors
    checkpoint is found (then names cannot be checked).
    """
    files = _checkpoint_files(model)
    if files is None:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update({k: tuple(v["shape"]) for k, v in read_header(f)[1].items()})
    return shapes


def checkpoint_rms_scales(model: str, dtype: str, include=None, exclude=None) -> dict[str, float]:
    """``{checkpoint name: σ multiplier}`` for ``sigma_mode: rms``: :func:`~espert.evaluators.torch_model.tensor_rms`
    of each whole tensor of the checkpoint, as loaded in ``dtype`` (what ``rms_scales`` sees in a
    transformers model), for the names include / exclude select (patterns as in ``vllm_param_views``).

    Computed on the driver, one tensor in memory at a time, and sent to every worker: a TP shard or a
    piece of a fused parameter then gets the scale of its whole logical tensor, bit for bit the torch
    evaluator's (a reduction over shards would differ in the last bits).  Raises when the model has no
    safetensors checkpoint.
    """
    from safetensors import safe_open

    from espert.evaluators.torch_model import tensor_rms, torch_dtype
    from espert.params import matches

    files = _checkpoint_files(model)
    if files is None:
        raise FileNotFoundError(
            f"sigma_mode=rms with vLLM reads the base tensors from a safetensors checkpoint; {model} has none"
        )
    dt = torch_dtype(dtype)
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if (include and not matches(name, include)) or (exclude and matches(name, exclude)):
                    continue
                t = st.get_tensor(name)
                if t.is_floating_point():
                    out[name] = tensor_rms(t.to(dt))
    return out
