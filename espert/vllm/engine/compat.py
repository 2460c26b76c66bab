"""A drop-in for ES-at-Scale's vLLM worker extension (github.com/VsonicV/es-at-scale), with espert underneath.
Change one string in their trainer::

    worker_extension_cls="espert.vllm.compat.ESAtScaleWorkerExtension"

Same method names, arguments and meaning over espert's center: noise keyed by (seed, logical name, logical
element), so equally shaped tensors no longer share noise (their issue #46); exact restore; a float32 host
master updated by the fused kernel; ``broadcast_all_weights`` sends seeds, coefficients and checksums, not
weights.  Where the meaning differs (restore ignores its arguments, an outstanding perturbation becomes a
one-seed update, the noise is espert's, the checkpoint files, a TCP-store group): docs/vllm.md, "Drop-in
for ES-at-Scale".
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from espert.files import atomic_write
from espert.tensorfile import write_safetensors
from espert.update import Update
from espert.vllm.engine.worker import EXACT_FIELDS, ESWorkerExtension
from espert.vllm.wire import assemble, unpack_tensor

log = logging.getLogger("espert.vllm")


def master_path(path: str) -> str:
    """Where :meth:`ESAtScaleWorkerExtension.save_self_weights_to_disk` puts the float32 master for ``path``:
    ``<root>.safetensors`` (``<root>.master.safetensors`` when ``path`` itself ends in ``.safetensors``)."""
    root, ext = os.path.splitext(path)
    return root + (".master.safetensors" if ext == ".safetensors" else ".safetensors")


class ESAtScaleWorkerExtension(ESWorkerExtension):
    """ES-at-Scale's worker-extension methods over espert's center, snapshotted from the live weights at the first
    call that needs it (or :meth:`save_self_initial_weights`); espert's own ``es_*`` methods stay available."""

    # -- state --------------------------------------------------------------------------------
    def _compat(self):
        if getattr(self, "_es_center", None) is None:
            self.es_setup()
            self._compat_reset()
        if not hasattr(self, "_compat_pending"):  # es_setup was called directly
            self._compat_reset()
        return self._es_center

    def _compat_reset(self) -> None:
        self._compat_outstanding = None  # (seed, signed scale) of a perturbation not undone yet
        self._compat_pending = []  # the updates applied since the last broadcast: [(seeds, coeffs)]

    def _compat_apply(self, seeds: list[int], coeffs: list[float]) -> None:
        """center += Σ coeffs·ε(seeds) (float32 master), live weights restored; recorded for the broadcast."""
        self._es_center.update(Update(seeds, coeffs))
        self._compat_pending.append((seeds, coeffs))

    def _compat_commit(self) -> None:
        """An outstanding perturbation becomes part of the center (their weights are additive: what was
        not subtracted stays), as a one-seed update."""
        if self._compat_outstanding is not None:
            seed, scale = self._compat_outstanding
            self._compat_outstanding = None
            self._compat_apply([seed], [scale])

    # -- ES-at-Scale's surface -----------------------------------------------------------------
    def save_self_initial_weights(self) -> bool:
        """Snapshot the current weights as the float32 host center (their: a CPU copy of the weights)."""
        self._es_center = None
        self._compat()
        return True

    def perturb_self_weights(self, seed: int, noise_scale: float, negate: bool = False) -> bool:
        """Live weights <- center ± noise_scale·ε(seed) (minus when negate), in place.  A perturbation still
        outstanding (no restore since) is first made part of the center as a one-seed update, so their older
        scripts' N stacked perturbs equal N one-seed updates of the float32 master (docs/vllm.md)."""
        self._compat()
        self._compat_commit()
        scale = -float(noise_scale) if negate else float(noise_scale)
        self._es_center.perturb(int(seed), abs(scale), -1 if negate else 1)
        self._compat_outstanding = (int(seed), scale)
        self._es_sync()
        return True

    def restore_self_weights(self, seed: int | None = None, sigma: float | None = None) -> bool:
        """Live weights <- the exact center.  seed and sigma are accepted and ignored (nothing is subtracted)."""
        self._compat().restore()
        self._compat_outstanding = None
        self._es_sync()
        return True

    def update_weights_from_seeds(
        self, seeds: Sequence[int], coeffs: Sequence[float], alpha: float, population_size: int
    ) -> bool:
        """center <- center + (alpha/population_size)·Σ coeffs[i]·ε(seeds[i]) (float32 master), then restore.

        An outstanding perturbation is made part of the center first (see :meth:`perturb_self_weights`).
        """
        self._compat()
        if isinstance(population_size, bool) or not isinstance(population_size, int) or population_size < 1:
            raise ValueError(f"population_size must be an int >= 1, got {population_size!r}")
        scale = float(alpha) / float(population_size)
        self._compat_commit()
        self._compat_apply([int(s) for s in seeds], [scale * float(c) for c in coeffs])
        self._es_sync()
        return True

    def init_inter_engine_group(self, master_address: str, master_port: int, engine_idx: int, num_engines: int) -> bool:
        """Join the group of engines (one group per TP rank, on port master_port + tp_rank, as ES-at-Scale)."""
        from vllm.distributed.utils import StatelessProcessGroup

        self._compat()
        tp_rank, _ = self._es_rank()
        self._compat_group = StatelessProcessGroup.create(
            host=master_address, port=int(master_port) + tp_rank, rank=int(engine_idx), world_size=int(num_engines)
        )
        return True

    def broadcast_all_weights(self, src_rank: int) -> bool:
        """Every engine ends with engine ``src_rank``'s center and weights, bit for bit: src sends the updates it
        applied since the last broadcast and its checksum, the others apply them and compare, and any engine
        that still differs loads src's whole center.  Call it on every engine, as ES-at-Scale does."""
        center = self._compat()
        group = getattr(self, "_compat_group", None)
        if group is None:
            raise RuntimeError("broadcast_all_weights needs init_inter_engine_group first")
        src = int(src_rank)
        mine = group.rank == src
        if mine:  # the source's weights are what it broadcasts, an outstanding perturbation included
            self._compat_commit()
        elif self._compat_outstanding is not None:  # overwritten by the source's weights
            center.restore()
            self._compat_outstanding = None
        msg = group.broadcast_obj((self._compat_pending, self._exact()) if mine else None, src=src)
        ok = mine or not self._compat_pending  # an engine that moved on its own: only a full copy can fix it
        if ok and not mine:
            for seeds, coeffs in msg[0]:
                center.update(Update(seeds, coeffs))
            ok = self._exact() == msg[1]
        flags = group.all_gather_obj(ok)
        if not all(flags):
            full = group.broadcast_obj(self.es_center_state() if mine else None, src=src)
            if not ok:
                center.load_state_dict({name: unpack_tensor(t) for name, t, _ in full})
                if self._exact() != msg[1]:
                    raise RuntimeError(
                        "broadcast_all_weights: this engine still differs from the source engine "
                        "after loading its center"
                    )
        self._compat_pending = []
        self._es_sync()
        return True

    def save_self_weights_to_disk(self, filepath: str) -> bool:
        """Write ``filepath`` in their format (``torch.save`` of the engine's ``named_parameters()`` in its dtype,
        what their loader and eval read; not at tensor parallel size > 1, where one file cannot hold every
        rank's shards) and beside it, at :func:`master_path`, the float32 center by logical name, from which
        :meth:`load_weights_from_disk` resumes exactly.  An outstanding perturbation is made part of the center
        first.  Both files are written to a temporary name and renamed, so a crash leaves the old ones.
        """
        self._compat()
        self._compat_commit()
        rank, tp = self._es_rank()
        mine = self.es_center_state()
        ranks: list = [mine]
        if tp > 1:
            import torch.distributed as dist
            from vllm.distributed import get_tp_group

            ranks = [None] * tp
            dist.all_gather_object(ranks, mine, group=get_tp_group().cpu_group)
            if rank != 0:
                return True
        state = assemble(ranks)
        os.makedirs(os.path.dirname(os.path.abspath(filepath)), exist_ok=True)
        atomic_write(master_path(filepath), lambda tmp: write_safetensors(tmp, state, {"format": "pt"}))
        if tp == 1:
            engine = {n: p.detach().cpu().clone() for n, p in self._es_model().named_parameters()}
            atomic_write(filepath, lambda tmp: torch.save(engine, tmp))
        else:
            log.warning("save_self_weights_to_disk: tensor_parallel_size=%d, wrote only %s", tp, master_path(filepath))
        return True

    def load_weights_from_disk(self, filepath: str) -> bool:
        """Load a checkpoint exactly: the float32 master beside ``filepath`` when there is one (see
        :meth:`save_self_weights_to_disk`), else ``filepath`` itself: logical names (an older espert
        checkpoint) or the engine's vLLM names (their ``.pth``, or ours without its master; TP=1)."""
        center = self._compat()
        st = master_path(filepath)
        if os.path.exists(st):
            from safetensors.torch import load_file

            state = load_file(st)
        elif os.path.exists(filepath):
            state = torch.load(filepath, map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"no checkpoint at {filepath} (nor {st})")
        names = {v.name for v in center.views}
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{filepath}: not a dict of tensors")
        if names <= set(state):
            self.es_load_center({k: state[k] for k in names})
        else:
            self._load_vllm_named(state, filepath)
        self._compat_reset()
        return True

    # -- helpers ---------------------------------------------------------------------------------
    def _exact(self) -> dict:
        out = self.es_checksum()
        return {k: out[k] for k in EXACT_FIELDS}

    def _load_vllm_named(self, state: dict, filepath: str) -> None:
        """ES-at-Scale's own .pth: vLLM parameter names, the engine's dtype, one TP=1 copy."""
        params = dict(self._es_model().named_parameters())
        if not set(params) <= set(state):
            missing = sorted(set(params) - set(state))[:4]
            raise KeyError(
                f"{filepath}: neither espert's checkpoint names nor this engine's vLLM parameter names "
                f"(missing {missing}...)"
            )
        _, tp = self._es_rank()
        if tp != 1:
            raise ValueError(
                f"{filepath}: ES-at-Scale .pth checkpoints hold TP=1 tensors; this engine has tensor_parallel_size={tp}"
            )
        for n, p in params.items():
            if tuple(state[n].shape) != tuple(p.shape):
                raise ValueError(f"{filepath}: {n} has shape {tuple(state[n].shape)}, the engine's is {tuple(p.shape)}")
        with torch.no_grad():
            for n, p in params.items():
                p.data.copy_(state[n].to(p.dtype))
        self._es_center = None  # re-snapshot the center from the loaded weights
        self._compat()
        self._es_center.restore()  # marks the packed copies stale (vLLM-CPU)
