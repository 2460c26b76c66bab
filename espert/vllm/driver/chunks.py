"""The schedule of one :meth:`EnginePool.evaluate <espert.vllm.driver.pool.EnginePool.evaluate>`: the
population in chunks, the copies of each chunk in flight, and the deadlines derived from observed times.

A call of kind ``k`` over ``u`` units (a chunk's members; 1 for other calls) has the deadline
``max(floor, factor × m × u)``, m the median seconds per unit of the last :data:`WINDOW` calls of that kind
(``UNOBSERVED × floor`` before the first).  A chunk unanswered at its deadline is also given to an idle
engine; the first answer wins and every later one must agree bit for bit (else :class:`ReplicaDivergence`).
A copy running past ``HANG ×`` its deadline is hung.  Nothing here talks to Ray; :mod:`~espert.vllm.driver.pool` does.
"""

from __future__ import annotations

import math
import statistics
import struct
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

#: Observations per kind of call that the median looks at (the most recent ones).
WINDOW = 256
#: Deadline before anything of a kind was observed, in floors.
UNOBSERVED = 10
#: A copy running this many deadlines is hung.
HANG = 2.0


class ReplicaDivergence(RuntimeError):
    """Engines that applied the same updates hold different weights, or scored the same members differently."""


class Clock:
    """Observed seconds per unit of each kind of call, and the deadlines derived from them.

    floor: the smallest deadline (seconds).  factor: how many typical durations a call may take."""

    def __init__(self, floor: float, factor: float):
        if not floor > 0 or not factor >= 1:
            raise ValueError(f"deadline floor must be > 0 and factor >= 1, got {floor} and {factor}")
        self.floor, self.factor = float(floor), float(factor)
        self._seen: dict[str, deque] = defaultdict(lambda: deque(maxlen=WINDOW))

    def observe(self, kind: str, seconds: float, units: int = 1) -> None:
        """One call of ``kind`` over ``units`` took ``seconds``."""
        self._seen[kind].append(seconds / max(1, units))

    def typical(self, kind: str) -> float | None:
        """Median seconds per unit of ``kind`` over the window, None before the first observation."""
        seen = self._seen.get(kind)
        return statistics.median(seen) if seen else None

    def deadline(self, kind: str, units: int = 1) -> float:
        """Seconds a call of ``kind`` over ``units`` may take before the pool acts."""
        m = self.typical(kind)
        if m is None:
            return UNOBSERVED * self.floor
        return max(self.floor, self.factor * m * units)


@dataclass
class Copy:
    """One chunk running on one engine since ``started`` (time.monotonic)."""

    engine: int
    chunk: int
    started: float


def same_answer(a: tuple, b: tuple) -> bool:
    """Whether two answers ``(rewards, extracted)`` for one chunk are identical: rewards bit for bit (a NaN
    of a failed member included), extracted answers equal."""
    (ra, ea), (rb, eb) = a, b
    bits = [struct.pack("<d", float(x)) for x in ra] == [struct.pack("<d", float(x)) for x in rb]
    return bits and len(ra) == len(rb) and ea == eb


class Round:
    """A population cut into chunks of ``size`` members: the queue of chunks never started, the copies
    running (keyed by the caller's ObjectRef), the first answer of each chunk.

    members: ``[(seed, sign)]``.  ``duplicates`` counts chunks given to a second engine at their
    deadline; ``agreed`` counts later answers found identical to the first."""

    def __init__(self, members: Sequence[tuple[int, int]], size: int):
        self.n = len(members)
        self.chunks = [(s, list(members[s : s + size])) for s in range(0, self.n, size)]
        self.queue = deque(range(len(self.chunks)))
        self.answers: dict[int, tuple] = {}
        self.running: dict = {}
        self.duplicates = self.agreed = 0

    def done(self) -> bool:
        return len(self.answers) == len(self.chunks)

    def busy(self) -> set[int]:
        """Engines running a copy."""
        return {c.engine for c in self.running.values()}

    def size_of(self, chunk: int) -> int:
        return len(self.chunks[chunk][1])

    def take(self, now: float, deadline_of: Callable[[int], float]) -> int | None:
        """The next chunk for an idle engine: the queue's first unanswered one, else (a duplicate) an
        unanswered chunk none of whose running copies is within its deadline; None when there is none."""
        while self.queue:
            c = self.queue.popleft()
            if c not in self.answers:
                return c
        copies = defaultdict(list)
        for k in self.running.values():
            copies[k.chunk].append(k)
        for c, ks in copies.items():
            if c not in self.answers and all(now - k.started > deadline_of(c) for k in ks):
                self.duplicates += 1
                return c
        return None

    def start(self, ref, engine: int, chunk: int, now: float) -> None:
        self.running[ref] = Copy(engine, chunk, now)

    def finish(self, ref) -> Copy:
        return self.running.pop(ref)

    def requeue(self, chunk: int) -> None:
        """Put a chunk whose copy was lost back at the front, unless it is answered or still running elsewhere."""
        if chunk not in self.answers and all(k.chunk != chunk for k in self.running.values()):
            self.queue.appendleft(chunk)

    def drop_engine(self, engine: int) -> None:
        """Forget the copies of a lost engine and requeue their chunks."""
        for ref in [r for r, k in self.running.items() if k.engine == engine]:
            self.requeue(self.running.pop(ref).chunk)

    def answer(self, copy: Copy, rewards: list, extracted: list | None) -> bool:
        """Record an answer; True when it is the chunk's first.  A later one must be identical to the first."""
        got = ([float(r) for r in rewards], extracted)
        first = self.answers.get(copy.chunk)
        if first is None:
            self.answers[copy.chunk] = got
            return True
        if not same_answer(first, got):
            start, members = self.chunks[copy.chunk]
            raise ReplicaDivergence(
                f"engine {copy.engine} scored members {start}..{start + len(members) - 1} differently from the "
                f"engine that answered first: {got[0]} != {first[0]}"
            )
        self.agreed += 1
        return False

    def overdue(self, now: float, limit_of: Callable[[int], float]) -> list[Copy]:
        """The running copies older than ``limit_of(chunk)`` seconds."""
        return [k for k in self.running.values() if now - k.started > limit_of(k.chunk)]

    def next_check(self, now: float, deadline_of: Callable[[int], float]) -> float | None:
        """Seconds until the next running copy reaches its deadline or its hang limit (None: nothing runs)."""
        times = []
        for k in self.running.values():
            d = deadline_of(k.chunk)
            times += [t - (now - k.started) for t in (d, HANG * d)]
        ahead = [t for t in times if t > 0]
        return min(ahead) if ahead else (0.0 if times else None)

    def results(self) -> tuple[list[float], list | None]:
        """Every member's reward in member order, and their extracted answers (None when any chunk had none)."""
        rewards: list[float] = [0.0] * self.n
        extracted: list | None = [None] * self.n
        for c, (rs, ext) in self.answers.items():
            start = self.chunks[c][0]
            rewards[start : start + len(rs)] = rs
            if ext is None:
                extracted = None
            elif extracted is not None:
                extracted[start : start + len(ext)] = ext
        return rewards, extracted


def lora_chunks(members: Sequence, slots: int) -> list[list]:
    """Batched members: ``members`` in consecutive chunks spread evenly over the fewest generate calls of at most
    ``slots`` each (the engine's LoRA slots)."""
    size = math.ceil(len(members) / math.ceil(len(members) / slots)) if members else 1
    return [list(members[i : i + size]) for i in range(0, len(members), size)]
