"""Quantized weight formats and their storage layouts, as torch/numpy references.

Every format describes one logical weight ``W[N_out, K_in]`` (row-major, as in ``nn.Linear``)
by integer codes, scales and (int4) zero points::

    int8        value = code · s[n]                  code int8 in [-128, 127]
    fp8         value = e4m3(code) · s               s per tensor or per output channel
    int4        value = (code − z[k//g, n]) · s[k//g, n]     code in [0, 15]

and stores the codes in one of these layouts (``QuantWeight.fmt``):

    int8 / fp8  [N, K] row-major (row stride ≥ K), or [K, N] row-major, or vLLM's (K, N)
                transposed view of [N, K] storage (give the tensor, ``transposed=True``)
    gptq        int32 [K/8, N]:   code(n, k) = qw[k//8, n] >> 4·(k%8) & 0xF
    awq         int32 [K, N/8]:   code(n, k) = qw[k, n//8] >> 4·AWQ_REV[n%8] & 0xF
                (AWQ packs columns in the order [0, 2, 4, 6, 1, 3, 5, 7])
    cpu_w4a16   int32 [N/16, 2K]: code(n, k) = qw[n//16, 2k + (n%16)//8] >> 4·(n%8) & 0xF
                (vLLM's CPU W4A16 runtime layout, docs/quantized.md "Formats and layouts")
    marlin      int32 [K/16, 2N]: vLLM's GPTQ-Marlin runtime layout (:func:`marlin_index`); scales
                are column-permuted (:func:`marlin_scale_col`)

Scales: int8 / fp8 ``[N]`` / ``[N, 1]`` (per channel) or one element (per tensor; fp8, and int8);
int4 ``[K/g, N]`` (g = ``group_size``; -1 = one group spanning K, scales ``[1, N]``), any of
float32 / float16 / bfloat16.  Zero points are only needed to dequantize: ES moves codes, and a
code step is a value step of s whatever z is.  ``zeros`` is the *unpacked* integer tensor
``[K/g, N]`` (None: symmetric, z = 8 for int4, 0 for int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FORMATS = ("int8", "fp8", "gptq", "awq", "cpu_w4a16", "marlin")
INT4_FORMATS = ("gptq", "awq", "cpu_w4a16", "marlin")
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_MAX = 448.0
AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i holds column AWQ_ORDER[i] of its 8
AWQ_REV = np.argsort(AWQ_ORDER)  # column t sits in nibble AWQ_REV[t] = [0, 4, 1, 5, 2, 6, 3, 7]
DEFAULT_RANGE = {"int8": (-128, 127), "fp8": (-FP8_MAX, FP8_MAX), "int4": (0, 15)}


def elem_of(fmt: str) -> str:
    """'int8' | 'fp8' | 'int4': the code type of a format."""
    return "int4" if fmt in INT4_FORMATS else fmt


@dataclass(eq=False)
class QuantWeight:
    """A quantized ``nn.Linear`` weight (logical ``[out_features, in_features]``) in its storage layout.

    fmt: one of ``FORMATS``.  qweight: the storage tensor, edited in place by the ops (int8 for
    ``int8``, float8_e4m3fn for ``fp8``, int32 for the int4 layouts; see the module docstring for
    shapes).  scales: float32/float16/bfloat16, see the module docstring.  group_size: int4 group
    along K (-1: one group).  zeros: unpacked int zero points ``[K/g, N]`` for int4 (None: 8),
    only used by :func:`dequantize`.  transposed: 8-bit formats only, ``qweight`` has shape
    ``[K, N]`` (a row-major [K, N] tensor, or the ``.t()`` view of [N, K] storage).
    qmin / qmax: the clamp range of codes (defaults: int8 [-128, 127], int4 [0, 15], fp8 ±448).
    """

    fmt: str
    qweight: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group_size: int = -1
    zeros: torch.Tensor | None = None
    transposed: bool = False
    qmin: float | None = None
    qmax: float | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def elem(self) -> str:
        return elem_of(self.fmt)

    @property
    def code_range(self) -> tuple[float, float]:
        lo, hi = DEFAULT_RANGE[self.elem]
        return (lo if self.qmin is None else self.qmin, hi if self.qmax is None else self.qmax)

    @property
    def group(self) -> int:
        """The effective group along K (K when group_size is -1)."""
        return self.in_features if self.group_size in (-1, None) else self.group_size

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size()

    def clone(self) -> "QuantWeight":
        return QuantWeight(
            self.fmt,
            self.qweight.clone(),
            self.scales.clone(),
            self.out_features,
            self.in_features,
            self.group_size,
            None if self.zeros is None else self.zeros.clone(),
            self.transposed,
            self.qmin,
            self.qmax,
        )


def storage_shape(fmt: str, n: int, k: int) -> tuple[int, int]:
    """Shape of the packed int32 storage of an int4 layout for a logical [n, k] weight."""
    return {"gptq": (k // 8, n), "awq": (k, n // 8), "cpu_w4a16": (n // 16, 2 * k), "marlin": (k // 16, 2 * n)}[fmt]


# ---- Marlin (vLLM GPTQ-Marlin runtime layout, docs/quantized.md) ------------------------------


def marlin_index(k, n):
    """(row, col, shift) of logical W^T(k, n) in the Marlin int32 [K/16, 2N] tensor (closed form).

    The map of docs/quantized.md (checked against vLLM's marlin_permute_weights by :func:`marlin_pack_vllm`).
    Works on ints or integer numpy arrays.
    """
    kt, kk = np.divmod(k, 16)
    nt, nn = np.divmod(n, 64)
    warp = nn // 16
    half = (nn % 16) // 8
    th = 4 * (nn % 8) + (kk % 8) // 2
    v = (kk % 2) + 2 * (kk // 8) + 4 * half
    slot = np.where(v % 2 == 0, v // 2, 4 + v // 2)
    return kt, nt * 128 + 4 * th + warp, 4 * slot


def marlin_weight_perm() -> np.ndarray:
    """vLLM's ``get_weight_perm(4)``: the permutation of each 1024-code chunk (16 k × 64 n)."""
    perm = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    perm = np.array(perm)
    return perm.reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()


def marlin_pack_vllm(codes_kn: np.ndarray) -> np.ndarray:
    """vLLM's ``marlin_weights`` repack of W^T codes [K, N] (0..15) into int32 [K/16, 2N], step by step.

    The independent reference the closed form :func:`marlin_index` is tested against.
    """
    k, n = codes_kn.shape
    q = codes_kn.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    perm = marlin_weight_perm()
    q = q.reshape(-1, perm.size)[:, perm].reshape(q.shape).astype(np.uint32)
    packed = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        packed |= q[:, i::8] << np.uint32(4 * i)
    return packed.view(np.int32)


def marlin_scale_perms() -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``get_scale_perms``: (grouped perm of 64, channelwise perm of 32)."""
    grouped = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return np.array(grouped), np.array(single)


def marlin_bias_order(bias: torch.Tensor) -> torch.Tensor:
    """The view ``[N/32, 4, 4, 2]`` of a bias ``[N]`` that takes it between logical order and the order vLLM's
    ``marlin_permute_bias`` stores (its channelwise perm: within each 32 outputs, 4×4 blocks of pairs transposed),
    either way."""
    return bias.view(-1, 4, 4, 2).transpose(1, 2)


def marlin_grouped(group_size: int, k: int) -> bool:
    """vLLM uses the grouped scale permutation iff group_size != -1 and group_size < K."""
    return group_size not in (-1, None) and group_size < k


def marlin_scale_col(n, grouped: bool):
    """Column of logical output channel n in Marlin's permuted scales (closed form of vLLM's perms)."""
    if grouped:
        nn = n % 64
        return 64 * (n // 64) + 8 * (nn % 8) + nn // 8
    nn = n % 32
    return 32 * (n // 32) + 8 * ((nn // 2) % 4) + 2 * (nn // 8) + nn % 2


def marlin_permute_scales(s: np.ndarray, grouped: bool) -> np.ndarray:
    """vLLM's ``marlin_permute_scales`` on logical scales [G, N]."""
    g_perm, single = marlin_scale_perms()
    perm = g_perm if grouped else single
    return s.reshape(-1, perm.size)[:, perm].reshape(s.shape)


