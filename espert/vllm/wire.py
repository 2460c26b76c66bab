"""The RPC format between espert's driver and its vLLM workers: tensors as bytes, blocks as tuples,
logical tensors assembled from (or split into) every rank's pieces, and the chunk plans a center streams in.

Driver and workers meet only here (no vLLM import): the worker packs (:func:`pack_tensor`, the chunks of
:func:`chunk_plan`), the driver unpacks and reassembles (:func:`assemble`, :func:`segments`), and both
sides agree on the logical coordinates of a piece (:func:`logical_shape`, :func:`block_slices`) and on the LoRA rank
a batched population needs (:func:`batched_rank`, :func:`lora_rank_for`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from espert.noise import NoiseFamily
from espert.ops import Block
from espert.params import ParamView

#: vLLM's allowed ``max_lora_rank`` values (vllm/config/lora.py); a lowrank:r population takes the
#: smallest one >= r and leaves the extra rank columns at zero.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_for(rank: int) -> int:
    """The ``max_lora_rank`` a lowrank:``rank`` population needs: the smallest vLLM allows that is >= rank."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"lowrank:{rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def batched_rank(noise: str) -> int:
    """The rank r of a ``lowrank:r`` noise spec; ValueError naming the noise for any other family."""
    fam = NoiseFamily.parse(noise)
    if fam.name != "lowrank":
        raise ValueError(
            f"members: batched serves each member as a rank-r LoRA adapter, so it needs noise: lowrank:r (got {noise!r})"
        )
    return fam.rank


def logical_shape(tensor_shape: Sequence[int], block: Block | None) -> tuple[int, ...]:
    """Shape of the logical parameter a view of ``tensor_shape`` at ``block`` belongs to."""
    if block is None or block.logical_rows is None:
        return tuple(tensor_shape)
    if len(tensor_shape) == 1:
        return (block.logical_cols,)
    return (block.logical_rows, block.logical_cols)


def block_slices(shape: Sequence[int], block: Block | None) -> tuple[slice, ...]:
    """Index of a block of local ``shape`` inside its logical tensor."""
    if block is None:
        return tuple(slice(None) for _ in shape)
    if len(shape) == 1:
        return (slice(block.col_offset, block.col_offset + shape[0]),)
    return (slice(block.row_offset, block.row_offset + shape[0]), slice(block.col_offset, block.col_offset + shape[1]))


#: The fields of a worker's checksum (``es_checksum``) that replicas must agree on bit for bit; the rest
#: (float sums) are for people.
EXACT_FIELDS = ("rank", "live_bits", "center_bits", "hash")


def exact_fields(checksum: Sequence[dict]) -> list[dict]:
    """An engine's per-rank checksums reduced to :data:`EXACT_FIELDS`: what two replicas compare."""
    return [{k: r[k] for k in EXACT_FIELDS} for r in checksum]


#: dtype name -> dtype of center pieces: the floats, int64 for the optimizer's step (``optim.step``), int16 for a
#: residual8 master of quantized codes (``code·256 + r``, :func:`espert.quant.center.fixed_master`).
PIECE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int16": torch.int16,
}
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a contiguous piece (an integer view of the same element size; no copy)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def pack_tensor(t: torch.Tensor) -> list:
    """A host tensor as ``[dtype name, shape, raw bytes]``: survives vLLM's msgpack RPC without
    ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (which would otherwise turn nested tensors into lists)."""
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in PIECE_DTYPES:
        raise TypeError(f"cannot pack dtype {t.dtype}")
    return [name, list(t.shape), bits(t).numpy().tobytes()]


def unpack_tensor(x) -> torch.Tensor:
    """Inverse of :func:`pack_tensor` (also accepts a plain tensor, as in-process RPC returns)."""
    if isinstance(x, torch.Tensor):
        return x
    name, shape, raw = x
    dt = PIECE_DTYPES[name]
    buf = bytearray(raw)
    if not buf:
        return torch.empty(tuple(shape), dtype=dt)
    return torch.frombuffer(buf, dtype=dt).reshape(tuple(shape))


