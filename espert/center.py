"""The center: where the exact ES center θ lives, and the one protocol every center implements.

Why a host-side center.  Restoring a bf16/fp16 weight by subtracting regenerated noise cannot
be exact (several centers round to the same perturbed value: about 4.6% of bf16 elements at
σ=1e-3 on N(0, 0.02) weights), and small updates vanish when added to bf16 weights.  Both
problems need information beyond the live weights.  We keep it in host memory, never on the
device:

- ``restore()`` writes the center back into the live weights, exactly, after any number of
  cycles; the device holds nothing beyond the weights;
- ``update()`` applies the fused ES update (through an optional optimizer) to a float32 master
  and then restores.  With ``master_dtype=None`` the center is kept in the weights' own dtype
  (2 bytes per bf16 parameter): still exact restores, but naive bf16 update fidelity.

Host memory per parameter (bf16 weights):

    =====================================  ============================
    master_dtype=None                      2 B (the center itself)
    float32 master, sgd                    4 B
    float32 master + momentum              8 B
    float32 master + adam                  12 B
    + pinned mirror (CUDA weights)         + 2 B (restore at PCIe line rate)
    + anchor (anchored weight decay)       + 2 B (the base in the weights' dtype)
    =====================================  ============================

The center is also what checkpoints save (``state_dict``) and replays rebuild.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from espert import ops
from espert.noise import NoiseFamily
from espert.ops import plan
from espert.ops.anchor import anchor_decay_
from espert.ops.checks import geometry
from espert.params import ParamView, matches
from espert.update import Update, check_factor

OPTIMIZERS = ("sgd", "momentum", "adam")
#: State-dict names of optimizer state: ``optim.<slot>/<logical name>`` and the step counter.
OPTIM_PREFIX = "optim."
OPTIM_STEP = "optim.step"
# Optimizer scratch (the update direction of a chunk) is bounded like restore staging.


@runtime_checkable
class Center(Protocol):
    """What evaluators, the ES loop, checkpoints and replay need from a center (float or quantized).

    Every method validates all of its arguments before it mutates anything: an error leaves the
    centers, any optimizer state and the live weights exactly as they were.
    """

    views: list

    @property
    def nbytes(self) -> int:
        """Host memory held (centers, masters, optimizer state, mirrors), in bytes."""

    def noise_energy(self) -> float:
        """Σ_t n_t·s_t² over the moved tensors (n_t elements, σ scale s_t; quantized: in code units), what
        :func:`espert.es.step_norm` needs."""

    def restore(self) -> None:
        """Write the exact center back into every live weight."""

    def perturb(self, seed: int, sigma: float, sign: int = 1, backend: str | None = None) -> None:
        """Live weights <- center + sign·σ·ε(seed), in place; call it on restored weights only."""

    def update(self, step: Update) -> None:
        """center <- step.decay·center, then Σ_n step.coeffs[n]·ε(step.seeds[n]) (through the optimizer, whose
        step size is step.lr), then step.anchor toward the base weights (:mod:`espert.ops.anchor`; needs a
        center built with an anchor); then restore the live weights.  :class:`~espert.update.Update` was
        validated when it was made: a Center applies it and checks only what is its own (an anchor step
        without anchors, adam without lr)."""

    def scale(self, factor: float) -> None:
        """center <- factor·center (weight decay), live weights untouched until the next restore."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything needed to continue exactly (center and optimizer state), host tensors by name."""

    def export_state(self) -> dict[str, torch.Tensor]:
        """The center as float checkpoint values by logical name (what a model export holds)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the center (and optimizer state) exactly, then restore the live weights."""


# ---- shared validation ----------------------------------------------------------------------------