# ---- pack / unpack of logical codes (numpy, slow and obvious) ---------------------------------


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [...] -> their 8 nibbles [..., 8] (nibble i = bits 4i..4i+3)."""
    w = words.view(np.uint32)[..., None]
    return ((w >> (4 * np.arange(8, dtype=np.uint32))) & np.uint32(0xF)).astype(np.int32)


def _pack_nibbles(nib: np.ndarray) -> np.ndarray:
    """[..., 8] nibbles -> int32 words."""
    w = np.zeros(nib.shape[:-1], dtype=np.uint32)
    for i in range(8):
        w |= nib[..., i].astype(np.uint32) << np.uint32(4 * i)
    return w.view(np.int32)


def unpack_int4(fmt: str, qw: np.ndarray, n: int, k: int) -> np.ndarray:
    """Logical codes [n, k] (int32, 0..15) of an int4 layout's int32 storage."""
    if fmt == "gptq":  # [K/8, N], 8 codes along k
        return _nibbles(qw).transpose(1, 0, 2).reshape(n, k)
    if fmt == "awq":  # [K, N/8], 8 codes along n in AWQ order
        return _nibbles(qw)[:, :, AWQ_REV].reshape(k, n).T.copy()
    if fmt == "cpu_w4a16":  # [N/16, 2K]: word (n//16, 2k + h) holds n = 16(n//16) + 8h + i in nibble i
        nib = _nibbles(qw).reshape(n // 16, k, 2, 8)  # [nb, k, h, i]
        return nib.transpose(0, 2, 3, 1).reshape(n, k)
    if fmt == "marlin":
        kk, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
        row, col, shift = marlin_index(kk, nn)
        codes_kn = (qw.view(np.uint32)[row, col] >> shift.astype(np.uint32)) & np.uint32(0xF)
        return codes_kn.T.astype(np.int32).copy()
    raise ValueError(f"not an int4 layout: {fmt!r}")


def pack_int4(fmt: str, codes: np.ndarray) -> np.ndarray:
    """int32 storage of logical codes [n, k] (0..15) in an int4 layout; inverse of :func:`unpack_int4`."""
    n, k = codes.shape
    if fmt == "gptq":
        return _pack_nibbles(codes.reshape(n, k // 8, 8).transpose(1, 0, 2))
    if fmt == "awq":
        nib = codes.T.reshape(k, n // 8, 8)[:, :, AWQ_ORDER]
        return _pack_nibbles(nib)
    if fmt == "cpu_w4a16":
        nib = codes.reshape(n // 16, 2, 8, k).transpose(0, 3, 1, 2).reshape(n // 16, 2 * k, 8)
        return _pack_nibbles(nib)
    if fmt == "marlin":
        out = np.zeros((k // 16, 2 * n), dtype=np.uint32)
        kk, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
        row, col, shift = marlin_index(kk, nn)
        np.bitwise_or.at(out, (row, col), codes.T.astype(np.uint32) << shift.astype(np.uint32))
        return out.view(np.int32)
    raise ValueError(f"not an int4 layout: {fmt!r}")


# ---- torch-level access: logical codes, logical scales, dequantization -----------------------


def nk_view(qw: QuantWeight) -> torch.Tensor:
    """8-bit formats: the storage as a logical [N, K] tensor view (possibly strided)."""
    return qw.qweight.t() if qw.transposed else qw.qweight


def _nibbles_t(words: torch.Tensor) -> torch.Tensor:
    """int32 words [...] -> their 8 nibbles [..., 8] as int32 (torch, on the words' device)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift: the mask keeps 4 bits


def unpack_int4_t(fmt: str, qw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`unpack_int4` in torch: logical codes [n, k] int32 on ``qw``'s device (any device)."""
    dev = qw.device
    if fmt == "gptq":
        return _nibbles_t(qw).permute(1, 0, 2).reshape(n, k).contiguous()
    if fmt == "awq":
        rev = torch.from_numpy(AWQ_REV).to(dev)
        return _nibbles_t(qw)[:, :, rev].reshape(k, n).t().contiguous()
    if fmt == "cpu_w4a16":
        return _nibbles_t(qw).reshape(n // 16, k, 2, 8).permute(0, 2, 3, 1).reshape(n, k).contiguous()
    if fmt == "marlin":  # the index map depends on the shape only: built on the host, gathered on the device
        kk, nn = np.meshgrid(np.arange(k), np.arange(n), indexing="ij")
        row, col, shift = (torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in marlin_index(kk, nn))
        codes_kn = (qw.to(torch.int32)[row, col] >> shift.to(torch.int32)) & 0xF
        return codes_kn.t().contiguous()
    raise ValueError(f"not an int4 layout: {fmt!r}")


def unpack_codes(qw: QuantWeight) -> torch.Tensor:
    """Logical codes [N, K]: int32 for int8 / int4, uint8 e4m3 bit patterns for fp8 (a copy, on the
    weight's device)."""
    if qw.fmt == "int8":
        return nk_view(qw).detach().to(torch.int32).contiguous()
    if qw.fmt == "fp8":
        return nk_view(qw).detach().contiguous().view(torch.uint8).clone()
    return unpack_int4_t(qw.fmt, qw.qweight.detach(), qw.out_features, qw.in_features)


def pack_codes_(qw: QuantWeight, codes: torch.Tensor) -> None:
    """Write logical codes [N, K] (as :func:`unpack_codes` returns them) into ``qw.qweight`` in place."""
    if qw.fmt == "int8":
        nk_view(qw).copy_(codes.to(torch.int8))
    elif qw.fmt == "fp8":
        nk_view(qw).view(torch.uint8).copy_(codes.to(torch.uint8))
    else:
        packed = pack_int4(qw.fmt, codes.detach().cpu().numpy().astype(np.int32))
        qw.qweight.copy_(torch.from_numpy(packed))


def logical_scales(qw: QuantWeight) -> torch.Tensor:
    """Per-element scales [N, K] float32 (exact widening of the stored scales), on the weight's device."""
    n, k = qw.shape
    s = qw.scales.detach().float()
    if qw.elem != "int4":
        return (s.reshape(1, 1) if s.numel() == 1 else s.reshape(n, 1)).expand(n, k).contiguous()
    s = s.reshape(-1, n)
    if qw.fmt == "marlin":
        cols = marlin_scale_col(np.arange(n), marlin_grouped(qw.group_size, k))
        s = s[:, torch.from_numpy(np.asarray(cols)).to(s.device)]
    return s.t().repeat_interleave(qw.group, dim=1).contiguous()


def logical_zeros(qw: QuantWeight) -> torch.Tensor:
    """Per-element zero points [N, K] float32 (int8 / fp8: 0; int4 default: 8), on the weight's device."""
    n, k = qw.shape
    dev = qw.qweight.device
    if qw.elem != "int4":
        return torch.zeros(n, k, device=dev)
    if qw.zeros is None:
        return torch.full((n, k), 8.0, device=dev)
    return qw.zeros.detach().to(dev).float().reshape(-1, n).t().repeat_interleave(qw.group, dim=1).contiguous()


def e4m3_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bit patterns -> float32 (exact)."""
    return bits.view(torch.float8_e4m3fn).float()


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The logical float32 weight [N, K] (slow reference, on the weight's device)."""
    codes = unpack_codes(qw)
    x = e4m3_bits_to_float(codes) if qw.fmt == "fp8" else codes.float()
    return (x - logical_zeros(qw)) * logical_scales(qw)


# ---- quantizers (to build models and fixtures) ------------------------------------------------


def quantize_weight(
    w: torch.Tensor,
    fmt: str,
    group_size: int = 128,
    scale_dtype: torch.dtype | None = None,
    per_tensor: bool = False,
    symmetric: bool | None = None,
) -> QuantWeight:
    """Quantize a float weight [N, K] (round to nearest) into ``fmt``.

    int8: per-channel absmax/127 scales (float32).  fp8: absmax/448 scales per channel, or per
    tensor with ``per_tensor``.  int4: group scales (float16 by default) along K with group_size
    (-1: channelwise); symmetric (z = 8, s = absmax/7.5) for gptq / cpu_w4a16 / marlin, asymmetric
    (min/max, zero points) for awq unless ``symmetric`` says otherwise.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {FORMATS}")
    w = w.detach().float().cpu()
    n, k = w.shape
    if fmt in ("int8", "fp8"):
        qmax = 127.0 if fmt == "int8" else FP8_MAX
        amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
        s = (amax / qmax).clamp_min(1e-12).to(scale_dtype or torch.float32)
        x = w / s.float()
        if fmt == "int8":
            q = x.round().clamp(-128, 127).to(torch.int8)
        else:
            q = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantWeight(fmt, q.contiguous(), s.reshape(-1) if per_tensor else s, n, k)
    g = k if group_size in (-1, None) else group_size
    if k % g:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    if fmt == "marlin" and (n % 64 or k % 16):
        raise ValueError(f"marlin needs out_features % 64 == 0 and in_features % 16 == 0, got [{n}, {k}]")
    wg = w.reshape(n, k // g, g)
    sym = fmt != "awq" if symmetric is None else symmetric
    if sym:
        s = (wg.abs().amax(-1) / 7.5).clamp_min(1e-8)
        z = torch.full_like(s, 8.0)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = (-lo / s).round().clamp(0, 15)
    s = s.to(scale_dtype or torch.float16)
    codes = (wg / s.float()[..., None] + z[..., None]).round().clamp(0, 15).reshape(n, k).to(torch.int32)
    scales = s.float().t().contiguous()  # [K/g, N]
    zeros = None if sym else z.t().contiguous().to(torch.uint8)
    if fmt == "marlin":
        scales = torch.from_numpy(marlin_permute_scales(scales.numpy(), marlin_grouped(group_size, k)))
    qw = QuantWeight(
        fmt,
        torch.zeros(storage_shape(fmt, n, k), dtype=torch.int32),
        scales.to(s.dtype).contiguous(),
        n,
        k,
        group_size if group_size is not None else -1,
        zeros,
    )
    pack_codes_(qw, codes)
    return qw
