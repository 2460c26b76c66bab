"""An EnginePool of real vLLM engines on a three-node Ray cluster (Ray's own test cluster on localhost:
a head and two workers, one logical CPU each), against one in-process engine fed the same members.

In one pool, one case after another, each ending with rewards and centers bitwise equal to the single
engine's:
- the engines are spread over the nodes;
- an engine process dies in the middle of scoring: its chunk is scored by the other engine, and a new
  engine replaces it, catching up by replaying the update log, checked by checksum before it serves;
- an engine hangs (an injected sleep): its chunk goes to the other engine at the deadline, the hung
  engine is killed and replaced by one that streams its center from a live engine;
- a node is removed while its engine scores a chunk: the chunk is re-scored, the engine replaced on a node
  with room;
- an engine is added mid-run on a new node and takes members; two are removed; the final center equals
  the single engine's.
Runtime: ~2.5 min (two engines, four replacements or additions at ~20 s each, one in-process engine).
"""

import os
import sys
import threading

import pytest

vllm = pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))

import ray_cluster  # noqa: E402
from ray_cluster import Faults, node_by_id, wait_for  # noqa: E402

from espert.es import coefficients, normalize  # noqa: E402
from espert.tasks import load_task  # noqa: E402
from espert.tensorfile import write_chunks, write_safetensors  # noqa: E402
from espert.update import Update  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
TASK = load_task("copy", "train", n=12)
JOIN_S = 240  # an engine starts in ~20 s here; a loaded machine is slower


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    c = ray_cluster.start_cluster(workers=2, cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(ray_cluster)  # the actors cannot import tests/fixtures
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def single(tiny_dir):
    from espert.vllm import VLLMEvaluator, make_llm
    from espert.vllm.driver.evaluator import shutdown_llm

    e = VLLMEvaluator(
        make_llm(tiny_dir, max_model_len=64, multiprocess=False), TASK.score, max_new_tokens=6, extract=TASK.extract
    )
    yield e
    shutdown_llm(e.llm)


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return str(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def pool(cluster, tiny_dir, faults):
    from espert.vllm import EnginePool

    p = EnginePool(
        tiny_dir,
        Faults(faults, TASK.score),
        engines=2,
        max_new_tokens=6,
        extract=TASK.extract,
        llm_kwargs=dict(max_model_len=64),
        deadline_floor=5.0,
        join_timeout=JOIN_S,
    )
    yield p
    p.close()


@pytest.fixture(autouse=True)
def one_thread(set_torch_threads):
    """The in-process engine on one thread, as each actor (OMP_NUM_THREADS=1): a random-init model's
    near-tie logits make greedy tokens follow the reduction order."""
    set_torch_threads(1)


def exact(cs):
    from espert.vllm.wire import exact_fields

    return exact_fields(cs)


class Steps:
    """Iterations fed to the pool and the single engine alike; each must give the same rewards and answers."""

    t = 0

    @classmethod
    def run(cls, pool, single, n=1, update=True):
        for _ in range(n):
            cls.t += 1
            m = [(1000 * cls.t + k, g) for k in range(4) for g in (1, -1)]
            r_pool = pool.evaluate(m, 0.05, TASK.prompts, TASK.answers)
            r_one = single.evaluate(m, 0.05, TASK.prompts, TASK.answers)
            assert r_pool == r_one
            assert pool.member_answers == single.member_answers
            if update:
                seeds, coeffs = coefficients(m, r_one, normalize(r_one), 0.02)
                pool.update(Update(seeds, coeffs, 0.999))
                single.update(Update(seeds, coeffs, 0.999))
        for cs in pool.checksum().values():
            assert exact(cs) == exact(single.checksum())


def arm(faults, name):
    open(os.path.join(faults, name), "w").close()


def joined(pool, replaces=None):
    """The pool's last 'joined' event (for the engine replacing ``replaces``, when given)."""
    events = [e for e in pool.events if e["event"] == "joined" and (replaces is None or e.get("replaces") == replaces)]
    return events[-1] if events else None


def test_engines_spread_over_the_nodes_and_equal_one_engine(pool, single, cluster):
    from espert.vllm.driver.actor import EngineActor  # noqa: F401 - the actor class is importable without vLLM
    from espert.vllm.engine.worker import EXACT_FIELDS
    from espert.vllm.wire import EXACT_FIELDS as WIRE_FIELDS

    assert EXACT_FIELDS == WIRE_FIELDS
    assert len(pool.alive) == 2 and len({pool.nodes[e] for e in pool.alive}) == 2
    assert {pool.nodes[e] for e in pool.alive} <= {n.node_id for n in cluster.list_all_nodes()}
    Steps.run(pool, single, 2)
    assert pool.log.position == (0, Steps.t)


def test_an_engine_dying_mid_chunk_is_replaced_by_replay(pool, single, faults):
    pool.options.catch_up = "replay"
    arm(faults, "crash")
    before = list(pool.alive)
    Steps.run(pool, single)  # the iteration completes on the live engine
    assert not os.path.exists(os.path.join(faults, "crash"))
    dead = [e for e in before if e not in pool.alive]
    assert len(dead) == 1 and any(e["event"] == "died" and e["engine"] == dead[0] for e in pool.events)
    pool.wait_for_engines(JOIN_S)
    ev = joined(pool, replaces=dead[0])
    assert ev["route"] == "replay" and ev["estimate"]["updates"] >= 2 and ev["recovery_s"] > 0
    assert len(pool.alive) == 2
    Steps.run(pool, single)


def test_a_hung_engine_is_killed_and_replaced_by_stream(pool, single, faults):
    pool.options.catch_up = "stream"
    arm(faults, "hang")
    Steps.run(pool, single, update=False)
    assert pool.last_round["duplicates"] >= 1  # the hung chunk went to the other engine at its deadline
    hung = [e["engine"] for e in pool.events if e["event"] == "hung"]
    assert hung and hung[-1] not in pool.alive
    Steps.run(pool, single)
    pool.wait_for_engines(JOIN_S)
    assert joined(pool, replaces=hung[-1])["route"] == "stream"
    assert len(pool.alive) == 2
    Steps.run(pool, single)


def test_a_node_removed_mid_chunk(pool, single, faults, cluster):
    pool.options.catch_up = "auto"
    head = cluster.head_node.node_id
    victim = next(e for e in pool.alive if pool.nodes[e] != head)
    node = node_by_id(cluster, pool.nodes[victim])
    arm(faults, f"stall-{node.node_id}")
    stalled = os.path.join(faults, "stalled")

    def remove_when_stalled():
        wait_for(lambda: os.path.exists(stalled), 120, "the engine to stall")
        cluster.remove_node(node)

    remover = threading.Thread(target=remove_when_stalled)
    remover.start()
    Steps.run(pool, single)  # the engine dies with its node while scoring; the other scores its chunk
    remover.join()
    assert victim in pool.dead and any(e["event"] == "died" and e["engine"] == victim for e in pool.events)
    pool.wait_for_engines(JOIN_S)
    ev = joined(pool, replaces=victim)
    assert pool.nodes[ev["engine"]] != node.node_id and ev["route"] in ("replay", "stream")
    Steps.run(pool, single)


def test_an_engine_added_mid_run_takes_members_then_two_leave(pool, single, cluster, tmp_path):
    ray_cluster.add_node(cluster)  # room for a third engine
    new = pool.add_engines(1)
    Steps.run(pool, single)  # it catches up meanwhile (the pool does not wait for it)
    pool.wait_for_engines(JOIN_S)
    assert new[0] in pool.alive and len(pool.alive) == 3
    Steps.run(pool, single)
    assert len(pool.checksums[-1]) == 3
    removed = pool.remove_engines(2)
    assert len(pool.alive) == 1 and set(removed) <= set(pool.removed)
    Steps.run(pool, single)
    got, want = pool.center_state(), single.center_state()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    pool.chunk_bytes = 4096
    a, b = str(tmp_path / "pool.safetensors"), str(tmp_path / "one.safetensors")
    assert write_chunks(a, pool.center_stream()) == write_safetensors(b, want)
    recoveries = {e["event"]: e for e in pool.events}
    print({k: v for k, v in recoveries.items()})
