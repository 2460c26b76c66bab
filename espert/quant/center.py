"""QuantCenterStore: the exact center of quantized weights, in host memory (CenterStore's API).

- exact codes: a host copy of each weight's storage tensor (same dtype and layout: 1 byte per
  int8 / fp8 weight, 0.5 byte per int4 weight).  ``restore()`` copies it back: bit-exact after any
  number of cycles, and the device holds nothing beyond the quantized weights (0 extra bits/weight).
- a float32 master per weight (4 bytes/weight, ``master=True``): the code-domain value
  (int: code + residual; fp8: value / s).  ``update()`` adds Σ cₙεₙ/s to it with the fused kernel
  on the host and re-derives the codes (round to nearest even), then restores the live weights,
  so steps smaller than a quantization step accumulate instead of vanishing.  ``master=False``
  rounds code + step directly (naive; smaller host footprint, poor update fidelity).

Scales and zero points are never changed; a host copy of the scales (1/g of the codes) lets the
update run on the host whatever device the weights are on.

Anchored weight decay (``anchor=True``): a second host copy of the codes as they were at construction
(the base: 1 byte per int8 / fp8 weight, 0.5 per int4 one); an ``update(..., anchor=step)`` then moves
each code-domain master toward the base's code-domain values (widened one tensor at a time, a bounded
float32 temporary) and re-derives the codes.  In code units: the l1 threshold α·λ is in codes, like σ
and α of a quantized run; l2's factor is unit-free (scales are fixed, so it is the same in values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from espert import ops
from espert.center import check_anchor, check_state
from espert.noise import NoiseFamily
from espert.ops import Block
from espert.ops.anchor import anchor_decay_
from espert.params import LogicalParam
from espert.update import Update, check_factor

from .formats import QuantWeight, dequantize, e4m3_bits_to_float, unpack_codes
from .ops import qgeometry, requantize_


@dataclass(frozen=True)
class QuantParamView(LogicalParam):
    """One quantized logical weight (or a block of it): its logical (checkpoint) name, which fixes the
    noise key, and the live :class:`QuantWeight` (edited in place)."""

    qw: QuantWeight
    block: Block | None = None

    @property
    def numel(self) -> int:
        return self.qw.out_features * self.qw.in_features


def _host_clone(t: torch.Tensor, pin: bool) -> torch.Tensor:
    c = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
    c.copy_(t)
    return c


def initial_master(qw: QuantWeight) -> torch.Tensor:
    """float32 [N, K] code-domain values of the current codes (int: the code; fp8: its e4m3 value)."""
    codes = unpack_codes(qw)
    return (e4m3_bits_to_float(codes) if qw.fmt == "fp8" else codes.float()).contiguous()


#: how the code-domain master is kept on the host (bytes per weight): the working value is always float32
MASTERS = {"float32": 4, "float16": 2, "residual8": 1}
#: residual8 keeps M − code as round(256·(M − code)) clamped to [−127, 127] (an int8; |M − code| ≤ 127/256 < ½, so
#: the code is RNE(code + r/256) exactly, and the widened master code + r/256 is exact in float32)
RESIDUAL_STEPS = 256.0


def fixed_master(codes: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A residual8 master as its checkpoint holds it: int16 ``code·256 + r`` (exact: int8 codes and int4 ones fit),
    2 B per weight instead of float32's 4."""
    return codes.to(torch.int16) * int(RESIDUAL_STEPS) + residual.to(torch.int16)


def master_codes(center: torch.Tensor) -> torch.Tensor:
    """The codes a code-domain master rounds to: RNE of a float master, or the code of an int16 fixed one
    (:func:`fixed_master`; |r| < 128, so the rounding is exact).  Floats stay floats (the caller casts)."""
    if center.dtype == torch.int16:
        return torch.round(center.float() / RESIDUAL_STEPS)
    return center.round() if center.is_floating_point() else center


def _master_kind(master) -> str | None:
    """``master`` as a :data:`MASTERS` name (True: float32; False / None / ``"none"``: no master)."""
    if master is True:
        return "float32"
    if master in (False, None, "none"):
        return None
    if master not in MASTERS:
        raise ValueError(f"master must be one of {', '.join(MASTERS)} or none, got {master!r}")
    return master