def block_to_tuple(block: Block | None) -> tuple | None:
    return None if block is None else (block.row_offset, block.col_offset, block.logical_rows, block.logical_cols)


def tuple_to_block(t) -> Block | None:
    return None if t is None else Block(*t)


def layout_rows(views) -> list[tuple[str, list, tuple | None, str]]:
    """``(logical name, local shape, block tuple, dtype name)`` of each ParamView (what the layout RPCs return)."""
    return [
        (v.name, list(v.tensor.shape), block_to_tuple(v.block), str(v.tensor.dtype).removeprefix("torch."))
        for v in views
    ]


def assemble(shards: Sequence[Sequence[tuple[str, torch.Tensor, tuple | None]]]) -> dict[str, torch.Tensor]:
    """Logical tensors from every rank's ``(name, tensor, block tuple)`` pieces.

    Pieces that overlap (k/v replicated over ranks) must agree bit for bit, else ValueError; a
    logical element that no piece covers is an error too.
    """
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for rank_pieces in shards:
        for name, t, bt in rank_pieces:
            t = unpack_tensor(t)
            block = tuple_to_block(bt)
            shape = logical_shape(t.shape, block)
            if name not in out:
                out[name] = torch.zeros(shape, dtype=t.dtype)
                covered[name] = torch.zeros(shape, dtype=torch.bool)
            if tuple(out[name].shape) != shape:
                raise ValueError(f"{name}: pieces disagree on the logical shape ({tuple(out[name].shape)} vs {shape})")
            idx = block_slices(t.shape, block)
            place(name, out[name][idx], covered[name][idx], t)
    check_covered(covered, "piece")
    return out


def place(name: str, dst: torch.Tensor, seen: torch.Tensor, piece: torch.Tensor) -> None:
    """Copy ``piece`` into ``dst`` and mark ``seen`` (bool, same shape); elements already seen (a piece
    replicated over ranks) must agree bit for bit, else ValueError."""
    if seen.any() and not torch.equal(bits(dst[seen]), bits(piece[seen])):
        raise ValueError(f"{name}: replicated pieces differ between ranks")
    dst.copy_(piece)
    seen.fill_(True)


def check_covered(covered: dict[str, torch.Tensor], by: str) -> None:
    """ValueError naming the first logical tensor with an element no ``by`` covered (``covered``: bool masks)."""
    for name, c in covered.items():
        if not bool(c.all()):
            raise ValueError(f"{name}: {int((~c).sum())} logical elements are not covered by any {by}")


def split_logical(views: Sequence[ParamView], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The local blocks of logical tensors ``state`` (name -> full logical tensor) for ``views``, by view name."""
    out = {}
    for v in views:
        if v.name not in state:
            raise KeyError(f"state has no tensor for {v.name}")
        full = state[v.name]
        want = logical_shape(v.tensor.shape, v.block)
        if tuple(full.shape) != want:
            raise ValueError(f"{v.name}: state has shape {tuple(full.shape)}, the logical parameter is {want}")
        out[v.name] = full[block_slices(v.tensor.shape, v.block)]
    return out


# ---- chunked transfer of a center ------------------------------------------------------------------


def chunk_plan(numels: list[int], esizes: list[int], chunk_bytes: int):
    """Yield ``(view index, start, stop)`` flat element ranges of at most ``chunk_bytes`` bytes, in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    for i, (n, e) in enumerate(zip(numels, esizes)):
        per = max(1, chunk_bytes // e)
        for a in range(0, n, per):
            yield i, a, min(n, a + per)


def logical_layout(layouts) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{logical name: (logical shape, dtype name)}`` from every rank's ``es_center_layout`` rows (ranks must agree)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for rank in layouts:
        for name, shape, bt, dt in rank:
            ls = logical_shape(shape, tuple_to_block(bt))
            if out.setdefault(name, (ls, dt)) != (ls, dt):
                raise ValueError(f"{name}: ranks disagree on the logical tensor ({out[name]} vs {(ls, dt)})")
    return out


def segments(shape, bt, logical, a: int, b: int):
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
