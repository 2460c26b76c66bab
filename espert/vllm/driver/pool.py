"""A population over several vLLM engines: Ray actors, each owning one engine.

    pool = EnginePool(model_path, task.score, engines=4, llm_kwargs=dict(tensor_parallel_size=1))
    rewards = pool.evaluate(members, sigma, prompts, answers)   # members spread over the engines
    pool.update(seeds, coeffs, decay)                           # every engine applies it itself

What travels per iteration (never weights):

    driver -> engine   members (seed: uint64, sign: ±1), σ, the prompts/answers (once per chunk)
    engine -> driver   one float64 reward per member (+ the task's extracted answer per member per
                       prompt, short strings, when the pool is given the task's ``extract``)
    driver -> engine   the update: seeds (8 B each), coefficients (float64 -> float32), decay
    engine -> driver   a checksum per TP rank (two exact int64 bit sums, a 16-byte hash, two float64 sums)

Every engine applies the same update to its own float32 host master through espert's CPU op,
whose arithmetic is fixed (docs/noise.md), so all replicas hold bit-identical centers.  The
checksums returned by ``update`` are compared every iteration; any difference raises
:class:`ReplicaDivergence` (stop loudly: a silent fork would train N different models).

Members are handed out in chunks from a queue, so a fast engine takes more.  A member's reward
depends only on (center, member, σ, prompts), not on which engine scores it, so rewards are
identical with 1 or N engines.  When an engine dies (its actor raises ``RayActorError``), its
chunk goes back on the queue and is scored by a live engine; the dead engine is dropped from
the pool (``dead`` lists it).  Losing every engine raises.

Mapping to many nodes: nothing here assumes one machine.  Start Ray on a cluster
(``ray start --head`` / ``ray start --address=...``), pass ``num_gpus_per_engine`` (e.g. the TP
size) and Ray places one actor per GPU group anywhere in the cluster; only the bytes above
cross the network.  ``load_center`` (resume) is the one call that sends weights, once; checkpoints
stream the center out of one engine in bounded chunks (``center_stream``).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import time
from collections import deque
from typing import Callable, Sequence

import torch

from espert.evaluators.base import Evaluator, Member, center_energy
from espert.tensorfile import CHUNK_BYTES

log = logging.getLogger("espert.vllm")


class ReplicaDivergence(RuntimeError):
    """Engines that applied the same updates hold different weights."""


class EngineActor:
    """One vLLM engine and its espert evaluator, living in its own process (a Ray actor).

    env: environment set before vLLM is imported in this process (e.g. in-process V1 engine,
    KV cache size, thread binding).
    """

    def __init__(self, model: str, score: Callable, ev_kwargs: dict, llm_kwargs: dict, env: dict):
        os.environ.update({k: str(v) for k, v in env.items()})
        from espert.vllm.driver.evaluator import VLLMEvaluator

        self.ev = VLLMEvaluator(model, score, llm_kwargs=llm_kwargs, **ev_kwargs)

    def ready(self) -> dict:
        return {"pid": os.getpid(), "info": self.ev.info}

    def evaluate(self, members, sigma, prompts, answers) -> tuple[list[float], list | None]:
        """The members' rewards and their extracted answers (``member_answers``; None without ``extract``)."""
        rewards = self.ev.evaluate([tuple(m) for m in members], sigma, prompts, answers)
        return rewards, self.ev.member_answers

    def evaluate_center(self, prompts, answers) -> list[float]:
        return self.ev.evaluate_center(prompts, answers)

    def update(self, seeds, coeffs, decay, lr=None, anchor=None) -> list[dict]:
        self.ev.update(seeds, coeffs, decay, lr, anchor=anchor)
        return self.ev.checksum()

    def checksum(self) -> list[dict]:
        return self.ev.checksum()

    def center_state(self):
        from espert.vllm.wire import pack_tensor

        return {k: pack_tensor(v) for k, v in self.ev.center_state().items()}

    def load_center(self, state) -> list[dict]:
        from espert.vllm.wire import unpack_tensor

        self.ev.load_center({k: unpack_tensor(v) for k, v in state.items()})
        return self.ev.checksum()

    def rpc(self, method: str, *args):
        """Call a worker-extension method directly (diagnostics and tests)."""
        return self.ev.rpc(method, *args)

    def timings(self) -> dict:
        return dict(self.ev.timings)

    def close(self) -> None:
        self.ev.close()