class QuantCenterStore:
    """Exact centers of quantized weights in host memory; same methods as :class:`espert.center.CenterStore`.

    views: QuantParamViews (weights on any device).  master: how the code-domain master is kept (:data:`MASTERS`):
    ``"float32"`` (True, the default; 4 B/weight), ``"float16"`` (2 B) or ``"residual8"`` (1 B: the residual
    M − code in 1/256 code steps, int8, for int8 and int4 codes; fp8 ones keep float16), or none (False: naive rounding).  A compact master
    is widened to float32 one tensor at a time for an update, a decay or a checkpoint (docs/quantized.md).
    pin: page-lock the host code copies (faster GPU restores).  noise: the noise family
    (``"gaussian"``, ``"gaussian-icdf"``, ``"rademacher"``, ``"lowrank:R"``; docs/noise.md §5).  anchor:
    keep the base codes for anchored weight decay (module doc; needs the master).  export: ``"values"`` (a float
    export: each weight dequantized) or ``"codes"`` (a quantized checkpoint's export: the int codes, written back
    in its format by :func:`espert.runs.export_model`).  Validates every view up front.
    """

    def __init__(
        self,
        views: Sequence[QuantParamView],
        master: bool = True,
        pin: bool = False,
        noise: str = "gaussian",
        anchor: bool = False,
        export: str = "values",
    ):
        if export not in ("values", "codes"):
            raise ValueError(f"export must be 'values' or 'codes', got {export!r}")
        self.export = export
        self.master_kind = _master_kind(master)
        if anchor and self.master_kind is None:
            raise ValueError("anchor (anchored weight decay) needs the code-domain master (master=True)")
        self.noise = str(NoiseFamily.parse(noise))
        names = [v.name for v in views]
        if len(set(names)) != len(names):
            raise ValueError(
                f"duplicate logical parameter names: {sorted({n for n in names if names.count(n) > 1})[:5]}"
            )
        for v in views:
            qgeometry(v.qw, v.block)
        self.views = list(views)
        self.codes: list[torch.Tensor] = []  # exact storage, host, same layout as the live qweight
        self.host: list[QuantWeight] = []  # host twins (codes + scales) the update runs on
        self.masters: list[torch.Tensor] | None = [] if self.master_kind else None  # as kept (MASTERS)
        for v in self.views:
            c = _host_clone(v.qw.qweight, pin)  # contiguous on the host, whatever the live strides
            self.codes.append(c)
            h = QuantWeight(
                v.qw.fmt,
                c,
                v.qw.scales if v.qw.scales.device.type == "cpu" else None,  # never written: shared, or fetched
                v.qw.out_features,
                v.qw.in_features,
                v.qw.group_size,
                None,
                v.qw.transposed,
                v.qw.qmin,
                v.qw.qmax,
            )
            self.host.append(h)
            if self.masters is not None:
                self.masters.append(self._kept(initial_master(h), h))
        # the base codes (scales and zero points never change): what anchored weight decay pulls toward
        self.anchors = [replace(h, qweight=h.qweight.clone()) for h in self.host] if anchor else None

    def _scaled(self, i: int) -> QuantWeight:
        """View ``i``'s host twin with host scales: the live ones when they are on the host (shared, never
        written), else a transient host copy (scale-sized), so the center keeps no scales of its own."""
        h = self.host[i]
        return h if h.scales is not None else replace(h, scales=self.views[i].qw.scales.to("cpu"))

    # -- the master as kept, and its float32 working value --------------------------------------
    def _kept(self, m: torch.Tensor, host: QuantWeight) -> torch.Tensor:
        """The float32 master ``m`` [N, K] as this store keeps it (``host``: the weight whose codes it rounds to)."""
        if self.master_kind == "residual8" and host.fmt != "fp8":
            r = torch.round((m - unpack_codes(host).float()) * RESIDUAL_STEPS)
            return r.clamp_(-127, 127).to(torch.int8)
        return m if self.master_kind == "float32" else m.to(torch.float16)  # fp8 under residual8: float16

    def master(self, i: int) -> torch.Tensor:
        """View ``i``'s float32 code-domain master [N, K]: the kept tensor itself (float32), else widened (a copy)."""
        m = self.masters[i]
        if m.dtype == torch.int8:  # residual8
            return unpack_codes(self.host[i]).float() + m.float() / RESIDUAL_STEPS
        return m if m.dtype == torch.float32 else m.float()

    def _keep(self, i: int, m: torch.Tensor) -> None:
        """Store view ``i``'s float32 master ``m`` back (a no-op when ``m`` is the kept float32 tensor).  A float16
        master re-derives the codes from its rounded value, so codes and master agree as a checkpoint restores them
        (a residual is taken against the codes, which it leaves as they are)."""
        if m is not self.masters[i]:
            self.masters[i] = self._kept(m, self.host[i])
            if self.masters[i].dtype == torch.float16:
                requantize_(self._scaled(i), self.master(i), backend="cpu")

    # -- CenterStore API -------------------------------------------------------------------
    @property
    def centers(self) -> list[torch.Tensor]:
        """The float32 masters (widened copies for a compact master: 4 B/weight while the list lives)."""
        if self.masters is None:
            raise ValueError("this QuantCenterStore keeps no code-domain master (master=False)")
        return [self.master(i) for i in range(len(self.masters))]

    @property
    def nbytes(self) -> int:
        """Host memory the center adds: exact codes + masters as kept + anchor codes, in bytes (the scales are the
        live weights' own on a host, or fetched per update)."""
        total = sum(c.numel() * c.element_size() for c in self.codes)
        total += sum(a.qweight.numel() * a.qweight.element_size() for a in self.anchors or [])
        if self.masters is not None:
            total += sum(m.numel() * m.element_size() for m in self.masters)
        return total

    def noise_energy(self) -> float:
        """Σ_t n_t over the views: the noise is in code units, σ scale 1 for every view."""
        return float(sum(v.numel for v in self.views))

    def _zero_points(self) -> list[torch.Tensor | None]:
        """Per master, the code-domain zero point it decays towards (None: 0), computed before any mutation."""
        out = []
        for v in self.views:
            if v.qw.fmt in ("int8", "fp8"):
                out.append(None)
            elif v.qw.zeros is None:
                out.append(torch.tensor(8.0))
            else:  # [K/g, N] -> [N, K] (shape checked by qgeometry in the constructor)
                g = v.qw.group_size if v.qw.group_size > 0 else v.qw.in_features
                out.append(v.qw.zeros.to("cpu", torch.float32).t().repeat_interleave(g, dim=1)[:, : v.qw.in_features])
        return out

    def scale(self, factor: float) -> None:
        """Weight decay on the masters: the dequantized value is multiplied by ``factor``.

        Codes with a zero point z (int4: ``zeros`` or 8) decay towards z, not towards code 0:
        master <- z + factor·(master − z).  The live codes move at the next :meth:`update`.
        Everything is computed and checked before the first master changes.
        """
        factor = check_factor("scale factor", factor)
        if self.masters is None:
            raise ValueError("this QuantCenterStore keeps no code-domain master (master=False)")
        zs = self._zero_points()
        for i, z in enumerate(zs):
            m = self.master(i)
            if z is None:
                m.mul_(factor)
            else:
                m.sub_(z).mul_(factor).add_(z)
            self._keep(i, m)

    def restore(self) -> None:
        """Copy the exact codes back into every live weight."""
        for v, c in zip(self.views, self.codes):
            ops.restore_(v.qw, c)

    def perturb(self, seed: int, sigma: float, sign: int = 1, backend: str | None = None) -> None:
        """Live codes <- center perturbed by sign·σ·ε(seed) with stochastic rounding (from the restored state)."""
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma <= 0:
            raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
        if sign not in (1, -1):
            raise ValueError(f"sign must be +1 or -1, got {sign!r}")
        for v in self.views:
            ops.perturb_(v.qw, seed, v.key, sigma, sign, block=v.block, backend=backend, noise=self.noise)

    def update(self, step: Update) -> None:
        """center <- decay·center (:meth:`scale`), then center + Σ coeffs[n]·ε(seeds[n]) (fused, on the host),
        then the anchor step toward the base codes (module doc), then restore the live weights.  ``step.lr``
        is not used (the quantized center is plain sgd)."""
        check_anchor(step, self.anchors)
        seeds, coeffs, anchor = step.seeds, step.coeffs, step.anchor
        if step.decay != 1.0:
            self.scale(step.decay)
        for i, v in enumerate(self.views):
            m = None if self.masters is None else self.master(i)
            h = self._scaled(i)
            ops.es_update_(h, seeds, coeffs, v.key, master=m, block=v.block, backend="cpu", noise=self.noise)
            if anchor is not None:
                anchor_decay_(m, initial_master(self.anchors[i]), anchor)
                requantize_(h, m, backend="cpu")
            if m is not None:
                self._keep(i, m)
        self.restore()

    def export_state(self) -> dict[str, torch.Tensor]:
        """The center as checkpoint values by logical name, [out_features, in_features]: each weight dequantized
        from its exact center codes (float32, what a float export holds), or with ``export="codes"`` the codes
        themselves (int32; int4: 0..15, the stored nibble)."""
        if self.export == "codes":
            return {v.name: unpack_codes(h) for v, h in zip(self.views, self.host)}
        return {
            v.name: dequantize(replace(self._scaled(i), zeros=None if v.qw.zeros is None else v.qw.zeros.cpu()))
            for i, v in enumerate(self.views)
        }

    def export_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of :meth:`export_state`, without dequantizing anything."""
        dtype = torch.int32 if self.export == "codes" else torch.float32
        return {v.name: ((v.qw.out_features, v.qw.in_features), dtype) for v in self.views}

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """Logical name -> float32 master (or the exact codes when there is no master).  A residual8 master of int
        codes is the int16 ``code·256 + r`` (:func:`fixed_master`, 2 B per weight); a float16 one is widened.  Both
        are made when the entry is read, one tensor at a time (a checkpoint streams them)."""
        if self.masters is None:
            return {v.name: t for v, t in zip(self.views, self.codes)}
        if self.master_kind == "float32":
            return {v.name: t for v, t in zip(self.views, self.masters)}
        return _Widened(self)

    def _state_entry(self, i: int) -> torch.Tensor:
        m = self.masters[i]
        return fixed_master(unpack_codes(self.host[i]), m) if m.dtype == torch.int8 else self.master(i)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the centers exactly (codes re-derived from the masters) and restore the live weights.
        Names, shapes, dtypes and devices are checked, and masters must be finite, before anything is copied."""
        if self.masters is None:
            check_state(state, self.state_dict())
        else:  # [N, K] masters: float32, or int16 fixed (a residual8 master) for int codes, whatever this keeps
            fixed = lambda v: isinstance(state, Mapping) and v.name in state and state[v.name].dtype == torch.int16  # noqa: E731
            kinds = [torch.int16 if v.qw.fmt != "fp8" and fixed(v) else torch.float32 for v in self.views]
            check_state(
                state, {v.name: torch.empty(v.qw.shape, dtype=d, device="meta") for v, d in zip(self.views, kinds)}
            )
        if self.masters is not None:
            for v in self.views:
                if not bool(torch.isfinite(state[v.name]).all()):
                    raise ValueError(f"center {v.name}: checkpoint master holds NaN or Inf")
        for i, v in enumerate(self.views):
            if self.masters is None:
                self.codes[i].copy_(state[v.name])
                continue
            m = state[v.name]
            # an int16 residual8 master code·256 + r widens to code + r/256 exactly (|q| < 2^15; a power-of-two divide)
            m = m.float() / RESIDUAL_STEPS if m.dtype == torch.int16 else m.to(torch.float32, copy=True)
            requantize_(self._scaled(i), m, backend="cpu")
            self.masters[i] = self._kept(m, self.host[i])
        self.restore()