def check_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Raise unless ``state`` holds, for every expected name, a tensor of the same shape and dtype with
    real data (not on the meta device).  Nothing is copied: call it before mutating anything."""
    if not isinstance(state, dict):
        raise TypeError(f"a center state must be a dict of tensors, got {type(state).__name__}")
    for name, like in expected.items():
        if name not in state:
            raise KeyError(f"checkpoint has no center for {name}")
        s = state[name]
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"center {name}: checkpoint holds {type(s).__name__}, not a tensor")
        if s.shape != like.shape or s.dtype != like.dtype:
            raise ValueError(
                f"center {name}: checkpoint has {s.dtype}{tuple(s.shape)}, expected {like.dtype}{tuple(like.shape)}"
            )
        if s.device.type == "meta":
            raise ValueError(f"center {name}: checkpoint tensor is on the meta device (it holds no data)")


def check_anchor(step: Update, anchors) -> None:
    """An update's anchor step needs a center that keeps the base weights (built with ``anchor=True``)."""
    if step.anchor is not None and anchors is None:
        raise ValueError("an anchor step needs a center built with anchor=True (it keeps the base weights)")


@dataclass(frozen=True)
class Optimizer:
    """How the step Σ c_n ε_n (already scaled by α in the coefficients) moves the float32 master.

    sgd:      θ += d
    momentum: m = β1·m + d;  θ += m                                (heavy ball, 4 B/param of state)
    adam:     g = d/lr;  m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²;
              θ += lr · (m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps)   (8 B/param of state)

    Every step is float32 elementwise arithmetic on the host in a fixed order, so it replays
    bit for bit.
    """

    name: str = "sgd"
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; use one of {OPTIMIZERS}")
        for k in ("beta1", "beta2"):
            b = getattr(self, k)
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
                raise ValueError(f"optimizer {k} must be in [0, 1), got {b!r}")
        check_factor("optimizer eps", self.eps)

    @property
    def slots(self) -> tuple[str, ...]:
        return {"sgd": (), "momentum": ("m",), "adam": ("m", "v")}[self.name]

    @classmethod
    def of(cls, spec: "Optimizer | str | dict | None") -> "Optimizer":
        """An Optimizer from a name, a dict of fields, or an Optimizer (None: sgd)."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, dict):
            return cls(**spec)
        raise TypeError(f"optimizer must be a name, a dict or an Optimizer, got {type(spec).__name__}")


def _chunk_elems() -> int:
    """float32 elements of one bounded temporary (``espert.ops.plan.STAGING_BYTES``, read when used)."""
    return plan.STAGING_BYTES // 4


def _chunks(t: torch.Tensor, block: ops.Block | None, limit: int):
    """Yield (flat slice of ``t`` as [k, cols], Block of that slice in the logical parameter), each of at
    most ``limit`` elements when rows allow (a single row longer than ``limit`` is split by columns)."""
    g = geometry(t, None)  # the [rows, cols] the ops see (contiguous host tensor; 1-D: one row)
    rows, cols = g.rows, g.cols
    flat = t.view(rows, cols)
    b = block or ops.Block()
    lr = rows if b.logical_rows is None else b.logical_rows
    lc = cols if b.logical_cols is None else b.logical_cols
    if cols > limit:
        for i in range(rows):
            for j in range(0, cols, limit):
                yield flat[i : i + 1, j : j + limit], ops.Block(b.row_offset + i, b.col_offset + j, lr, lc)
        return
    step = max(1, limit // max(1, cols))
    for i in range(0, rows, step):
        yield flat[i : i + step], ops.Block(b.row_offset + i, b.col_offset, lr, lc)


class CenterStore:
    """Exact centers of a list of ParamViews, in host memory (implements :class:`Center`).

    views: the live weights (any device; every view is validated here, once).
    master_dtype: torch.float32 (default, faithful updates) or None (the weights' dtype).
    noise: the noise family (``"gaussian"``, ``"gaussian-icdf"``, ``"rademacher"``, ``"lowrank:R"``), see docs/noise.md.
    optimizer: ``"sgd"`` | ``"momentum"`` | ``"adam"`` (or a dict / :class:`Optimizer`); needs the master.
    sigma_scales: per-view multipliers of σ and of the step (per-tensor σ; default all 1.0).
    no_decay: name patterns (see :func:`espert.params.matches`) of views that :meth:`scale` leaves alone.
    mirror: keep a pinned host copy of the center in the weights' dtype and restore from it with
        asynchronous copies (default: when some weight is on a GPU).  Rebuilt exactly after updates.
    update_on: where the fused sgd update of the float32 master runs: None (default) on the host, in
        place; a device (``"cuda"``) streams the master through one ≤ 64 MiB staging buffer there,
        chunk by chunk (upload, update, download).  Both give the same bits (the kernels agree).
    pin: page-lock the host tensors (faster GPU transfers).
    restore: ``"copy"`` (default: :meth:`restore` copies the center back) or ``"patch"``: a perturb from
        the restored state records the elements that subtraction would not give back, and the next
        restore subtracts the perturbation and writes them back (:mod:`espert.ops.patch`), the same bits
        as the copy.  It copies instead when the live weights are not one perturb away from the center
        (after an update, a scale, a load, or two perturbs in a row) or the list overflowed.
        ``patch_stats`` counts both kinds.  Assumes nothing else writes the live weights.
    patch_capacity: records the list holds, as a fraction of the views' elements (16 B each: the
        default 1/16 is 1 B per parameter of host memory; a miss rate above it falls back to copies).
    anchor: keep a host copy of the weights as they are now (the base), in their own dtype (2 B per bf16
        parameter, 4 per float32 one; pinned with ``pin``), for anchored weight decay: ``update(...,
        anchor={"norm", "amount"})`` then moves the float32 master back toward it (:mod:`espert.ops.anchor`).
        It is never saved: a resumed or replayed run rebuilds it from the base model.  Needs the master.
    """

    def __init__(
        self,
        views: Sequence[ParamView],
        master_dtype: torch.dtype | None = torch.float32,
        pin: bool = False,
        *,
        noise: str = "gaussian",
        optimizer=None,
        sigma_scales: Sequence[float] | None = None,
        no_decay: Sequence[str] = (),
        mirror: bool | None = None,
        update_on: str | torch.device | None = None,
        restore: str = "copy",
        patch_capacity: float = 1 / 16,
        anchor: bool = False,
    ):
        if master_dtype not in (None, torch.float32):
            raise ValueError(f"master_dtype must be torch.float32 or None, got {master_dtype}")
        self.views = list(views)
        names = [v.name for v in self.views]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate logical parameter names: {dup[:5]}")
        self.noise = str(NoiseFamily.parse(noise))
        # every view (geometry, dtype, device, key) validated once, before anything is built: a call
        # with no member validates and writes nothing
        ops.es_update_many_(self._items([v.tensor for v in self.views]), [], [], noise=self.noise)
        self.optimizer = Optimizer.of(optimizer)
        if self.optimizer.name != "sgd" and master_dtype is None:
            raise ValueError(f"optimizer {self.optimizer.name!r} needs the float32 master (master_dtype=torch.float32)")
        self.sigma_scales = self._checked_scales(sigma_scales)
        self.update_on = None if update_on is None else torch.device(update_on)
        if self.update_on is not None and master_dtype is None:
            raise ValueError("update_on needs the float32 master (master_dtype=torch.float32)")
        self.decays = [not (no_decay and matches(v.name, no_decay)) for v in self.views]
        pin = pin and torch.cuda.is_available()
        self.centers: list[torch.Tensor] = []
        for v in self.views:
            c = torch.empty(v.tensor.shape, dtype=master_dtype or v.tensor.dtype, device="cpu", pin_memory=pin)
            ops.cast_exact_(c, v.tensor.to("cpu"))  # widening is exact, NaN payloads included
            self.centers.append(c)
        self.state: dict[str, list[torch.Tensor]] = {
            s: [torch.zeros_like(c) for c in self.centers] for s in self.optimizer.slots
        }
        self.anchors = self._anchors(pin) if anchor else None
        self.step = 0
        if mirror is None:
            mirror = master_dtype is not None and any(v.tensor.device.type == "cuda" for v in self.views)
        self.mirrors: list[torch.Tensor] | None = None
        if mirror:
            self.mirrors = [
                torch.empty(v.tensor.shape, dtype=v.tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
                for v in self.views
            ]
            self._rebuild_mirrors()
        self.restore_mode = restore
        self.patch = self._patch_list(restore, patch_capacity)
        self.patch_stats = {"patched": 0, "copied": 0, "records": 0}
        self._pending: tuple | None = None  # (seed, sigma, sign, backend) of the recorded perturb
        self._at_center = True  # the live weights are the rounded center (built from them)

    def _anchors(self, pin: bool) -> list[torch.Tensor]:
        """The base for anchored weight decay: a host copy of every live weight in its own dtype, bit for bit
        (widening it gives the initial master exactly)."""
        if self.centers[:1] and self.centers[0].dtype != torch.float32:
            raise ValueError("anchor (anchored weight decay) needs the float32 master (master_dtype=torch.float32)")
        out = [torch.empty(v.tensor.shape, dtype=v.tensor.dtype, device="cpu", pin_memory=pin) for v in self.views]
        for a, v in zip(out, self.views):
            a.copy_(v.tensor)
        return out

    def _checked_scales(self, sigma_scales: Sequence[float] | None) -> list[float] | None:
        if sigma_scales is None:
            return None
        scales = [check_factor(f"sigma_scales[{i}]", s) for i, s in enumerate(sigma_scales)]
        if len(scales) != len(self.views):
            raise ValueError(f"got {len(scales)} sigma_scales for {len(self.views)} views")
        return scales

    def _patch_list(self, restore: str, capacity: float) -> "ops.PatchList | None":
        """restore="patch": the list a recording perturb fills, ``capacity`` × the views' elements."""
        if restore not in ("copy", "patch"):
            raise ValueError(f"restore must be 'copy' or 'patch', got {restore!r}")
        if restore == "copy":
            return None
        capacity = check_factor("patch_capacity", capacity)
        if not 0 < capacity <= 1:
            raise ValueError(f"patch_capacity must be in (0, 1], got {capacity}")
        numel = sum(v.tensor.numel() for v in self.views)
        device = self.views[0].tensor.device if self.views else torch.device("cpu")
        return ops.PatchList(max(1, math.ceil(capacity * numel)), device)

    # -- memory -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Host memory held by centers, optimizer state, mirrors and anchors, in bytes."""
        ts = self.centers + [t for ts in self.state.values() for t in ts] + (self.mirrors or []) + (self.anchors or [])
        return sum(t.numel() * t.element_size() for t in ts) + (self.patch.nbytes if self.patch else 0)

    def noise_energy(self) -> float:
        """Σ_t n_t·s_t² over the views (s_t: the ``sigma_scales``, default 1)."""
        scales = self.sigma_scales or [1.0] * len(self.views)
        return float(sum(v.numel * s * s for v, s in zip(self.views, scales)))

    def _items(self, tensors: Sequence[torch.Tensor]) -> list[tuple]:
        return [(t, v.key, v.block) for t, v in zip(tensors, self.views)]

    # -- Center protocol --------------------------------------------------------------------
    def restore(self) -> None:
        """Write the exact center back into every live weight (from the pinned mirror when there is one;
        ``restore="patch"``: by subtraction and the patch list where it can)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            seed, sigma, sign, backend = pending
            n = self.patch.misses()
            items = self._items([v.tensor for v in self.views])
            kw = dict(noise=self.noise, scales=self.sigma_scales, backend=backend)
            if ops.restore_patched_many_(items, seed, sigma, sign, self.patch, **kw):
                self.patch_stats["patched"] += 1
                self.patch_stats["records"] += n
                self._at_center = True
                return
        if self.restore_mode == "patch":
            self.patch_stats["copied"] += 1
        self._at_center = True
        src = self.mirrors if self.mirrors is not None else self.centers
        # asynchronous from the pinned mirror: stream-ordered for the GPU work that follows (and
        # capturable in a CUDA graph); the mirror is only rewritten after a synchronize (_rebuild_mirrors)
        for v, c in zip(self.views, src):
            ops.restore_(v.tensor, c, non_blocking=self.mirrors is not None)

    def perturb(self, seed: int, sigma: float, sign: int = 1, backend: str | None = None) -> None:
        """Live weights <- center + sign·σ·s_t·ε(seed) for every view t, in place, in one multi-tensor call
        (from the restored state; s_t are the ``sigma_scales``)."""
        record = self.patch if self._at_center and self.patch is not None else None
        if record is not None:
            record.clear()
        ops.perturb_many_(
            self._items([v.tensor for v in self.views]),
            seed,
            sigma,
            sign,
            noise=self.noise,
            scales=self.sigma_scales,
            backend=backend,
            record=record,
        )
        self._at_center = False
        self._pending = None if record is None else (seed, sigma, sign, backend)

    def scale(self, factor: float) -> None:
        """center <- factor · center for the views not matched by ``no_decay`` (float32 elementwise on the
        host, deterministic); weights are not restored.  The optimizer state is not decayed."""
        factor = check_factor("scale factor", factor)
        self._pending, self._at_center = None, False
        for c, d in zip(self.centers, self.decays):
            if d:
                c.mul_(factor)

    def update(self, step: Update) -> None:
        """center <- decay·center; then the step d = Σ_n coeffs[n]·s_t·ε(seeds[n]) through the optimizer
        (sgd: center += d, fused, in one multi-tensor call); then the anchor step toward the base (every
        view, decay exclusions or not); then restore the live weights.  ``step.lr``: the iteration's α,
        required by adam (whose step size it is).  Nothing moves when the step cannot be applied here."""
        check_anchor(step, self.anchors)
        seeds, coeffs, lr, anchor = step.seeds, step.coeffs, step.lr, step.anchor
        opt = self.optimizer
        if opt.name == "adam" and lr is None:
            raise ValueError("the adam optimizer needs lr (the iteration's alpha)")
        self._pending, self._at_center = None, False  # the center moves: the next restore copies
        if step.decay != 1.0:
            self.scale(step.decay)
        if opt.name == "sgd" and self.update_on is not None:
            self._staged_update(seeds, coeffs, anchor)
        else:
            if opt.name == "sgd":
                ops.es_update_many_(
                    self._items(self.centers), seeds, coeffs, noise=self.noise, scales=self.sigma_scales
                )
            else:
                self.step += 1
                self._optimizer_step(seeds, coeffs, lr)
            for c, a in zip(self.centers, self.anchors if anchor else []):
                anchor_decay_(c, a, anchor)
        self._rebuild_mirrors()
        self.restore()

    def _staged_update(self, seeds, coeffs, anchor) -> None:
        """The sgd update on ``update_on``: each ≤ 64 MiB chunk of the master goes up, gets the fused update
        with its Block (and the anchor step, its chunk of the anchor staged beside it), and comes back.  The
        device holds only the staging buffers."""
        staging = torch.empty(_chunk_elems(), dtype=torch.float32, device=self.update_on)
        held = torch.empty(_chunk_elems() if anchor else 0, dtype=torch.float32, device=self.update_on)
        for i, v in enumerate(self.views):
            scale = None if self.sigma_scales is None else [self.sigma_scales[i]]
            pieces = _chunks(self.anchors[i], v.block, _chunk_elems()) if anchor else None
            for c, blk in _chunks(self.centers[i], v.block, _chunk_elems()):
                s = staging[: c.numel()].view(c.shape)
                s.copy_(c, non_blocking=True)
                ops.es_update_many_([(s, v.key, blk)], seeds, coeffs, noise=self.noise, scales=scale)
                if anchor:
                    a = next(pieces)[0]
                    h = held.view(a.dtype)[: a.numel()].view(a.shape)
                    h.copy_(a, non_blocking=True)
                    anchor_decay_(s, h, anchor)
                c.copy_(s)

    def _optimizer_step(self, seeds, coeffs, lr: float | None) -> None:
        """Momentum / Adam over bounded chunks: the step d of a chunk is formed by the fused op into a
        float32 scratch of at most 64 MiB, then the optimizer's elementwise float32 update runs."""
        opt = self.optimizer
        for i, v in enumerate(self.views):
            scale = None if self.sigma_scales is None else [self.sigma_scales[i]]
            center = self.centers[i]
            slots = {s: self.state[s][i] for s in opt.slots}
            for (c, blk), *states in zip(
                _chunks(center, v.block, _chunk_elems()),
                *[_chunks(slots[s], v.block, _chunk_elems()) for s in opt.slots],
            ):
                d = torch.zeros_like(c)
                ops.es_update_many_([(d, v.key, blk)], seeds, coeffs, noise=self.noise, scales=scale)
                if opt.name == "momentum":
                    m = states[0][0]
                    m.mul_(opt.beta1).add_(d)
                    c.add_(m)
                else:
                    m, vv = states[0][0], states[1][0]
                    g = d.div_(lr)
                    m.mul_(opt.beta1).add_(g, alpha=1 - opt.beta1)
                    vv.mul_(opt.beta2).addcmul_(g, g, value=1 - opt.beta2)
                    bc1 = 1 - opt.beta1**self.step
                    bc2 = 1 - opt.beta2**self.step
                    denom = (vv / bc2).sqrt_().add_(opt.eps)
                    c.addcdiv_(m / bc1, denom, value=lr)

    def _rebuild_mirrors(self) -> None:
        if self.mirrors is not None:
            # no copy from the old mirror may still be in flight, on any device that holds a view
            # (torch.cuda.synchronize() alone waits for the current device only)
            for dev in sorted({v.tensor.device.index or 0 for v in self.views if v.tensor.is_cuda}):
                torch.cuda.synchronize(dev)
            for m, c in zip(self.mirrors, self.centers):
                ops.restore_(m, c)  # exact round-to-nearest-even, NaN bits kept

    def state_views(self) -> list[ParamView]:
        """The entries of :meth:`state_dict` as ParamViews over the host tensors: each center, then each
        optimizer slot ``optim.<slot>/<name>`` with the Block of its view (a sharded or fused parameter's
        slots are pieces of the logical slot exactly like its center), then ``optim.step`` (int64 [1],
        whole) when the optimizer keeps state."""
        out = [ParamView(v.name, c, v.block) for v, c in zip(self.views, self.centers)]
        for s, ts in self.state.items():
            out += [ParamView(f"{OPTIM_PREFIX}{s}/{v.name}", t, v.block) for v, t in zip(self.views, ts)]
        if self.state:
            out.append(ParamView(OPTIM_STEP, torch.tensor([self.step], dtype=torch.int64)))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Logical name -> center tensor (host), plus ``optim.<slot>/<name>`` and ``optim.step`` when the
        optimizer keeps state.  Blocks of one logical parameter are saved under their view names."""
        return {p.name: p.tensor for p in self.state_views()}

    def export_state(self) -> dict[str, torch.Tensor]:
        """The center by logical name (the same tensors as the centers in :meth:`state_dict`)."""
        return {v.name: c for v, c in zip(self.views, self.centers)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the centers and optimizer state exactly, then restore the live weights.  Names, shapes,
        dtypes and devices of every entry are checked before anything is copied."""
        expected = self.state_dict()
        check_state(state, expected)
        self._pending, self._at_center = None, False
        for name, dst in expected.items():
            if name != OPTIM_STEP:
                dst.copy_(state[name])
        if OPTIM_STEP in expected:
            self.step = int(state[OPTIM_STEP].reshape(-1)[0])
        self._rebuild_mirrors()
        self.restore()
