"""The center out of vLLM's workers in bounded chunks: straight into a safetensors file, or into logical tensors.

A center can be tens of GB (a 7 B model's float32 master is 28 GB), and one RPC result would cost the
blob plus 2–3 driver-side copies.  So every TP rank cuts its center pieces into chunks of at most
``chunk_bytes`` (flat element ranges of one local tensor), and the driver asks for the k-th chunk of every
rank in one ``collective_rpc("es_center_chunk", k, chunk_bytes)``: ``(view index, start, stop, raw bytes)``,
or None when that rank is done.  :class:`CenterStream` is the center as a chunk source
(:mod:`espert.tensorfile`), from which checkpoints are written with the bytes of
:func:`espert.tensorfile.write_safetensors` (checkpoint hashes do not depend on the route);
:func:`pull_center` fills logical tensors, checking that pieces replicated over ranks agree bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from espert.tensorfile import CHUNK_BYTES, write_chunks
from espert.vllm.wire import PIECE_DTYPES, check_covered, logical_layout, place, segments


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
        self.layouts = rpc("es_center_layout")  # per rank: [(name, local shape, block tuple, dtype name)]
        self._logical = logical_layout(self.layouts)
        self.layout = {n: (tuple(s), PIECE_DTYPES[dt]) for n, (s, dt) in self._logical.items()}

    def __iter__(self):
        for got in _chunks(self.rpc, self.chunk_bytes):
            for rank, g in enumerate(got):
                if g is None or g[2] <= g[1]:
                    continue
                i, a, b, raw = g
                name, shape, bt, dt = self.layouts[rank][i]
                src = torch.frombuffer(bytearray(raw), dtype=PIECE_DTYPES[dt])
                for lo, s0, s1 in segments(shape, bt, self._logical[name][0], a, b):
                    yield name, lo, src[s0 - a : s1 - a]
                del src, raw
            del got  # not held while the next chunk arrives


def write_center(
    rpc: Callable, path: str, metadata: dict[str, str] | None = None, chunk_bytes: int = CHUNK_BYTES
) -> str:
    """Stream the workers' center into a safetensors file at ``path`` (rpc: ``VLLMEvaluator.rpc``; metadata: the
    header's ``__metadata__``), holding one chunk at a time; returns its sha256."""
    return write_chunks(path, CenterStream(rpc, chunk_bytes), metadata)


def pull_center(rpc: Callable, chunk_bytes: int = CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """The workers' center as logical tensors (host), filled chunk by chunk; replicated pieces must agree."""
    stream = CenterStream(rpc, chunk_bytes)
    out = {n: torch.empty(s, dtype=dt) for n, (s, dt) in stream.layout.items()}
    seen = {n: torch.zeros(t.numel(), dtype=torch.bool) for n, t in out.items()}
    for name, lo, piece in stream:
        place(name, out[name].view(-1)[lo : lo + piece.numel()], seen[name][lo : lo + piece.numel()], piece)
    check_covered(seen, "rank")
    return out