class _Widened(Mapping):
    """A compact QuantCenterStore's state dict: each master made when read (int16 fixed, or widened to float32)."""

    def __init__(self, store: QuantCenterStore):
        self.store, self.index = store, {v.name: i for i, v in enumerate(store.views)}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.store._state_entry(self.index[name])

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def model_center_stores(float_views, qviews: Sequence[QuantParamView], *, master, selection: str, **store) -> tuple:
    """``(CenterStore or None, QuantCenterStore or None)``: the two stores of a quantized model's center.

    float_views: a callable giving the float ParamViews (its "no parameters selected" ValueError means none);
    qviews: the quantized ones; master: the quantized master (:data:`MASTERS` or False; the float tensors keep a
    float32 master unless it is False); selection: the include / exclude said when nothing is selected; store:
    ``pin``, ``noise``, ``anchor`` for both stores, ``export`` for the quantized one."""
    from espert.center import CenterStore

    try:
        fviews = float_views()
    except ValueError as e:
        if "no parameters selected" not in str(e):
            raise
        fviews = []
    if not fviews and not qviews:
        raise ValueError(f"no parameters selected ({selection})")
    export = store.pop("export", "values")
    fstore = CenterStore(fviews, master_dtype=torch.float32 if master else None, **store) if fviews else None
    return fstore, QuantCenterStore(qviews, master=master, export=export, **store) if qviews else None


