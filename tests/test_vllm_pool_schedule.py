"""The EnginePool's schedule, without Ray or vLLM: deadlines from observed times, a late chunk given to a
second engine, late answers checked, the choice between replay and stream, the update log's batches.
Runtime: < 1 s."""

import math

import numpy as np
import pytest

from espert.update import AnchorStep, Update
from espert.vllm.driver.chunks import HANG, UNOBSERVED, Clock, ReplicaDivergence, Round
from espert.vllm.driver.membership import REPLAY_BATCH_SEEDS, UpdateLog, choose_route


def test_deadline_is_a_floor_before_observations_then_follows_the_median():
    c = Clock(floor=2.0, factor=8.0)
    assert c.deadline("member", 5) == UNOBSERVED * 2.0
    for s in (1.0, 1.0, 9.0):  # seconds for chunks of 4 members: 0.25 s per member typical
        c.observe("member", s, 4)
    assert c.typical("member") == 0.25
    assert c.deadline("member", 4) == 8.0  # 8 × 0.25 × 4
    assert c.deadline("member", 1) == 2.0  # the floor
    assert c.deadline("update") == UNOBSERVED * 2.0  # per kind
    with pytest.raises(ValueError, match="floor"):
        Clock(0, 8)


def members(n):
    return [(k // 2, 1 - 2 * (k % 2)) for k in range(n)]


def test_a_late_chunk_goes_to_an_idle_engine_and_the_first_answer_wins():
    r = Round(members(6), 2)
    deadline = lambda c: 10.0  # noqa: E731
    assert [r.take(0.0, deadline) for _ in range(3)] == [0, 1, 2]
    for e, c in enumerate((0, 1, 2)):
        r.start(f"ref{e}", e, c, 0.0)
    assert r.take(5.0, deadline) is None  # nothing late yet, nothing queued
    assert r.answer(r.finish("ref1"), [1.0, 2.0], None)
    assert r.answer(r.finish("ref2"), [3.0, 4.0], None)
    assert r.take(11.0, deadline) == 0 and r.duplicates == 1  # chunk 0 is past its deadline
    r.start("dup", 1, 0, 11.0)
    assert r.take(12.0, deadline) is None  # its duplicate is within its deadline
    assert r.answer(r.finish("dup"), [5.0, math.nan], None)  # first answer wins
    assert r.done()
    assert not r.answer(r.finish("ref0"), [5.0, math.nan], None) and r.agreed == 1  # the late one agrees
    rewards, extracted = r.results()
    assert rewards[0] == 5.0 and math.isnan(rewards[1]) and rewards[2:] == [1.0, 2.0, 3.0, 4.0] and extracted is None


def test_a_late_answer_that_differs_stops_loudly():
    r = Round(members(2), 2)
    r.start("a", 0, r.take(0, lambda c: 1), 0.0)
    r.start("b", 1, 0, 2.0)
    r.answer(r.finish("a"), [1.0, 0.5], [["x"], ["y"]])
    with pytest.raises(ReplicaDivergence, match="engine 1 scored members 0..1 differently"):
        r.answer(r.finish("b"), [1.0, 0.5], [["x"], ["z"]])


def test_lost_copies_are_requeued_once_and_overdue_copies_are_found():
    r = Round(members(4), 2)
    for e in range(2):
        r.start(e, e, r.take(0.0, lambda c: 1.0), 0.0)
    r.start("dup", 2, 0, 1.5)  # a duplicate of chunk 0 on engine 2
    r.drop_engine(0)  # chunk 0 still runs on engine 2: not requeued
    assert list(r.queue) == []
    r.drop_engine(2)
    assert list(r.queue) == [0]
    assert [k.engine for k in r.overdue(5.0, lambda c: 2.0)] == [1]
    assert r.next_check(1.0, lambda c: 2.0) == pytest.approx(1.0)  # engine 1 reaches its deadline at 2.0
    assert r.next_check(3.0, lambda c: 2.0) == pytest.approx(HANG * 2.0 - 3.0)


def test_route_is_the_cheaper_estimate():
    # 1 GB center at 1 GB/s: 1 s to stream; 100 updates at 5 ms replay in 0.5 s
    route, est = choose_route("auto", 100, 0.005, 10**9, 1e9, has_base=False, has_peer=True)
    assert route == "replay" and est == {"replay_s": 0.5, "stream_s": 1.0, "updates": 100}
    assert choose_route("auto", 1000, 0.005, 10**9, 1e9, False, True)[0] == "stream"
    assert choose_route("auto", 0, 0.005, 10**9, 1e9, True, True)[0] == "replay"  # base + 0 updates == stream
    assert choose_route("auto", 1, 0.005, 10**9, 1e9, True, True)[0] == "stream"  # a loaded base costs a transfer
    assert choose_route("stream", 1000, 0.005, 10**9, 1e9, False, False)[0] == "replay"  # no live engine to copy
    assert choose_route("stream", 0, None, 1, 1e9, False, True)[0] == "stream"


def test_update_log_keeps_16_bytes_per_seed_and_batches_replays():
    log = UpdateLog()
    assert log.position == (0, 0)
    big = REPLAY_BATCH_SEEDS // 2 + 1
    for k in range(3):
        log.append(Update(range(k, k + big), [0.5] * big, 1.0, None))
    assert log.nbytes() == 3 * big * 16
    assert [len(log.batch(s)) for s in (0, 1, 2)] == [1, 1, 1]  # two would exceed the batch
    assert log.batch(0)[0].seeds.dtype == np.uint64 and log.batch(0)[0].coeffs.dtype == np.float64
    log.append(Update([2**64 - 1], [1e-300], 0.5, 0.1, {"norm": "l2", "amount": 0.01}))  # an AWD step rides along
    step = log.batch(3)[0]
    assert (
        step.seeds.tolist() == [2**64 - 1] and step.coeffs.tolist() == [1e-300] and (step.decay, step.lr) == (0.5, 0.1)
    )
    assert step.anchor == AnchorStep("l2", 0.01) and log.batch(0)[0].anchor is None
    log.remember(log.position, [{"hash": "h"}])
    log.rebase("state")
    assert log.position == (1, 0) and log.base == "state" and log.reference((0, 4)) == [{"hash": "h"}]
