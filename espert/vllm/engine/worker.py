"""The worker extension: espert inside vLLM's model runner, driven by ``llm.collective_rpc``.

Create the engine with ``LLM(model=..., worker_extension_cls="espert.vllm.engine.worker.ESWorkerExtension",
enable_prefix_caching=False)``; vLLM mixes this class into every worker (one per TP rank), so its ``es_*``
methods run next to the live weights::

    llm.collective_rpc("es_setup", kwargs=dict(include=None, exclude=None, optimizer="adam"))
    llm.collective_rpc("es_perturb", args=(seed, sigma, sign))   # in place, from the center
    llm.collective_rpc("es_restore")                             # exact: copies the host center back
    llm.collective_rpc("es_update", args=(seeds, coeffs, decay, lr, anchor))  # optimizer step on the host master
    llm.collective_rpc("es_checksum")                            # cheap exact fingerprint, per rank

Only seeds, scalars and (for checkpoints) the center cross the RPC.  Edits go through espert's fused ops on
the live tensors (never reallocated: data pointers and CUDA graphs stay valid); the only copy of the weights
is espert's CenterStore in host memory.  Importing this module installs espert's patches of vLLM internals
(:func:`espert.vllm.patches.install`); vLLM imports it in each worker before the model loads.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import TYPE_CHECKING, Sequence

import torch

from espert import tensorfile
from espert.center import CenterStore, Optimizer
from espert.update import Update
from espert.vllm import patches, wire
from espert.vllm.engine import w8a8
from espert.vllm.engine.lora import LoraSlots, slot_error
from espert.vllm.engine.params import LayoutError, checkpoint_shapes, routed_experts, vllm_param_views
from espert.vllm.engine.repack import RepackingCenter
from espert.vllm.engine.selftest import check_edits_reach_forward
from espert.vllm.patches import cpu_prepack, say_counted_warnings
from espert.vllm.wire import EXACT_FIELDS  # noqa: F401 - its former home: compat.py and tests import it from here

if TYPE_CHECKING:  # what vLLM's worker gives its extension (tools/vllm_contract.py checks their members)
    from vllm.config import VllmConfig

    try:  # vLLM's V1 model runner (0.11 to 0.33), or its V2 runner (0.12 on; the only one in 0.34)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

patches.install()  # before the worker loads the model: every patch this vLLM gets (espert/vllm/patches/)


#: Elements sampled per tensor for the checksum hash.
CHECKSUM_SAMPLES = 1024


def _bits_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16).numpy().tobytes()


def _bit_sum(t: torch.Tensor) -> int:
    """Sum of the raw bit patterns as int64: exact and order-independent (same on any thread count or device)."""
    return int(torch.sum(t.view(torch.int32 if t.element_size() == 4 else torch.int16), dtype=torch.int64))


def fingerprint(views, centers) -> dict:
    """Per-rank checksum of the live weights and the center: ``live_bits`` and ``center_bits`` (int64 sums of every
    element's bit pattern) and ``hash`` (blake2b of ≤ CHECKSUM_SAMPLES strided elements per tensor with their
    names), exact and compared between replicas; ``live_sum`` and ``center_sum`` (float64 sums) for people.
    One reduction pass over each tensor; nothing proportional to the model is allocated."""
    h = hashlib.blake2b(digest_size=16)
    out = {"live_bits": 0, "center_bits": 0}
    live_sum, center_sum = [], []
    for v, c in zip(views, centers):
        h.update(v.name.encode())
        for t, kind, acc in ((v.tensor, "live", live_sum), (c, "center", center_sum)):
            flat = t.reshape(-1)
            step = max(1, flat.numel() // CHECKSUM_SAMPLES)
            h.update(_bits_bytes(flat[::step]))
            out[f"{kind}_bits"] = (out[f"{kind}_bits"] + _bit_sum(t)) % (1 << 64)
            acc.append(float(torch.sum(t, dtype=torch.float64)))
    out.update(hash=h.hexdigest(), live_sum=math.fsum(live_sum), center_sum=math.fsum(center_sum))
    return out


def _allow_amx() -> None:
    """Ask Linux for this process's AMX tile state (idempotent; a no-op without AMX).  vLLM-CPU's attention
    kernels take their AMX path on processors that have it but never ask for the state, so in a fresh
    worker process (a Ray actor) the first AMX instruction, here the self-test's forward, dies with
    SIGILL (in-process engines survive, most likely because torch's own kernels asked first)."""
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init is not None:
        init()


def _check_w8a8_loop(optimizer, sigma_scales, no_decay, members: str) -> None:
    """W8A8 int8 models take serial members, sgd, absolute σ and no decay exclusions."""
    if members == "batched":
        raise ValueError("members: batched needs unquantized weights (LoRA slots); this model has W8A8 int8 layers")
    loop = (Optimizer.of(optimizer).name, sigma_scales is not None, bool(no_decay))
    if loop != ("sgd", False, False):
        raise ValueError(
            f"W8A8 int8 models take optimizer=sgd, sigma_mode=absolute and no "
            f"weight_decay_exclude (got optimizer={loop[0]!r}, "
            f"sigma_mode={'rms' if loop[1] else 'absolute'}, weight_decay_exclude={list(no_decay)}; "
            f"with weight_decay, set weight_decay_exclude: [] to decay every moved tensor)"
        )


def _check_setup(model, members: str, master: str) -> None:
    """Before es_setup maps anything: vLLM's repeated warnings since the load said once each
    (espert/vllm/patches/quiet.py), the CPU prepack patch in effect, and the two choices valid."""
    say_counted_warnings()
    cpu_prepack.check_model(model)
    _check_choice("members", members, ("serial", "batched"))
    _check_choice("master", master, ("float32", "weights"))
    experts = next((n for n, m in model.named_modules() if routed_experts(m)), None) if members == "batched" else None
    if experts is not None:
        raise ValueError(
            f"{experts}: batched members fill vLLM LoRA slots of Linear layers only, so a mixture of experts' "
            f"experts would not move; use vllm_members: serial"
        )


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got {value!r}")


def _model_dir(worker) -> str | None:
    """The local directory of the worker's checkpoint (a Hub id resolved in the local cache), or None."""
    files = tensorfile.checkpoint_files(worker.vllm_config.model_config.model)
    return os.path.dirname(files[0]) if files else None


def _scales_for(views, sigma_scales: dict[str, float] | None) -> list[float] | None:
    """The σ multipliers of ``views`` in order, from ``{logical name: scale}`` (which must name them all)."""
    if sigma_scales is None:
        return None
    missing = [v.name for v in views if v.name not in sigma_scales]
    if missing:
        raise ValueError(f"sigma_scales has no scale for {len(missing)} selected parameters ({missing[:4]})")
    return [sigma_scales[v.name] for v in views]


class ESWorkerExtension:
    """Mixed into vLLM's worker class; see the module docstring.  State lives in ``self._es_*``."""

    #: the host worker's attributes this extension uses (annotations only: vLLM's worker sets them)
    model_runner: GPUModelRunner
    vllm_config: VllmConfig

    # -- helpers ---------------------------------------------------------------------------------
    def _es_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _es_require(self):
        center = getattr(self, "_es_center", None)
        if center is None:
            raise RuntimeError("espert worker extension: call es_setup first")
        return center

    def _es_sync(self) -> None:
        """Finish the in-place edits before the RPC returns (CUDA; CPU: no-op).  espert's ops enqueue on torch's
        current stream, vLLM's in the worker thread, so this only keeps the order if a later generate ran on
        another stream."""
        c = getattr(self, "_es_center", None)
        if c is not None and c.views and c.views[0].tensor.is_cuda:
            torch.cuda.current_stream(c.views[0].tensor.device).synchronize()

    def _es_rank(self) -> tuple[int, int]:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001 - not initialised: a single worker
            return 0, 1

    # -- the RPC surface -------------------------------------------------------------------------
    def es_setup(
        self,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        master: str = "float32",
        rename: dict[str, str] | None = None,
        check_names: bool = True,
        noise: str = "gaussian",
        optimizer: dict | str | None = None,
        sigma_scales: dict[str, float] | None = None,
        no_decay: Sequence[str] = (),
        members: str = "serial",
        anchor: bool = False,
        quant_master: str = "float32",
    ) -> dict:
        """Map the live model to logical ParamViews and snapshot the center (host, float32 master by default).

        include / exclude: patterns on logical names.  rename: {vLLM unfused name: checkpoint name} where names
        differ beyond packing.  check_names: refuse (LayoutError) unless every logical name is a tensor of the
        model's safetensors checkpoint with the same shape.  noise, optimizer (a name or ``{"name", "beta1",
        "beta2", "eps"}``), no_decay (name patterns): the loop fields, as :class:`~espert.center.CenterStore`
        takes them.  sigma_scales: ``{logical name: σ multiplier}`` for ``sigma_mode: rms``, naming every
        selected parameter (:func:`espert.vllm.driver.build.checkpoint_rms_scales`).  quant_master: a quantized
        model's code master when ``master`` is float32 (float32, float16 or residual8).  members: ``"serial"``
        (in place) or ``"batched"`` (lowrank noise in LoRA slots, :mod:`espert.vllm.engine.lora`).  anchor: keep
        the base for es_update's anchor step.  Then the self-test (``EditsNotVisible``).

        Returns ``{"rank", "tp_size", "params": [logical names], "numel", "center_bytes", "device",
        "self_test": [probed names], "runner": "V1 (...)" or "V2 (...)", "members", "unmoved": [logical names]}``.
        Raises (naming the parameter) for layouts it cannot map, RuntimeError without the CPU prepack patch.
        """
        model = self._es_model()
        _check_setup(model, members, master)
        select = dict(include=include, exclude=exclude, rename=(lambda n: rename.get(n, n)) if rename else None)
        loop = dict(noise=noise, optimizer=optimizer, no_decay=list(no_decay), anchor=bool(anchor))
        center, slots = self._es_center_for(model, select, master, quant_master, sigma_scales, members, loop)
        if check_names:
            self._es_check_names(center.views)
        info = self._es_install(RepackingCenter(center, model), model, str(center.views[0].tensor.device))
        if slots is not None:
            slots.pin(self.model_runner.lora_manager)  # after the self-test's forward passes
        self._es_lora = slots
        return {**info, "members": members, "unmoved": [] if slots is None else slots.unmoved}

    def _es_center_for(self, model, select: dict, master: str, quant_master: str, sigma_scales, members, loop: dict):
        """``(center, LoRA slots or None)``: the one place es_setup picks its center.  A model with quantized
        layers (W8A8 / W4A16) gets a :class:`~espert.vllm.engine.w8a8.W8A8Center` (codes + float tensors); a float
        model a :class:`~espert.center.CenterStore` over its views, or over what the LoRA slots carry (batched)."""
        if w8a8.has_w8a8(model):  # codes: espert/vllm/engine/w8a8.py
            _check_w8a8_loop(loop["optimizer"], sigma_scales, loop["no_decay"], members)
            qmaster = quant_master if master == "float32" else False
            center = w8a8.W8A8Center(
                model, master=qmaster, noise=loop["noise"], anchor=loop["anchor"], checkpoint=_model_dir(self), **select
            )
            return center, None
        views, slots = vllm_param_views(model, **select), None
        if members == "batched":  # the center holds what the LoRA slots carry (espert/vllm/engine/lora.py)
            slots = self._es_lora_slots(model, views, loop["noise"])
            views = slots.views
        master_dtype, pin = torch.float32 if master == "float32" else None, views[0].tensor.is_cuda
        return CenterStore(views, master_dtype, pin, sigma_scales=_scales_for(views, sigma_scales), **loop), slots

    def _es_lora_slots(self, model, views, noise: str):
        if getattr(self.model_runner, "lora_manager", None) is None:
            raise ValueError("members: batched needs an engine created with enable_lora=True (espert.vllm.make_llm)")
        return LoraSlots(model, views, wire.batched_rank(noise))

    def _es_install(self, center, model: torch.nn.Module, device: str) -> dict:
        """Run the self-test (edits must reach the forward pass; :mod:`espert.vllm.engine.selftest`), then make
        ``center`` this worker's center.  A failed self-test raises and leaves the previous center."""
        if device == "cpu":
            _allow_amx()
        probed = check_edits_reach_forward(self.model_runner, model, center.views, RepackingCenter)
        self._es_center = center
        rank, tp = self._es_rank()
        return {
            "rank": rank,
            "tp_size": tp,
            "params": [v.name for v in center.views],
            "numel": sum(v.numel for v in center.views),
            "center_bytes": center.nbytes,
            "device": device,
            "self_test": probed,
            "runner": patches.runner_name(self.model_runner),
        }

    def _es_check_names(self, views) -> None:
        shapes = checkpoint_shapes(self.vllm_config.model_config.model)
        if shapes is None:
            return
        missing = [v.name for v in views if v.name not in shapes]
        if missing:
            raise LayoutError(
                f"{len(missing)} logical parameter names are not in the checkpoint ({missing[:4]}...): "
                f"noise would be keyed by the wrong names.  Map vLLM names to checkpoint names with "
                f"rename= (CLI: vllm_rename: ['vllm_name=checkpoint_name', ...]), or exclude them"
            )
        for v in views:
            want = shapes[v.name]
            got = wire.logical_shape(v.tensor.shape, v.block)
            if tuple(got) != tuple(want):
                raise LayoutError(
                    f"{v.name}: the live logical tensor is {tuple(got)}, the checkpoint's is "
                    f"{tuple(want)}; check rename= / vllm_rename"
                )

    def es_perturb(self, seed: int, sigma: float, sign: int = 1) -> None:
        """Live weights <- center + sign·σ·ε(seed) (from the restored state), in place."""
        self._es_require().perturb(int(seed), float(sigma), int(sign))
        self._es_sync()

    def es_lora_fill(self, members: Sequence[Sequence[int]], sigma: float) -> list[int]:
        """members: batched: write the factors of ``members`` [(seed, sign)] into this engine's LoRA slots
        (the weights are not touched); returns the adapter ids to generate with, in member order."""
        slots = getattr(self, "_es_lora", None)
        if slots is None:
            raise RuntimeError("espert worker extension: es_lora_fill needs es_setup(members='batched')")
        ids = slots.fill([(int(s), int(g)) for s, g in members], float(sigma), self._es_require().sigma_scales)
        self._es_sync()
        return ids

    def es_lora_error(self, seed: int, sign: int, sigma: float) -> dict[str, float]:
        """members: batched: max relative difference, per logical piece on this rank, between the change a
        LoRA slot adds and the in-place perturbation of the same member (:func:`espert.vllm.engine.lora.slot_error`)."""
        slots = getattr(self, "_es_lora", None)
        if slots is None:
            raise RuntimeError("espert worker extension: es_lora_error needs es_setup(members='batched')")
        return slot_error(slots, int(seed), int(sign), float(sigma), self._es_require().sigma_scales)

    def es_lora_slots(self) -> int:
        """The number of LoRA slots espert fills (0 unless set up with members='batched')."""
        slots = getattr(self, "_es_lora", None)
        return 0 if slots is None else slots.count

    def es_restore(self) -> None:
        """Live weights <- the exact center (host copy), in place."""
        self._es_require().restore()
        self._es_sync()

    def es_update(
        self,
        seeds: Sequence[int],
        coeffs: Sequence[float],
        decay: float = 1.0,
        lr: float | None = None,
        anchor: dict | None = None,
    ) -> None:
        """center <- decay·center + Σ coeffs[n]·ε(seeds[n]) on the host master (CPU op), then the anchor step
        ``{"norm", "amount"}`` toward the base (needs es_setup(anchor=True)), then restore: the
        :class:`~espert.update.Update` whose :meth:`~espert.update.Update.wire` these arguments are."""
        self._es_require().update(Update(seeds, coeffs, decay, lr, anchor))
        self._es_sync()

    def _es_pieces(self) -> list:
        """This rank's center pieces: a ParamView per entry of the center's state dict (centers, optimizer slots
        ``optim.<slot>/<name>`` with their parameter's Block, ``optim.step``; ``CenterStore.state_views``)."""
        return self._es_require().state_views()

    def es_center_state(self) -> list[tuple[str, torch.Tensor, tuple | None]]:
        """This rank's center pieces ``(logical name, packed tensor, block tuple)`` in one message; see
        :func:`espert.vllm.wire.assemble`.  Small models and tests; checkpoints stream with :meth:`es_center_chunk`."""
        return [(p.name, wire.pack_tensor(p.tensor), wire.block_to_tuple(p.block)) for p in self._es_pieces()]

    def es_center_layout(self) -> list[tuple[str, list, tuple | None, str]]:
        """``(logical name, local shape, block tuple, dtype name)`` of this rank's center pieces."""
        return wire.layout_rows(self._es_pieces())

    def es_center_chunk(self, k: int, chunk_bytes: int) -> tuple[int, int, int, bytes] | None:
        """The k-th chunk of this rank's center, ``(piece index, flat start, stop, raw bytes)`` of at most
        ``chunk_bytes`` bytes, or None past the end (see :mod:`espert.vllm.driver.stream`)."""
        ts = [p.tensor for p in self._es_pieces()]
        plan = wire.chunk_plan([t.numel() for t in ts], [t.element_size() for t in ts], int(chunk_bytes))
        for j, (i, a, b) in enumerate(plan):
            if j == k:
                return i, a, b, wire.bits(ts[i].reshape(-1)[a:b]).numpy().tobytes()
        return None

    def es_live_state(self) -> list[tuple[str, torch.Tensor, tuple | None]]:
        """This rank's live weight pieces (copies, on the host), for tests and diagnostics."""
        c = self._es_require()
        return [(v.name, wire.pack_tensor(v.tensor), wire.block_to_tuple(v.block)) for v in c.views]

    def es_load_center(self, state: dict) -> None:
        """Replace the center (and optimizer state) from full logical tensors (name -> tensor, or ``pack_tensor``
        form), the entries of :meth:`es_center_layout`, in one message; each rank takes its blocks."""
        self.es_load_begin()
        for k, v in state.items():
            self.es_load_tensor(k, v)
        self.es_load_commit()

    def es_load_begin(self) -> None:
        """Start a center load, one tensor per :meth:`es_load_tensor`; the center is untouched until
        :meth:`es_load_commit` (a new begin drops an unfinished load)."""
        self._es_require()
        self._es_staged: dict[str, torch.Tensor] | None = {}
        self._es_load_pieces: dict[str, list] = {}  # logical name -> this rank's pieces of it
        for p in self._es_pieces():
            self._es_load_pieces.setdefault(p.name, []).append(p)

    def es_load_tensor(self, name: str, value) -> None:
        """Stage one full logical tensor (tensor or ``pack_tensor`` form); this rank keeps its block of it."""
        staged = getattr(self, "_es_staged", None)
        if staged is None:
            raise RuntimeError("es_load_tensor without es_load_begin")
        pieces = self._es_load_pieces.get(name, [])  # empty: not on this rank (or unknown)
        local = wire.split_logical(pieces, {name: wire.unpack_tensor(value)})
        for p in pieces:
            staged[p.name] = local[p.name].to(dtype=p.tensor.dtype).contiguous()

    def es_load_commit(self) -> None:
        """Replace the center with the staged tensors (every entry of this rank's center must be staged;
        checked before anything is copied), then restore the live weights."""
        staged, self._es_staged, self._es_load_pieces = getattr(self, "_es_staged", None), None, {}
        if staged is None:
            raise RuntimeError("es_load_commit without es_load_begin")
        self._es_require().load_state_dict(staged)
        self._es_sync()

    def es_checksum(self) -> dict:
        """``{"rank", "live_bits", "center_bits", "hash", "live_sum", "center_sum"}``: see :func:`fingerprint`."""
        c = self._es_require()
        out = fingerprint(c.views, c.centers)
        out["rank"] = self._es_rank()[0]
        return out

    def es_stats(self) -> dict:
        """``{"repack_seconds", "repacks"}``: time and count of CPU repacks of edited layers since es_setup."""
        c = self._es_require()
        return {"repack_seconds": float(c.repack_seconds), "repacks": int(c.repacks)}

    def es_data_ptrs(self) -> dict[str, int]:
        """data_ptr() of every parameter of the vLLM model (must never change: CUDA graphs hold them)."""
        return {n: p.data_ptr() for n, p in self._es_model().named_parameters(remove_duplicate=False)}

    def es_layout(self) -> list[tuple[str, list, tuple | None, str]]:
        """``(logical name, local shape, block tuple, dtype name)`` of every live view, for inspection and docs."""
        return wire.layout_rows(self._es_require().views)
