"""How a new engine joins a running :class:`~espert.vllm.driver.pool.EnginePool`: the log of updates it
replays, the checksums it must reproduce, and the choice between replaying and streaming.

A center is a pure function of its base (the model's weights, or the center the last ``load_center`` sent)
and the updates since.  So a new engine reaches the live engines' center by **replay** (load the base and
apply the logged updates in order, at most :data:`REPLAY_BATCH_SEEDS` seeds per message) or by **stream**
(load a snapshot of a live engine's center, sent engine to engine as one Ray object), whichever
:func:`choose_route` estimates cheaper; either way its checksum must equal the one every live engine
reported at the same point of the log before it takes a member.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from espert.update import Update

#: Most seeds one catch-up message carries (16 bytes each): bounds a replay message to ~16 MiB.
REPLAY_BATCH_SEEDS = 1 << 20
#: Times a replacement that fails to start or to catch up is tried again before the pool gives up on it.
JOIN_ATTEMPTS = 3

#: A point of the log: (epoch, updates applied since the epoch's base).  A load_center starts an epoch.
Position = tuple[int, int]


class UpdateLog:
    """Every update since the center's base (:class:`~espert.update.Update`, 16 bytes per seed) and the live
    engines' exact checksums at each point (what a new engine must reproduce).  ``base``: None (the model's
    own weights) or the Ray reference of the packed center the last ``load_center`` sent (a resume)."""

    def __init__(self):
        self.epoch = 0
        self.base: Any = None
        self.updates: list[Update] = []
        self._references: dict[Position, list[dict]] = {}

    @property
    def position(self) -> Position:
        return (self.epoch, len(self.updates))

    def append(self, step: Update) -> None:
        """One update as the engines applied it."""
        self.updates.append(step)

    def rebase(self, base) -> None:
        """A new base (a loaded center): a new epoch with no updates."""
        self.epoch, self.base, self.updates = self.epoch + 1, base, []

    def batch(self, start: int) -> list:
        """The updates from index ``start`` on, at most :data:`REPLAY_BATCH_SEEDS` seeds (at least one update)."""
        out, seeds = [], 0
        for u in self.updates[start:]:
            if out and seeds + len(u.seeds) > REPLAY_BATCH_SEEDS:
                break
            out.append(u)
            seeds += len(u.seeds)
        return out

    def nbytes(self) -> int:
        """Bytes of the seeds and coefficients held (the seed log since the base)."""
        return sum(u.seeds.nbytes + u.coeffs.nbytes for u in self.updates)

    def remember(self, position: Position, exact: list[dict]) -> None:
        self._references[position] = exact

    def reference(self, position: Position) -> list[dict] | None:
        """The live engines' exact checksum at ``position`` (None: never checked there)."""
        return self._references.get(position)


def choose_route(
    mode: str,
    updates: int,
    seconds_per_update: float | None,
    center_bytes: int,
    bytes_per_second: float,
    has_base: bool,
    has_peer: bool,
) -> tuple[str, dict]:
    """``("replay" | "stream", estimate)`` for a new engine; mode: ``"auto"`` (the cheaper estimate), ``"replay"``
    or ``"stream"``.  Replay costs loading the base (a center transfer, only when ``has_base``) plus ``updates`` ×
    the observed seconds per update; streaming one center transfer at ``bytes_per_second``.  Without a live
    engine (``has_peer`` False) only replay is possible."""
    transfer = center_bytes / bytes_per_second
    replay = (transfer if has_base else 0.0) + updates * (seconds_per_update or 0.0)
    estimate = {"replay_s": replay, "stream_s": transfer, "updates": updates}
    if mode == "replay" or not has_peer:
        return "replay", estimate
    if mode == "stream":
        return "stream", estimate
    return ("replay" if replay <= transfer else "stream"), estimate


@dataclass
class Join:
    """An engine on its way into the pool: starting (``ready`` in flight), then catching up (``catch_up`` in
    flight) to ``at``; admitted when its checksum there equals the live engines'.  replaces: the engine it
    replaces (None: added); fault_at: when that one was lost (time.monotonic); initial: one the pool was built
    with (a failure to start is then an error, not something to retry)."""

    engine: int
    actor: Any
    ref: Any
    asked: float
    replaces: int | None = None
    fault_at: float | None = None
    attempts: int = 1
    initial: bool = False
    phase: str = "starting"
    at: Position | None = None
    route: str | None = None
    estimate: dict = field(default_factory=dict)
    ready_at: float | None = None
    unreachable: int = 0
