"""The EnginePool's membership and fault handling with light engines in real Ray actors (no vLLM): the
stand-in engine of bench/pool_scaling.py, whose center is a hash chain of the updates (replicas agree bit
for bit, and any missed or doubled update shows in the checksum).

- Ray's own RPC fault injection (``RAY_testing_rpc_failure``: at least one lost request, one lost response
  and one failure in flight) in a driver's calls to its engines: 10 iterations give the same rewards and
  center as without faults;
- a straggler's chunk goes to a second engine at its deadline, and its late answer is checked: equal
  passes, different raises ReplicaDivergence;
- a new engine that does not reproduce the live engines' center is refused (killed, not replaced);
- the engines file grows and shrinks the pool between iterations; a malformed one changes nothing;
- with its only engine gone, the pool waits for the replacement, which replays the update log.
Runtime: 1 min 28 s at load 14-18 on 2 cores, of which 28 s for the fault-injection run (a subprocess);
light actors start in ~1 s here, ~5 s at load 30.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))

import ray_cluster  # noqa: E402

from espert.update import Update  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("pool_scaling", os.path.join(ROOT, "bench", "pool_scaling.py"))
pool_scaling = sys.modules["pool_scaling"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pool_scaling)
HashEngine = pool_scaling.HashEngine


class Flagged:
    """A HashEngine factory; ``what`` happens to an engine when the file ``flag`` exists:
    ``"drift"``: it starts from another center; ``"slow"``: its next chunk takes ``seconds`` (the flag is
    removed); ``"lie"``: the same, and that chunk's rewards are off by 1."""

    def __init__(self, flag: str, what: str, seconds: float = 0.0):
        self.flag, self.what, self.seconds = flag, what, seconds

    def __call__(self):
        engine = HashEngine()
        if self.what == "drift":
            if os.path.exists(self.flag):
                engine.update(Update([1], [1.0]))
            return engine
        return SlowEngine(engine, self)