class QuantModelCenter:
    """The center of a quantized model: its float tensors (embeddings, norms, lm_head: a
    :class:`~espert.center.CenterStore`, or None) and its quantized codes (a :class:`QuantCenterStore`, or None),
    with CenterStore's API.  Every call goes to both, in that order; :meth:`_after_edit` runs after each change
    of the live weights (a subclass rebuilds what an engine packed from them).  Plain sgd with absolute σ:
    no optimizer state, no σ scales.

    ``views``: the float views, then the quantized ones."""

    #: σ is absolute (the quantized noise is in code units)
    sigma_scales = None

    def __init__(self, float_store, quant_store):
        self.float, self.quant = float_store, quant_store
        self.views = [v for s in self._stores() for v in s.views]

    def _stores(self) -> list:
        return [s for s in (self.float, self.quant) if s is not None]

    def _after_edit(self) -> None:
        """Called after every perturb, restore, update and load (nothing to rebuild here)."""

    @property
    def centers(self) -> list[torch.Tensor]:
        return [c for s in self._stores() for c in s.centers]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._stores())

    def noise_energy(self) -> float:
        return float(sum(s.noise_energy() for s in self._stores()))

    def state_views(self) -> list:
        """Each view's center state entry as a ParamView (no optimizer state: sgd only); all made at once (the
        vLLM workers stream them), 2 B per residual8 weight while they live."""
        from espert.params import ParamView

        state = {k: t for s in self._stores() for k, t in s.state_dict().items()}
        return [ParamView(v.name, state[v.name], v.block) for v in self.views]

    def perturb(self, seed: int, sigma: float, sign: int = 1, backend: str | None = None) -> None:
        for s in self._stores():
            s.perturb(seed, sigma, sign, backend=backend)
        self._after_edit()

    def restore(self) -> None:
        for s in self._stores():
            s.restore()
        self._after_edit()

    def update(self, step: Update) -> None:
        for s in self._stores():  # before either store moves
            check_anchor(step, s.anchors)
        for s in self._stores():
            s.update(step)
        self._after_edit()

    def scale(self, factor: float) -> None:
        for s in self._stores():
            s.scale(factor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: t for s in self._stores() for k, t in s.state_dict().items()}

    def export_state(self) -> dict[str, torch.Tensor]:
        return {k: t for s in self._stores() for k, t in s.export_state().items()}

    def export_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of :meth:`export_state`, without dequantizing anything."""
        out = {}
        for s in self._stores():
            layout = getattr(s, "export_layout", None)
            out.update(layout() if layout else {k: (tuple(t.shape), t.dtype) for k, t in s.export_state().items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for s in self._stores():  # each validates its own names, shapes and dtypes
            s.load_state_dict(state)
        self._after_edit()
