"""How a new engine joins a running :class:`~espert.vllm.driver.pool.EnginePool`, the pool's side: start it, catch
it up (replay or stream, :func:`~espert.vllm.driver.membership.choose_route`), check its checksum against the live
engines' at the same point of the log, then admit, refuse or replace it.  :class:`JoiningEngines` is a part of
EnginePool (its attributes are the pool's: ``joins``, ``log``, ``actors``, ``alive``, ...); what a join is and what it
replays lives in :mod:`espert.vllm.driver.membership`.
"""

from __future__ import annotations

import logging
import time

from espert.vllm.driver.chunks import ReplicaDivergence
from espert.vllm.driver.membership import JOIN_ATTEMPTS, Join, choose_route
from espert.vllm.wire import exact_fields

log = logging.getLogger("espert.vllm")

#: Times a starting engine's ``ready`` (which changes nothing) is asked again after an ActorUnavailableError.
READY_RETRIES = 10


def brief(err: BaseException) -> str:
    """An error in one line: its type, first line and (for a traceback Ray wraps) its last line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(err).__name__}: {text}"[:400]


def numel(info) -> int:
    """Parameters an engine holds, from its ``es_setup`` info (one row per TP rank)."""
    return sum(r["numel"] for r in info)


class JoiningEngines:
    """EnginePool's join machinery (module docstring)."""

    def wait_for_engines(self, timeout: float | None = None) -> None:
        """Block until every engine starting or catching up has joined (or failed); at most ``timeout``
        seconds (default: the pool's join_timeout)."""
        end = time.monotonic() + (self.options.join_timeout if timeout is None else timeout)
        while self.joins:
            if not self._poll_joins(end - time.monotonic()):
                raise TimeoutError(f"engines {self.joining} did not join in time")

    def _poll_joins(self, timeout: float = 0.0) -> bool:
        """Advance every joining engine whose call answered, waiting up to ``timeout`` seconds for one;
        False when nothing answered in time."""
        refs = {j.ref: j for j in self.joins.values()}
        if not refs:
            return True
        done, _ = self._ray.wait(list(refs), num_returns=1, timeout=max(0.0, timeout))
        if done:
            done, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in done:
            self._advance(refs[ref])
        return bool(done)

    def _wait_for_a_join(self) -> None:
        """No engine in service: wait for one to join (a replacement catching up by replay)."""
        end = time.monotonic() + self.options.join_timeout
        while not self.alive:
            if not self.joins:
                raise RuntimeError("every engine of the pool died, and no replacement could join")
            if not self._poll_joins(end - time.monotonic()):
                raise RuntimeError(
                    f"every engine of the pool died; no replacement joined in {self.options.join_timeout} s"
                )

    def _advance(self, j: Join) -> None:
        """One answered call of a joining engine: its start, or a catch-up to be checked."""
        try:
            result = self._ray.get(j.ref)
        except Exception as err:  # noqa: BLE001 - an actor that cannot start or catch up, for any reason
            if j.phase == "starting" and isinstance(err, self._unavailable_error) and j.unreachable < READY_RETRIES:
                j.unreachable += 1  # ``ready`` changes nothing: ask again
                self._event("unreachable_once", j.engine, time=time.monotonic(), error=brief(err))
                j.ref = j.actor.ready.remote()
                self._completions.watch(j.ref)
            else:  # a catch-up may or may not have run: start over with a new engine
                self._join_failed(j, err)
            return
        if j.phase == "starting":
            self._started(j, result)
        else:
            self._caught_up(j, result)

    def _started(self, j: Join, ready: dict) -> None:
        j.phase, j.ready_at = "catching_up", time.monotonic()
        self.nodes[j.engine] = ready["node"]
        self.info = self.info or ready["info"]
        if numel(ready["info"]) != numel(self.info):
            self._refuse(j, f"it holds {numel(ready['info'])} parameters, the pool {numel(self.info)}")
            return
        if self.log.reference((0, 0)) is None:  # the first engine up: the base every other must hold
            self.log.remember((0, 0), exact_fields(ready["checksum"]))
        if self.log.position == (0, 0):  # nothing to catch up on
            j.at = (0, 0)
            self._caught_up(j, ready["checksum"])
        else:
            self._send_catch_up(j)

    def _send_catch_up(self, j: Join) -> None:
        """The next catch-up call of a joining engine: a route chosen at the start of each epoch, then the
        updates logged since the point it reached."""
        pos = self.log.position
        if j.at is not None and j.at[0] == pos[0]:
            state, start = None, j.at[1]
        else:
            n = self.log.position[1]
            per_update = self.clock.typical("replay") or self.clock.typical("update")
            j.route, j.estimate = choose_route(
                self.options.catch_up, n, per_update, self.weights_bytes, self._stream_rate,
                self.log.base is not None, bool(self.alive),
            )  # fmt: skip
            if j.route == "stream":  # a snapshot taken after every update sent so far (actor call order)
                j.ref, j.at = j.actor.catch_up.remote(self.actors[self.alive[0]].center_state.remote(), []), pos
                self._completions.watch(j.ref)
                return
            state, start = self.log.base, 0
        batch = self.log.batch(start)
        j.ref, j.at = j.actor.catch_up.remote(state, batch), (pos[0], start + len(batch))
        self._completions.watch(j.ref)

    def _caught_up(self, j: Join, checksum: list[dict]) -> None:
        want = self.log.reference(j.at)
        if want is not None and exact_fields(checksum) != want:
            self._refuse(j, f"its checksum {checksum} != the live engines' {want} at update {j.at[1]}")
        elif j.at != self.log.position:
            self._send_catch_up(j)  # the pool moved on (or loaded a center) while it caught up
        else:
            if want is None:  # every engine was lost before reporting this point: the replay defines it
                self.log.remember(j.at, exact_fields(checksum))
            self._admit(j)

    def _admit(self, j: Join) -> None:
        now = time.monotonic()
        del self.joins[j.engine]
        self.alive.append(j.engine)
        self._unreachable[j.engine] = 0
        catch_up = now - (j.ready_at or now)
        if j.route == "stream" and catch_up > 0:
            self._stream_rate = self.weights_bytes / catch_up
        elif j.route == "replay" and j.at[1]:
            self.clock.observe("replay", catch_up, j.at[1])
        details = dict(route=j.route, estimate=j.estimate, start_s=(j.ready_at or now) - j.asked, catch_up_s=catch_up)
        if j.fault_at is not None:
            details.update(replaces=j.replaces, recovery_s=now - j.fault_at)
        self._event("joined", j.engine, time=now, **details)
        if not j.initial:
            log.warning("engine %d joined (%s) on node %s", j.engine, j.route or "at the base", self.nodes[j.engine])

    def _refuse(self, j: Join, why: str) -> None:
        """A new engine that cannot hold the pool's center is stopped and not replaced (the same environment
        would fail again); the run goes on with the engines it has."""
        self._drop(j, "refused", why=why)
        log.error("engine %d refused: %s", j.engine, why)
        if j.initial:
            raise ReplicaDivergence(f"engine {j.engine} does not start from the same center: {why}")

    def _drop(self, j: Join, event: str, **details) -> None:
        del self.joins[j.engine]
        self.dead.append(j.engine)
        self._ray.kill(j.actor, no_restart=True)
        self._event(event, j.engine, time=time.monotonic(), **details)

    def _join_failed(self, j: Join, err: BaseException) -> None:
        self._drop(j, "join_failed", error=brief(err))
        if j.initial:
            raise RuntimeError(f"engine {j.engine} failed to start: {err}") from err
        if j.attempts < JOIN_ATTEMPTS:
            log.warning("engine %d failed to join (%s); starting another", j.engine, brief(err))
            self._spawn(j.replaces, j.fault_at, j.attempts + 1)
        else:
            log.error(
                "engine %d failed to join %d times (%s); the pool goes on without it", j.engine, j.attempts, brief(err)
            )
