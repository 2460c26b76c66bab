"""Byte-deterministic safetensors files, written whole or from chunks at their places.

The safetensors library writes its metadata map in a per-process random order; here header keys
are sorted and tensors laid out by (element size descending, name), so the same tensors and
metadata always give the same bytes, whichever route wrote them.

A *chunk source* is what a center too large for the driver's memory is written from: an object
with

- ``layout``: ``{name: (shape, torch dtype)}``, every tensor of the file;
- ``chunk_bytes``: the most bytes one chunk holds (copies alongside it use pieces of that size);
- iteration (may be repeated; each pass streams anew): ``(name, flat element offset, 1-D tensor)``
  pieces, in any order, each of the layout's dtype.

:class:`StateChunks` makes one from a dict of tensors; ``espert.vllm.driver.stream.CenterStream`` streams
one out of vLLM's workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Iterator, Mapping

import torch

ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ST_TORCH = {v: k for k, v in ST_DTYPES.items()}
#: Default chunk: 64 MiB.
CHUNK_BYTES = 64 << 20

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def file_order(layout: Layout) -> list[str]:
    """The names in the order their data lies in the file: element size descending, then name."""
    return sorted(layout, key=lambda n: (-layout[n][1].itemsize, n))


def read_header(path: str) -> tuple[dict[str, str], dict[str, dict], int]:
    """``(metadata, {name: {"dtype", "shape", "data_offsets"}}, data start)`` of a safetensors file (no
    tensor is read); ``data_offsets`` count from the data start, a byte offset in the file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    meta = head.pop("__metadata__", None) or {}
    return meta, head, 8 + n


class TensorFileWriter:
    """A safetensors file of a fixed ``layout`` (preallocated), filled by :meth:`write` in any order.

    Use as a context manager (closes the file); :meth:`sha256` is the hash of the written file:
    taken while writing when the pieces arrived in file order (a dict written whole), else by
    reading the file back in ``chunk_bytes`` pieces.  Raises ValueError naming the file for a dtype
    safetensors cannot store.
    """

    def __init__(
        self, path: str, layout: Layout, metadata: dict[str, str] | None = None, chunk_bytes: int = CHUNK_BYTES
    ):
        for name, (_, dt) in layout.items():
            if dt not in ST_DTYPES:
                raise ValueError(f"{path}: cannot store {name} of dtype {dt} in safetensors")
        header: dict = {"__metadata__": dict(sorted((metadata or {}).items()))} if metadata else {}
        self.path, self.layout, self.chunk_bytes = path, layout, max(1, int(chunk_bytes))
        self._at: dict[str, tuple[int, int]] = {}  # name -> (absolute byte offset, bytes)
        off = 0
        for name in file_order(layout):
            shape, dt = layout[name]
            n = dt.itemsize * int(torch.Size(shape).numel())
            header[name] = {"dtype": ST_DTYPES[dt], "shape": list(shape), "data_offsets": [off, off + n]}
            self._at[name] = (off, n)
            off += n
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # 8-byte aligned data, as the safetensors library writes it
        start = 8 + len(head)
        self._at = {k: (start + a, n) for k, (a, n) in self._at.items()}
        self.size = start + off
        self._f = open(path, "wb")
        self._h: hashlib._Hash | None = hashlib.sha256()
        self._end = 0
        self._written = dict.fromkeys(layout, 0)  # bytes written per tensor (a gap is an error at close)
        self._put(0, struct.pack("<Q", len(head)) + head)
        self._f.truncate(self.size)

    def _put(self, pos: int, buf) -> None:
        try:
            if pos != self._f.tell():
                self._f.seek(pos)
            self._f.write(buf)
        except OSError as e:  # a write() error names no file (ENOSPC, EIO, ...): name this one
            e.filename = e.filename or self.path
            raise
        if self._h is not None:
            if pos == self._end:  # still in file order: hash as we go
                self._h.update(buf)
                self._end += len(buf)
            else:
                self._h = None

    def write_bytes(self, name: str, offset: int, buf) -> None:
        """Raw bytes of tensor ``name`` at byte ``offset`` within it."""
        pos, n = self._at[name]
        if offset < 0 or offset + len(buf) > n:
            raise ValueError(f"{self.path}: {len(buf)} bytes at {offset} do not fit {name} ({n} bytes)")
        if len(buf):
            self._put(pos + offset, buf)
            self._written[name] += len(buf)

    def write(self, name: str, offset: int, flat: torch.Tensor) -> None:
        """Elements ``[offset, offset + flat.numel())`` of tensor ``name`` (flat, of the layout's dtype)."""
        dt = self.layout[name][1]
        if flat.dtype != dt:
            raise ValueError(f"{self.path}: {name} is {dt} in the layout, a piece of it is {flat.dtype}")
        if flat.numel():
            b = flat.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self.write_bytes(name, offset * dt.itemsize, memoryview(b))

    def close(self, check: bool = True) -> None:
        """Close the file (idempotent).  check: raise ValueError naming a tensor that received fewer bytes
        than it holds (its chunks did not cover it; pieces replicated over ranks may count twice)."""
        if not self._f.closed:
            try:
                self._f.close()  # flushes the last buffered bytes: the disk may refuse them here
            except OSError as e:
                e.filename = e.filename or self.path
                raise
            short = [(k, self._written[k], self._at[k][1]) for k in self.layout if self._written[k] < self._at[k][1]]
            if check and short:
                k, got, n = short[0]
                raise ValueError(f"{self.path}: {k} received {got} of its {n} bytes (the chunks do not cover it)")

    def sha256(self) -> str:
        """Close the file and return its hash."""
        self.close()
        if self._h is not None and self._end == self.size:
            return self._h.hexdigest()
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for buf in iter(lambda: f.read(self.chunk_bytes), b""):
                h.update(buf)
        return h.hexdigest()

    def __enter__(self) -> "TensorFileWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close(check=exc[0] is None)