def _nbytes(obj) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class EnginePool(Evaluator):
    """The Evaluator interface over ``engines`` vLLM engines in Ray actors (see the module docstring).

    model: model directory or Hub id.  score: the task's batched reward (picklable).
    engines: number of engines.  chunk: members per task handed to an engine (default: spread
    the population evenly, about two chunks per engine).  llm_kwargs: passed to
    :func:`espert.vllm.make_llm` in each actor.  num_cpus_per_engine / num_gpus_per_engine: Ray
    resources per actor (GPU: set num_gpus_per_engine to the TP size).  env: extra environment
    for the actors.  ray_init: keyword arguments for ``ray.init`` when Ray is not initialised yet.
    Other keyword arguments go to :class:`espert.vllm.VLLMEvaluator`.

    ``traffic`` records the pickled size of every message of the last iteration (``evaluate`` +
    ``update``), by direction; ``weights_bytes`` is what one broadcast of the center would cost.
    """

    def __init__(
        self,
        model: str,
        score: Callable,
        *,
        engines: int = 2,
        chunk: int | None = None,
        llm_kwargs: dict | None = None,
        num_cpus_per_engine: float = 1,
        num_gpus_per_engine: float = 0,
        env: dict | None = None,
        ray_init: dict | None = None,
        **ev_kwargs,
    ):
        import ray

        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        if not ray.is_initialized():
            ray.init(**{"include_dashboard": False, "log_to_driver": False, **(ray_init or {})})
        self._ray = ray
        self.chunk = chunk
        self.chunk_bytes = CHUNK_BYTES  # center_stream's chunk size (as VLLMEvaluator.chunk_bytes)
        self.sigma_scales = ev_kwargs.get("sigma_scales")  # as VLLMEvaluator.sigma_scales
        ncpu = os.cpu_count() or 1
        actor_cls = ray.remote(num_cpus=num_cpus_per_engine, num_gpus=num_gpus_per_engine)(EngineActor)
        self.actors = []
        for i in range(engines):
            e = {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            }
            if num_gpus_per_engine == 0:
                if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                    e["VLLM_CPU_OMP_THREADS_BIND"] = str(i % ncpu)  # one core per CPU engine, no oversubscription
                # OpenMP reads this when the runtime loads, i.e. before any Python runs in the actor; more
                # threads than cores makes espert's kernels and vLLM's GEMMs stall on a busy machine
                e.setdefault(
                    "OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(max(1, int(num_cpus_per_engine))))
                )
            e.update(env or {})
            opts = actor_cls.options(runtime_env={"env_vars": e})
            self.actors.append(opts.remote(model, score, ev_kwargs, llm_kwargs or {}, e))
        infos = ray.get([a.ready.remote() for a in self.actors])
        self.info = infos[0]["info"]
        self.alive = list(range(engines))
        self.dead: list[int] = []
        numel = sum(r["numel"] for r in self.info)
        self.weights_bytes = 4 * numel  # one float32 center
        self.traffic: dict[str, int] = {}
        self.checksums: list[list[dict]] = []

    # -- failure handling --------------------------------------------------------------------------
    def _mark_dead(self, i: int, err: BaseException) -> None:
        if i in self.alive:
            self.alive.remove(i)
            self.dead.append(i)
            log.warning(
                "engine %d died (%s); its work is re-queued, %d engines left", i, type(err).__name__, len(self.alive)
            )
        if not self.alive:
            raise RuntimeError("every engine of the pool died") from err

    def _count(self, key: str, obj) -> None:
        self.traffic[key] = self.traffic.get(key, 0) + _nbytes(obj)

    # -- the Evaluator interface -------------------------------------------------------------------
    def evaluate(
        self, members: Sequence[Member], sigma: float, prompts: Sequence[str], answers: Sequence[str]
    ) -> list[float]:
        ray = self._ray
        members = [(int(s), int(g)) for s, g in members]
        self.traffic = {}
        n = len(members)
        size = self.chunk or max(1, math.ceil(n / (2 * max(1, len(self.alive)))))
        queue = deque((i, members[i : i + size]) for i in range(0, n, size))
        out: list[float | None] = [None] * n
        extracted: list | None = [None] * n  # member_answers; None once an engine returns none
        running: dict = {}  # ObjectRef -> (engine, start, chunk)
        prompts, answers = list(prompts), list(answers)
        # the prompts travel once per engine per iteration (ray.put), not once per chunk
        p_ref, a_ref = ray.put(prompts), ray.put(answers)
        self._count("prompts_to_each_engine", (prompts, answers))
        while queue or running:
            busy = {e for e, _, _ in running.values()}
            for e in [e for e in self.alive if e not in busy]:
                if not queue:
                    break
                start, chunk = queue.popleft()
                ref = self.actors[e].evaluate.remote(chunk, float(sigma), p_ref, a_ref)
                self._count("members_out", (chunk, float(sigma)))
                running[ref] = (e, start, chunk)
            if not running:
                raise RuntimeError("no live engine to evaluate the population")
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                e, start, chunk = running.pop(ref)
                try:
                    rewards, ext = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as err:
                    queue.appendleft((start, chunk))
                    self._mark_dead(e, err)
                    continue
                self._count("rewards_in", rewards)
                if len(rewards) != len(chunk):
                    raise RuntimeError(f"engine {e} returned {len(rewards)} rewards for {len(chunk)} members")
                out[start : start + len(chunk)] = [float(r) for r in rewards]
                if ext is None:
                    extracted = None
                elif extracted is not None:
                    self._count("answers_in", ext)
                    extracted[start : start + len(chunk)] = ext
        self.member_answers = extracted
        return [float(r) for r in out]

    def evaluate_center(self, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
        return self._first("evaluate_center", list(prompts), list(answers))

    def _first(self, method: str, *args):
        while True:
            e = self.alive[0] if self.alive else None
            if e is None:
                raise RuntimeError("every engine of the pool died")
            try:
                return self._ray.get(getattr(self.actors[e], method).remote(*args))
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorDiedError) as err:
                self._mark_dead(e, err)

    def _broadcast(self, method: str, *args) -> dict[int, object]:
        ray = self._ray
        refs = {e: getattr(self.actors[e], method).remote(*args) for e in list(self.alive)}
        results = {}
        for e, ref in refs.items():
            try:
                results[e] = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as err:
                self._mark_dead(e, err)
        return results

    def _check(self, sums: dict[int, list[dict]], when: str) -> None:
        if not sums:
            raise RuntimeError("every engine of the pool died")
        self.checksums.append([sums[e] for e in sorted(sums)])
        from espert.vllm.engine.worker import EXACT_FIELDS

        def exact(cs):
            return [{k: r[k] for k in EXACT_FIELDS} for r in cs]

        ref_e = min(sums)
        for e, cs in sums.items():
            if exact(cs) != exact(sums[ref_e]):
                raise ReplicaDivergence(
                    f"{when}: engine {e} checksum {cs} != engine {ref_e} checksum {sums[ref_e]}; "
                    f"the replicas no longer hold the same weights"
                )

    def update(
        self,
        seeds: Sequence[int],
        coeffs: Sequence[float],
        decay: float = 1.0,
        lr: float | None = None,
        anchor: dict | None = None,
    ) -> None:
        seeds, coeffs = [int(s) for s in seeds], [float(c) for c in coeffs]
        msg = (seeds, coeffs, float(decay), None if lr is None else float(lr), None if anchor is None else dict(anchor))
        for _ in self.alive:
            self._count("update_out", msg)
        sums = self._broadcast("update", *msg)
        for cs in sums.values():
            self._count("checksums_in", cs)
        self._check(sums, "after update")

    def checksum(self) -> dict[int, list[dict]]:
        """Every live engine's per-rank checksums, after checking that they agree."""
        sums = self._broadcast("checksum")
        self._check(sums, "checksum")
        return sums

    def center_state(self) -> dict[str, torch.Tensor]:
        from espert.vllm.wire import unpack_tensor

        return {k: unpack_tensor(v) for k, v in self._first("center_state").items()}

    def center_stream(self):
        """The center streamed from a live engine in chunks of ``chunk_bytes`` (the replicas hold the same
        center, checked at every update): checkpoints and exports are written from it chunk by chunk.  An
        engine that dies mid-stream is marked dead and the same chunk is asked of the next one."""
        from espert.vllm.driver.stream import CenterStream

        return CenterStream(lambda method, *args: self._first("rpc", method, *args), self.chunk_bytes)

    def noise_energy(self) -> float | None:
        """As :meth:`espert.vllm.driver.evaluator.VLLMEvaluator.noise_energy` (one engine's layout, nothing pulled)."""
        return center_energy(self, self.sigma_scales)

    def export_state(self) -> dict[str, torch.Tensor]:
        from espert.vllm.driver.evaluator import without_optimizer_state

        return without_optimizer_state(self.center_state())

    def load_center(self, state: dict[str, torch.Tensor]) -> None:
        from espert.vllm.driver.evaluator import host_state
        from espert.vllm.wire import pack_tensor

        ref = self._ray.put({k: pack_tensor(host_state(v)) for k, v in state.items()})
        self._check(self._broadcast("load_center", ref), "after load_center")

    def timings(self) -> dict[int, dict]:
        return self._broadcast("timings")

    def close(self) -> None:
        ray = self._ray
        for e in list(self.alive):
            try:
                ray.get(self.actors[e].close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort
                pass
            ray.kill(self.actors[e])
        self.alive = []
        time.sleep(0)


# ---- the ES loop's evaluator registry (espert.evaluators: "vllm" -> this builder) ----------------------


def center_kwargs(cfg, model_path: str) -> dict:
    """The center's loop fields of ``cfg`` as :class:`VLLMEvaluator` / :class:`EnginePool` keywords
    (``noise``, ``optimizer``, ``no_decay``, ``anchor``, ``sigma_scales``), as
    :func:`espert.evaluators.torch_model.config_center` gives them to the torch evaluator's CenterStore.
    The rms scales are computed once, here, from the checkpoint's whole tensors, so every engine and TP
    rank gets the same."""
    from espert.evaluators.torch_model import optimizer_spec

    return dict(
        noise=cfg.noise,
        optimizer=optimizer_spec(cfg),
        no_decay=list(cfg.weight_decay_exclude) if cfg.weight_decay else [],
        anchor=cfg.anchor_decay > 0,
        sigma_scales=checkpoint_rms_scales(model_path, cfg.dtype, cfg.include, cfg.exclude)
        if cfg.sigma_mode == "rms"
        else None,
    )


def build_from_config(cfg, model_path: str, score, extract=None) -> Evaluator:
    """``evaluator: vllm``: one engine (``cfg.vllm_engines`` <= 1) or an :class:`EnginePool`; extract:
    the task's answer extractor (the evaluator then fills ``member_answers``).

    Reads optional config fields when present (``vllm_tensor_parallel_size``, ``vllm_engines``,
    ``vllm_gpu_memory_utilization``, ``vllm_max_model_len``, ``vllm_rename``, ``vllm_members``,
    ``vllm_max_loras``); defaults otherwise.
    The center's loop fields (``noise``, ``optimizer*``, ``sigma_mode``, ``weight_decay_exclude``) go to
    every worker's center as :func:`espert.evaluators.torch_model.config_center` gives them to the torch
    evaluator's.  A malformed ``vllm_rename`` is refused before any engine starts.
    """
    from espert.vllm.driver.evaluator import VLLMEvaluator, parse_rename

    rename = parse_rename(getattr(cfg, "vllm_rename", None))
    engines = int(getattr(cfg, "vllm_engines", 1) or 1)
    llm_kwargs = dict(dtype=cfg.dtype, tensor_parallel_size=int(getattr(cfg, "vllm_tensor_parallel_size", 1) or 1))
    for field, arg in (
        ("vllm_gpu_memory_utilization", "gpu_memory_utilization"),
        ("vllm_max_model_len", "max_model_len"),
    ):
        if getattr(cfg, field, None) is not None:
            llm_kwargs[arg] = getattr(cfg, field)
    ev_kwargs = dict(
        include=cfg.include,
        exclude=cfg.exclude,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        chat_template=cfg.chat_template,
        member_errors=cfg.member_errors,
        rename=rename,
        extract=extract,
        members=getattr(cfg, "vllm_members", "serial"),
        max_loras=int(getattr(cfg, "vllm_max_loras", 8) or 8),
        **center_kwargs(cfg, model_path),
    )
    if engines > 1:
        return EnginePool(model_path, score, engines=engines, llm_kwargs=llm_kwargs, **ev_kwargs)
    return VLLMEvaluator(model_path, score, llm_kwargs=llm_kwargs, **ev_kwargs)


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
    from espert.vllm.engine.params import checkpoint_files

    files = checkpoint_files(model)
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