class SlowEngine:
    def __init__(self, engine, how: Flagged):
        self.engine, self.how = engine, how

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def evaluate(self, members, sigma, prompts, answers):
        rewards = self.engine.evaluate(members, sigma, prompts, answers)
        try:
            os.remove(self.how.flag)
        except FileNotFoundError:
            return rewards
        time.sleep(self.how.seconds)
        return [r + 1.0 for r in rewards] if self.how.what == "lie" else rewards


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    c = ray_cluster.start_cluster(workers=0, cpus=4)
    ray.init(address=c.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(pool_scaling)
    yield c
    ray.shutdown()
    c.shutdown()


def pool_of(make, engines=2, **kw):
    from espert.vllm.driver.pool import EnginePool

    return EnginePool.of(make, engines=engines, num_cpus_per_engine=1, join_timeout=120, **kw)


def iterate(pool, reference, t, population=16):
    """One ES iteration on the pool and on an in-process HashEngine; rewards must be equal."""
    members = [(1000 * t + k, g) for k in range(population // 2) for g in (1, -1)]
    got = pool.evaluate(members, 0.01, ["p"] * 3, ["a"] * 3)
    assert got == reference.evaluate(members, 0.01, None, None)
    seeds, coeffs = [s for s, _ in members[::2]], [got[2 * k] - got[2 * k + 1] for k in range(population // 2)]
    pool.update(Update(seeds, coeffs, 0.99))
    reference.update(Update(seeds, coeffs, 0.99))
    assert all(cs[0]["hash"] == reference.center.hex() for cs in pool.checksum().values())


RPC_ITERATIONS = 10
DRIVER = """
import importlib.util, json, sys
import ray
spec = importlib.util.spec_from_file_location("pool_scaling", sys.argv[1])
mod = sys.modules["pool_scaling"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
ray.init(address=sys.argv[2], log_to_driver=False)
ray.cloudpickle.register_pickle_by_value(mod)
from espert.vllm.driver.pool import EnginePool
from espert.update import Update
pool = EnginePool.of(mod.HashEngine, engines=3, num_cpus_per_engine=1, deadline_floor=5.0)
rewards = []
for t in range(int(sys.argv[3])):
    members = [(1000 * t + k, g) for k in range(8) for g in (1, -1)]
    r = pool.evaluate(members, 0.01, ["p"], ["a"])
    rewards.append(r)
    pool.update(Update([s for s, _ in members[::2]], [r[2 * k] - r[2 * k + 1] for k in range(8)], 0.99))
print(json.dumps({"rewards": rewards, "center": pool.checksum()[pool.alive[0]][0]["hash"],
                  "events": [e["event"] for e in pool.events]}))
pool.close()
"""


def test_rpc_failures_injected_by_ray_change_no_reward_and_no_center(cluster):
    faults = {
        "CoreWorkerService.grpc_client.PushTask": {
            "num_failures": 12,
            "req_failure_prob": 8,
            "resp_failure_prob": 8,
            "in_flight_failure_prob": 8,
            "num_lower_bound_req_failures": 1,
            "num_lower_bound_resp_failures": 1,
            "num_lower_bound_in_flight_failures": 1,
        }
    }
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_testing_rpc_failure=json.dumps(faults))
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, _spec.origin, cluster.address, str(RPC_ITERATIONS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    chaos = json.loads(p.stdout.strip().splitlines()[-1])
    reference = HashEngine()  # the same iterations without Ray
    for t, got in enumerate(chaos["rewards"]):
        members = [(1000 * t + k, g) for k in range(8) for g in (1, -1)]
        want = reference.evaluate(members, 0.01, None, None)
        assert got == want, t
        reference.update(Update([s for s, _ in members[::2]], [want[2 * k] - want[2 * k + 1] for k in range(8)], 0.99))
    assert chaos["center"] == reference.center.hex() and len(chaos["rewards"]) == RPC_ITERATIONS
    assert "unreachable_once" in chaos["events"]  # Ray did inject failures, and the pool saw them
    print({e: chaos["events"].count(e) for e in set(chaos["events"])})


def test_a_straggler_is_duplicated_and_its_late_answer_checked(cluster, tmp_path):
    from espert.vllm.driver.chunks import ReplicaDivergence

    flag = str(tmp_path / "slow")
    pool = pool_of(Flagged(flag, "slow", seconds=1.5), engines=2, deadline_floor=1.0)
    reference = HashEngine()
    try:
        iterate(pool, reference, 1)
        open(flag, "w").close()  # the next chunk takes 1.5 s: past its 1 s deadline, within twice that
        iterate(pool, reference, 2)
        assert pool.last_round["duplicates"] >= 1 and pool.last_round["agreed"] >= 1
        assert len(pool.alive) == 2 and not pool.dead  # a straggler within its hang limit stays
    finally:
        pool.close()
    pool = pool_of(Flagged(flag, "lie", seconds=1.5), engines=2, deadline_floor=1.0)
    try:
        iterate(pool, HashEngine(), 1)
        open(flag, "w").close()
        with pytest.raises(ReplicaDivergence, match="scored members .* differently"):
            iterate(pool, HashEngine(), 2)
    finally:
        pool.close()


def test_an_engine_with_another_center_is_refused(cluster, tmp_path, caplog):
    flag = str(tmp_path / "drift")
    pool = pool_of(Flagged(flag, "drift"), engines=2, catch_up="replay")  # a stream would overwrite the drift
    reference = HashEngine()
    try:
        iterate(pool, reference, 1)
        open(flag, "w").close()  # the next engine starts from another center (another model, say)
        new = pool.add_engines(1, wait=True)
        assert new[0] in pool.dead and new[0] not in pool.alive and not pool.joining
        assert any(e["event"] == "refused" and e["engine"] == new[0] for e in pool.events)
        assert "refused" in caplog.text
        iterate(pool, reference, 2)  # the run goes on with the engines it has
        os.remove(flag)
        pool.add_engines(1, wait=True)
        assert len(pool.alive) == 3
        iterate(pool, reference, 3)
    finally:
        pool.close()


def test_the_engines_file_grows_and_shrinks_the_pool(cluster, tmp_path, caplog):
    path = str(tmp_path / "engines")
    pool = pool_of(HashEngine, engines=2, engines_file=path)
    reference = HashEngine()
    try:
        iterate(pool, reference, 1)  # no file: no change
        with open(path, "w") as f:
            f.write("3\n")
        iterate(pool, reference, 2)  # the third engine starts and catches up meanwhile
        pool.wait_for_engines()
        assert len(pool.alive) == 3
        iterate(pool, reference, 3)
        with open(path, "w") as f:
            f.write("1")
        iterate(pool, reference, 4)
        assert len(pool.alive) == 1 and len(pool.removed) == 2
        with open(path, "w") as f:
            f.write("two")
        with caplog.at_level(logging.WARNING, logger="espert.vllm"):
            iterate(pool, reference, 5)
            iterate(pool, reference, 6)
        assert caplog.text.count("must hold a whole number of engines") == 1 and len(pool.alive) == 1
    finally:
        pool.close()


def test_the_only_engine_lost_the_replacement_replays_the_log(cluster):
    pool = pool_of(HashEngine, engines=1, catch_up="stream")  # stream needs a live engine: replay it is
    reference = HashEngine()
    try:
        for t in range(1, 4):
            iterate(pool, reference, t)
        ray.kill(pool.actors[pool.alive[0]])
        iterate(pool, reference, 4)  # waits for the replacement, which replays 3 updates
        ev = next(e for e in pool.events if e["event"] == "joined" and e.get("replaces") is not None)
        assert ev["route"] == "replay" and ev["estimate"]["updates"] == 3 and ev["recovery_s"] > 0
    finally:
        pool.close()