class StateChunks:
    """A chunk source over a dict of tensors (any device): each tensor is one piece, in file order."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES):
        self.tensors, self.chunk_bytes = tensors, chunk_bytes
        self.layout: Layout = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}

    def __iter__(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        for name in file_order(self.layout):
            yield name, 0, self.tensors[name].reshape(-1)


class FileChunks:
    """A safetensors file as a chunk source: its tensors read back at most ``chunk_bytes`` at a time.

    A streamed checkpoint exports from the center file it has just written instead of pulling the
    center from the workers a second time; an export copies the base's other tensors with it.
    skip: names whose data is not read (``layout`` still lists every tensor of the file)."""

    def __init__(self, path: str, chunk_bytes: int = CHUNK_BYTES, skip=()):
        _, self.entries, self.start = read_header(path)
        self.path, self.chunk_bytes, self.skip = path, max(1, int(chunk_bytes)), frozenset(skip)
        self.layout: Layout = {k: (tuple(e["shape"]), ST_TORCH[e["dtype"]]) for k, e in self.entries.items()}

    def __iter__(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        with open(self.path, "rb") as f:
            for name, e in sorted(self.entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                if name in self.skip:
                    continue
                dt = self.layout[name][1]
                a, b = e["data_offsets"]
                step = max(1, self.chunk_bytes // dt.itemsize) * dt.itemsize
                f.seek(self.start + a)
                for off in range(0, b - a, step):
                    yield (
                        name,
                        off // dt.itemsize,
                        torch.frombuffer(bytearray(f.read(min(step, b - a - off))), dtype=dt),
                    )


def as_chunks(state) -> StateChunks:
    """``state`` as a chunk source: a dict of tensors is wrapped in :class:`StateChunks`, a source is kept."""
    return state if hasattr(state, "layout") else StateChunks(state)  # (an ABC isinstance fills caches)


def write_chunks(path: str, source, metadata: dict[str, str] | None = None) -> str:
    """Write a chunk source (or a dict of tensors) as a safetensors file; returns its sha256.  Driver memory:
    one chunk."""
    source = as_chunks(source)
    with TensorFileWriter(path, source.layout, metadata, source.chunk_bytes) as w:
        for name, offset, flat in source:
            w.write(name, offset, flat)
            del flat  # a streamed chunk is freed before the next one arrives
    return w.sha256()


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (any shapes, dtypes in :data:`ST_DTYPES`) as a safetensors file; returns its sha256.

    Header keys sorted, tensors laid out by (element size descending, name): the same tensors and
    metadata always give the same bytes (also through :func:`write_chunks`).
    """
    return write_chunks(path, StateChunks(tensors), metadata)


def checkpoint_files(model: str) -> list[str] | None:
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
