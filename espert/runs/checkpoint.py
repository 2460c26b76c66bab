"""Center checkpoints: ``center.safetensors``, the float32 center by logical name with its iteration as metadata.

A checkpoint is used only if its sha256 is one the log recorded (the run logs it before the file
replaces the previous one).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping

import torch

from espert.files import FORMAT, LOG, RunError, atomic_write, kill_point, sha256_file
from espert.tensorfile import write_chunks


def save_center(path: str, state, iteration: int, before_replace: Callable[[str], None] | None = None) -> str:
    """Atomically write the center (logical names) with its iteration as metadata; returns the file's sha256.

    state: ``{name: tensor}`` or a chunk source (:mod:`espert.tensorfile`, e.g. an evaluator's
    ``center_stream()``: then the driver holds one chunk, never the center); both give the same bytes.
    before_replace(sha256) runs once the new file is complete and before it replaces the old one
    (the run logs the checksum there).
    """

    def write(tmp):
        sha = write_chunks(tmp, state, {"format": "pt", "espert": FORMAT, "iteration": str(iteration)})
        kill_point("center-written", iteration)
        return sha

    return atomic_write(path, write, before_replace)


class CenterFile(Mapping):
    """A center checkpoint's tensors, each read from the file when asked for (``load_center(lazy=True)``):
    a resume hands the center to the evaluator one tensor at a time (a vLLM engine gets one message per
    tensor), so the driver never holds the whole center."""

    def __init__(self, path: str, keys: list[str]):
        self.path, self._keys = path, list(keys)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._keys:
            raise KeyError(name)
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def load_center(
    path: str, known: dict[str, int] | None = None, lazy: bool = False
) -> tuple[Mapping[str, torch.Tensor], int]:
    """``(state, iteration)`` of a center checkpoint.

    known: sha256 -> iteration of the checkpoints a run logged; when given (and not empty), the
    file must be one of them.  lazy: ``state`` is a :class:`CenterFile` (header and checksum checked
    now, tensors read when asked for) instead of a dict.  Raises FileNotFoundError, or
    :class:`RunError` naming the file and the problem (empty, checksum not in the log, not a
    safetensors file, no iteration).
    """
    from safetensors import safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(f"center checkpoint not found: {path}")
    size = os.path.getsize(path)
    if size == 0:
        raise RunError(f"{path}: damaged center checkpoint: the file is empty (0 bytes)")
    if known:
        sha = sha256_file(path)
        if sha not in known:
            raise RunError(
                f"{path}: damaged center checkpoint: its sha256 ({sha[:16]}…, {size} bytes) is none of the "
                f"{len(known)} checkpoint(s) recorded in {LOG}"
            )
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            state = CenterFile(path, sorted(f.keys())) if lazy else {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for every kind of damage
        raise RunError(
            f"{path}: damaged center checkpoint: not a readable safetensors file "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if "iteration" not in meta or not str(meta["iteration"]).isdigit():
        raise RunError(f"{path} is not an espert center checkpoint (no iteration in its metadata)")
    it = int(meta["iteration"])
    if known and known[sha] != it:
        raise RunError(
            f"{path}: damaged center checkpoint: metadata says iteration {it}, the log recorded "
            f"this file as iteration {known[sha]}"
        )
    return state, it
