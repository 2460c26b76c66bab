"""A population over several engines: Ray actors, each owning one vLLM engine, that can die, hang, join
and leave while a run goes on.

    pool = EnginePool(model_path, task.score, engines=4, llm_kwargs=dict(tensor_parallel_size=1))
    rewards = pool.evaluate(members, sigma, prompts, answers)   # members spread over the engines
    pool.update(Update(seeds, coeffs, decay))                   # every engine applies it itself

Only members, σ, prompts, rewards, updates (seeds and coefficients) and checksums travel, never weights.
Every engine applies the same update to its own float32 host master through espert's CPU op, whose
arithmetic is fixed, so all replicas hold bit-identical centers; the checksums are compared every
iteration and any difference raises :class:`ReplicaDivergence` (a silent fork would train N models).
Members go out in chunks from a queue; a member's reward depends only on (center, member, σ, prompts),
so rewards are identical with 1 or N engines whatever happens to them: a dead engine's chunk is
re-queued and the engine replaced (:mod:`espert.vllm.driver.membership`), a late chunk is also given to
an idle engine and an engine past twice its deadline is hung (:mod:`espert.vllm.driver.chunks`), an
unreachable one is tried three times.  Faults, elastic size and multi-node use: docs/vllm.md, "A
population over engines".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import queue
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from espert.evaluators.base import Evaluator, Member, center_energy
from espert.tensorfile import CHUNK_BYTES
from espert.update import Update
from espert.vllm.driver.actor import EngineActor, VLLMEngine
from espert.vllm.driver.chunks import HANG, Clock, ReplicaDivergence, Round
from espert.vllm.driver.evaluator import host_state, without_optimizer_state
from espert.vllm.driver.joining import JoiningEngines, brief, numel
from espert.vllm.driver.membership import Join, UpdateLog
from espert.vllm.driver.stream import CenterStream
from espert.vllm.wire import exact_fields, pack_tensor, unpack_tensor

log = logging.getLogger("espert.vllm")

__all__ = ["EnginePool", "PoolOptions", "ReplicaDivergence"]

#: ActorUnavailableError calls in a row after which an engine is replaced.
UNREACHABLE_LIMIT = 3
CATCH_UP_MODES = ("auto", "replay", "stream")


@dataclass
class PoolOptions:
    """How an :class:`EnginePool` runs its engines (every field is also a keyword of ``EnginePool``).

    engines: engines at start.  chunk: members per task (default: about two chunks per engine).
    num_cpus_per_engine / num_gpus_per_engine: Ray resources per actor (GPU: the TP size).  env: extra
    environment for the actors.  ray_init: ``ray.init`` keywords when Ray is not initialised yet.  replace:
    start a new engine for each one lost.  catch_up: ``"auto"`` (cheaper estimate), ``"replay"`` or
    ``"stream"``.  deadline_floor / deadline_factor: a call's deadline is ``max(floor, factor × its median
    observed time)`` (seconds).  stream_bytes_per_s: the assumed engine-to-engine rate until one was measured.
    engines_file: holds the wanted number of engines, read before each iteration.  join_timeout: seconds to
    wait for a replacement when no engine is left.  count_traffic: record messages' pickled sizes in ``traffic``.
    """

    engines: int = 2
    chunk: int | None = None
    num_cpus_per_engine: float = 1
    num_gpus_per_engine: float = 0
    env: dict | None = None
    ray_init: dict | None = None
    replace: bool = True
    catch_up: str = "auto"
    deadline_floor: float = 60.0
    deadline_factor: float = 8.0
    stream_bytes_per_s: float = 1e9
    engines_file: str | None = None
    join_timeout: float = 3600.0
    count_traffic: bool = True

    def __post_init__(self):
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.catch_up not in CATCH_UP_MODES:
            raise ValueError(f"catch_up must be one of {CATCH_UP_MODES}, got {self.catch_up!r}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if not self.stream_bytes_per_s > 0:
            raise ValueError(f"stream_bytes_per_s must be > 0, got {self.stream_bytes_per_s}")


class Completions:
    """Calls in flight, reported in the order they finish: one callback per ObjectRef, O(1) per answer, where
    ``ray.wait`` over every call in flight costs O(calls) at each answer (measured: 0.08 ms for 1,000 refs,
    0.59 ms for 4,000; docs/vllm.md, driver scaling)."""

    def __init__(self):
        self._done: queue.SimpleQueue = queue.SimpleQueue()

    def watch(self, ref) -> None:
        ref.future().add_done_callback(lambda _, r=ref: self._done.put(r))

    def wait(self, timeout: float | None) -> list:
        """The refs finished since the last call, after waiting up to ``timeout`` seconds for the first."""
        try:
            out = [self._done.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not self._done.empty():
            out.append(self._done.get_nowait())
        return out


class EnginePool(JoiningEngines, Evaluator):
    """The Evaluator interface over engines in Ray actors (see the module docstring).

    model: model directory or Hub id.  score: the task's batched reward (picklable).  llm_kwargs: passed
    to :func:`espert.vllm.make_llm` in each actor.  :class:`PoolOptions`' keywords set how the pool runs;
    the others go to :class:`espert.vllm.VLLMEvaluator`.  :meth:`of` builds a pool over any engine.

    State a caller may read: ``alive``, ``joining``, ``dead`` (died, hung, unreachable) and ``removed``
    engine ids, ``nodes`` (id -> Ray node id), ``events`` (every membership change), ``traffic``
    (pickled bytes of the last iteration's messages, by kind), ``weights_bytes`` (one float32 center),
    ``log`` (the update log a new engine replays), ``last_round`` (chunks, duplicates, agreeing answers).
    """

    def __init__(self, model: str, score: Callable, *, llm_kwargs: dict | None = None, **kwargs):
        fields = set(PoolOptions.__dataclass_fields__)
        options = PoolOptions(**{k: v for k, v in kwargs.items() if k in fields})
        ev_kwargs = {k: v for k, v in kwargs.items() if k not in fields}
        self.sigma_scales = ev_kwargs.get("sigma_scales")  # as VLLMEvaluator.sigma_scales
        self._start(VLLMEngine(model, score, ev_kwargs, dict(llm_kwargs or {})), options)

    @classmethod
    def of(cls, make_engine: Callable, **options) -> "EnginePool":
        """A pool whose actors each hold ``make_engine()``: any picklable zero-argument callable returning an
        object with the engine methods (:mod:`espert.vllm.driver.actor`).  options: :class:`PoolOptions`."""
        pool = cls.__new__(cls)
        pool.sigma_scales = None
        pool._start(make_engine, PoolOptions(**options))
        return pool

    def _start(self, make_engine: Callable, options: PoolOptions) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(**{"include_dashboard": False, "log_to_driver": False, **(options.ray_init or {})})
        self._ray, self.options, self._make_engine = ray, options, make_engine
        self._unavailable_error = getattr(ray.exceptions, "ActorUnavailableError", ())
        # an engine is gone: its actor or process died (Ray's OOM killer too: OutOfMemoryError), or its node
        gone = ("RayActorError", "OutOfMemoryError", "WorkerCrashedError", "NodeDiedError")
        self._gone_errors = tuple(getattr(ray.exceptions, n) for n in gone if hasattr(ray.exceptions, n))
        self.chunk = options.chunk
        self.chunk_bytes = CHUNK_BYTES  # center_stream's chunk size (as VLLMEvaluator.chunk_bytes)
        self._actor_cls = ray.remote(num_cpus=options.num_cpus_per_engine, num_gpus=options.num_gpus_per_engine)(
            EngineActor
        )
        self.actors: list = []
        self.alive: list[int] = []
        self.dead: list[int] = []
        self.removed: list[int] = []
        self.joins: dict[int, Join] = {}
        self.nodes: dict[int, str] = {}
        self.events: list[dict] = []
        self.log = UpdateLog()
        self.clock = Clock(options.deadline_floor, options.deadline_factor)
        self.traffic: dict[str, int] = {}
        self.checksums: list[list[dict]] = []
        self.info = None
        self.last_round: dict = {}
        self._round: Round | None = None
        self._completions = Completions()
        self._unreachable: dict[int, int] = defaultdict(int)
        self._stream_rate = float(options.stream_bytes_per_s)
        self._bad_engines_file: str | None = None
        for _ in range(options.engines):
            self._spawn(initial=True)
        self.wait_for_engines()
        self.weights_bytes = 4 * numel(self.info)  # one float32 center

    @property
    def joining(self) -> list[int]:
        return sorted(self.joins)

    # -- engines in and out ------------------------------------------------------------------------
    def _engine_env(self, i: int) -> dict:
        """The environment of engine i's actor: an in-process vLLM engine, a small CPU KV cache, and on CPU
        one core and OpenMP thread per engine (more threads than cores stall espert's kernels)."""
        opts = self.options
        e = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        if opts.num_gpus_per_engine == 0:
            if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                e["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))
            # OpenMP reads this when its runtime loads, before any Python runs in the actor
            e["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(max(1, int(opts.num_cpus_per_engine))))
        e.update(opts.env or {})
        return e

    def _spawn(self, replaces: int | None = None, fault_at: float | None = None, attempts: int = 1, initial=False):
        """Ask Ray for a new engine actor (placed anywhere with room, spread over nodes); it joins later."""
        e = len(self.actors)
        env = self._engine_env(e)
        cls = self._actor_cls.options(runtime_env={"env_vars": env}, scheduling_strategy="SPREAD")
        actor = cls.remote(self._make_engine, env)
        self.actors.append(actor)
        self.joins[e] = Join(e, actor, actor.ready.remote(), time.monotonic(), replaces, fault_at, attempts, initial)
        self._completions.watch(self.joins[e].ref)
        return e

    def _event(self, kind: str, engine: int, **details) -> None:
        self.events.append({"event": kind, "engine": engine, "node": self.nodes.get(engine), **details})

    def _lose(self, e: int, why: str, err: BaseException | None = None) -> None:
        """Engine e is out (``why``: died, hung, unreachable): kill it, requeue its chunks, and start its
        replacement (or raise when none is left and replacement is off)."""
        if e not in self.alive:
            return
        self.alive.remove(e)
        self.dead.append(e)
        now = time.monotonic()
        self._event(why, e, time=now, error=None if err is None else type(err).__name__)
        cause = "no answer by its deadline" if err is None else brief(err)
        log.warning("engine %d %s (%s); its work is re-queued, %d engines left", e, why, cause, len(self.alive))
        self._ray.kill(self.actors[e], no_restart=True)
        if self._round is not None:
            self._round.drop_engine(e)
        if self.options.replace:
            self._spawn(replaces=e, fault_at=now)
        elif not self.alive and not self.joins:
            raise RuntimeError("every engine of the pool died") from err

    def _call_failed(self, e: int, err: BaseException) -> bool:
        """Handle a failed call to engine e: True when the engine may still be up (``ActorUnavailableError``;
        the third in a row replaces it), False when it is lost."""
        if isinstance(err, self._unavailable_error) and self._unreachable[e] + 1 < UNREACHABLE_LIMIT:
            self._unreachable[e] += 1
            self._event("unreachable_once", e, time=time.monotonic(), error=brief(err))
            log.warning("engine %d unreachable (%s); trying again", e, brief(err))
            return True
        self._lose(e, "unreachable" if isinstance(err, self._unavailable_error) else "died", err)
        return False

    def add_engines(self, k: int, wait: bool = False) -> list[int]:
        """Start k more engines; each takes members once it holds the pool's center (checked by checksum).
        Call between iterations; wait: return only when they joined."""
        if k < 1:
            raise ValueError(f"add_engines needs k >= 1, got {k}")
        new = [self._spawn() for _ in range(k)]
        for e in new:
            self._event("added", e, time=time.monotonic())
        if wait:
            self.wait_for_engines()
        return new

    def remove_engines(self, k: int) -> list[int]:
        """Stop k engines between iterations: those still joining first, then the newest in service."""
        total = len(self.alive) + len(self.joins)
        if not 1 <= k < total:
            raise ValueError(f"remove_engines needs 1 <= k < {total} (the engines in the pool), got {k}")
        out = (sorted(self.joins, reverse=True) + sorted(self.alive, reverse=True))[:k]
        for e in out:
            self._retire(e)
        return out

    def _retire(self, e: int) -> None:
        if self.joins.pop(e, None) is None:
            self.alive.remove(e)
            try:
                self._ray.get(self.actors[e].close.remote(), timeout=self.options.deadline_floor)
            except Exception:  # noqa: BLE001 - it is going anyway
                pass
        self.removed.append(e)
        self._ray.kill(self.actors[e], no_restart=True)
        self._event("removed", e, time=time.monotonic())

    def _apply_engines_file(self) -> None:
        """Grow or shrink the pool to the number in ``engines_file`` (a missing file changes nothing; a
        malformed one is reported once and ignored: a typo must not stop a run)."""
        path = self.options.engines_file
        if not path:
            return
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
        except FileNotFoundError:
            return
        want = int(text) if text.isdigit() else 0
        if want < 1:
            if text != self._bad_engines_file:
                log.warning("%s must hold a whole number of engines >= 1, got %r; the pool stays as it is", path, text)
            self._bad_engines_file = text
            return
        have = len(self.alive) + len(self.joins)
        if want > have:
            self.add_engines(want - have)
        elif want < have:
            self.remove_engines(have - want)

    # -- the Evaluator interface -------------------------------------------------------------------
    def _count(self, key: str, obj) -> None:
        if self.options.count_traffic:
            self.traffic[key] = self.traffic.get(key, 0) + len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def evaluate(
        self, members: Sequence[Member], sigma: float, prompts: Sequence[str], answers: Sequence[str]
    ) -> list[float]:
        self._poll_joins()  # admit the engines that caught up, and follow the engines file
        self._apply_engines_file()
        members = [(int(s), int(g)) for s, g in members]
        self.traffic = {}
        n_engines = max(1, len(self.alive))
        rnd = Round(members, self.chunk or max(1, math.ceil(len(members) / (2 * n_engines))))
        prompts, answers = list(prompts), list(answers)
        # the prompts travel once per engine per iteration (ray.put), not once per chunk
        args = (float(sigma), self._ray.put(prompts), self._ray.put(answers))
        self._count("prompts_to_each_engine", (prompts, answers))
        self._round = rnd
        try:
            while not rnd.done():
                self._dispatch(rnd, args)
                self._wait_round(rnd)
            self._settle(rnd)
        finally:
            self._round = None
        self.last_round = {"chunks": len(rnd.chunks), "duplicates": rnd.duplicates, "agreed": rnd.agreed}
        rewards, self.member_answers = rnd.results()
        return rewards

    def _chunk_deadline(self, rnd: Round) -> Callable[[int], float]:
        return lambda c: self.clock.deadline("member", rnd.size_of(c))

    def _dispatch(self, rnd: Round, args: tuple) -> None:
        """Give every idle engine in service a chunk: the queue's next, else a late chunk's duplicate."""
        now, busy = time.monotonic(), rnd.busy()
        for e in self.alive:
            if e in busy:
                continue
            c = rnd.take(now, self._chunk_deadline(rnd))
            if c is None:
                break
            chunk = rnd.chunks[c][1]
            ref = self.actors[e].evaluate.remote(chunk, *args)
            rnd.start(ref, e, c, now)
            self._completions.watch(ref)
            self._count("members_out", (chunk, args[0]))

    def _wait_round(self, rnd: Round) -> None:
        """Wait for an answer, a joining engine or the next deadline; then handle what came."""
        if not rnd.running:
            self._wait_for_a_join()
            return
        done = self._completions.wait(rnd.next_check(time.monotonic(), self._chunk_deadline(rnd)))
        joins = {j.ref: j for j in self.joins.values()} if done else {}
        for ref in done:  # refs of copies or calls the pool gave up on are ignored
            if ref in rnd.running:
                self._collect(rnd, ref)
            elif ref in joins and self.joins.get(joins[ref].engine) is joins[ref] and joins[ref].ref is ref:
                self._advance(joins[ref])
        limit = self._chunk_deadline(rnd)
        for copy in rnd.overdue(time.monotonic(), lambda c: HANG * limit(c)):
            self._lose(copy.engine, "hung")

    def _collect(self, rnd: Round, ref) -> None:
        """One chunk's answer: its rewards (the first answer wins, a later one must agree), or a lost engine."""
        copy = rnd.finish(ref)
        try:
            rewards, extracted = self._ray.get(ref)
        except self._gone_errors as err:
            rnd.requeue(copy.chunk)
            self._call_failed(copy.engine, err)
            return
        self._unreachable[copy.engine] = 0
        members = rnd.chunks[copy.chunk][1]
        if len(rewards) != len(members):
            raise RuntimeError(f"engine {copy.engine} returned {len(rewards)} rewards for {len(members)} members")
        self._count("rewards_in", rewards)
        if extracted is not None:
            self._count("answers_in", extracted)
        if rnd.answer(copy, rewards, extracted):
            self.clock.observe("member", time.monotonic() - copy.started, len(members))

    def _settle(self, rnd: Round) -> None:
        """Every member has its reward: wait for the copies still running (a straggler's, or a duplicate's)
        until their hang limit; each answer must agree with the first.  An engine still busy then is hung."""
        deadline = self._chunk_deadline(rnd)

        def limit(c: int) -> float:
            return HANG * deadline(c)

        while rnd.running:
            now = time.monotonic()
            for copy in rnd.overdue(now, limit):
                self._lose(copy.engine, "hung")
            if not rnd.running:
                break
            left = min(limit(k.chunk) - (now - k.started) for k in rnd.running.values())
            for ref in self._completions.wait(max(0.0, left)):
                if ref in rnd.running:
                    self._collect(rnd, ref)

    def evaluate_center(self, prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
        return self._first("evaluate_center", list(prompts), list(answers))

    # -- calls to every engine, or to one ----------------------------------------------------------
    def _gather(self, kind: str, refs: dict[int, object]) -> tuple[dict[int, object], list[int]]:
        """The answers of ``{engine: call}`` within the deadline of ``kind``: ``(answers, unsure)``, unsure
        being the engines that were unreachable (the call may or may not have run).  An engine that died or
        did not answer in time is lost."""
        t0, pending = time.monotonic(), {ref: e for e, ref in refs.items()}
        done, late = self._ray.wait(list(pending), num_returns=len(pending), timeout=self.clock.deadline(kind))
        out: dict[int, object] = {}
        unsure: list[int] = []
        for ref in done:
            e = pending[ref]
            try:
                out[e] = self._ray.get(ref)
                self._unreachable[e] = 0
            except self._gone_errors as err:
                if self._call_failed(e, err):
                    unsure.append(e)
        for ref in late:
            self._lose(pending[ref], "hung")
        if out:
            self.clock.observe(kind, time.monotonic() - t0)
        return out, unsure

    def _call(self, e: int, method: str, *args):
        """An idempotent call to engine e, again while it is unreachable; None when the engine is lost."""
        while e in self.alive:
            out, _ = self._gather(method, {e: getattr(self.actors[e], method).remote(*args)})
            if e in out:
                return out[e]
        return None

    def _broadcast(self, method: str, *args) -> dict[int, object]:
        """An idempotent call to every engine in service: ``{engine: answer}`` of those still in service."""
        out, unsure = self._gather(method, {e: getattr(self.actors[e], method).remote(*args) for e in self.alive})
        for e in unsure:
            got = self._call(e, method, *args)
            if got is not None:
                out[e] = got
        return out

    def _first(self, method: str, *args):
        """One engine's answer (the first in service that gives one)."""
        while True:
            if not self.alive:
                self._wait_for_a_join()
            got = self._call(self.alive[0], method, *args)
            if got is not None:
                return got

    # -- the center --------------------------------------------------------------------------------
    def _check(self, sums: dict[int, list[dict]], when: str) -> None:
        """Every answering engine must report the same exact checksum; it becomes the log's reference for
        the current position (what a joining engine must reproduce)."""
        if not sums:
            raise RuntimeError(f"{when}: no engine of the pool answered")
        self.checksums.append([sums[e] for e in sorted(sums)])
        ref_e = min(sums)
        want = exact_fields(sums[ref_e])
        for e, cs in sums.items():
            if exact_fields(cs) != want:
                raise ReplicaDivergence(
                    f"{when}: engine {e} checksum {cs} != engine {ref_e} checksum {sums[ref_e]}; "
                    f"the replicas no longer hold the same weights"
                )
        self.log.remember(self.log.position, want)

    def update(self, step: Update) -> None:
        for _ in self.alive:
            self._count("update_out", step)
        before = self.log.reference(self.log.position)
        self.log.append(step)
        shared = self._ray.put(step)  # serialized once, into the object store; each node fetches it once
        sums, unsure = self._gather("update", {e: self.actors[e].update.remote(shared) for e in self.alive})
        for e in unsure:
            self._settle_update(e, shared, before, sums)
        for cs in sums.values():
            self._count("checksums_in", cs)
        if not sums and not self.alive:  # every engine was lost: a replacement replays this update too
            self._wait_for_a_join()
            sums = self._broadcast("checksum")
        self._check(sums, "after update")
        self._poll_joins()

    def _settle_update(self, e: int, step, before: list[dict] | None, sums: dict) -> None:
        """An update whose call failed in flight (``ActorUnavailableError``): ask the engine's checksum; still
        the one before the update means it never ran, so send it again; anything else is what the update
        made (``_check`` then compares it with the other engines')."""
        while e in self.alive:
            cs = self._call(e, "checksum")
            if cs is None or exact_fields(cs) != before:
                if cs is not None:
                    sums[e] = cs
                    self._event("update_settled", e, time=time.monotonic(), how="it had run")
                return
            self._event("update_settled", e, time=time.monotonic(), how="it had not run: sent again")
            out, _ = self._gather("update", {e: self.actors[e].update.remote(step)})
            if e in out:
                sums[e] = out[e]
                return

    def checksum(self) -> dict[int, list[dict]]:
        """Every live engine's per-rank checksums, after checking that they agree."""
        sums = self._broadcast("checksum")
        self._check(sums, "checksum")
        return sums

    def center_state(self) -> dict[str, torch.Tensor]:
        return {k: unpack_tensor(v) for k, v in self._first("center_state").items()}

    def center_stream(self):
        """The center streamed from a live engine in chunks of ``chunk_bytes`` (the replicas hold the same
        center, checked at every update): checkpoints and exports are written from it chunk by chunk.  An
        engine lost mid-stream is replaced and the same chunk is asked of the next one."""
        return CenterStream(lambda method, *args: self._first("rpc", method, *args), self.chunk_bytes)

    def noise_energy(self) -> float | None:
        """As :meth:`espert.vllm.driver.evaluator.VLLMEvaluator.noise_energy` (one engine's layout, nothing pulled)."""
        return center_energy(self, self.sigma_scales)

    def export_state(self) -> dict[str, torch.Tensor]:
        return without_optimizer_state(self.center_state())

    def load_center(self, state: dict[str, torch.Tensor]) -> None:
        """Every engine loads ``state`` (one Ray object, sent once per node); it becomes the base a new
        engine starts from (the update log restarts there)."""
        ref = self._ray.put({k: pack_tensor(host_state(v)) for k, v in state.items()})
        self.log.rebase(ref)
        self._check(self._broadcast("load_center", ref), "after load_center")

    def base_moved(self, path: str) -> None:
        """Replacement engines load the base model from ``path`` from now on (a new run's directory was renamed
        into place after the first engines loaded it)."""
        if isinstance(self._make_engine, VLLMEngine):
            self._make_engine = dataclasses.replace(self._make_engine, model=path)

    def timings(self) -> dict[int, dict]:
        return self._broadcast("timings")

    def close(self) -> None:
        """Close every engine (at most the deadline floor for all of them), then kill their actors."""
        ray = self._ray
        closing = [self.actors[e].close.remote() for e in self.alive]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=self.options.deadline_floor)
        for e in list(self.alive) + list(self.joins):
            ray.kill(self.actors[e], no_restart=True)
        self.alive, self.joins = [], {}
