"""Recovery of an EnginePool from each kind of fault, on Ray's multi-node test cluster with real vLLM engines.

    python bench/pool_faults.py [--iterations 4] [--json out.json]

A head and two worker nodes on this machine (``ray.cluster_utils.Cluster``, one logical CPU each), a pool
of two engines of the tiny model (``espert.tiny``), the copy task (8 members, 12 prompts, 6 new tokens).
After ``--iterations`` clean iterations, one fault at a time is injected in the middle of an iteration
(tests/fixtures/ray_cluster.py's ``Faults``): an engine process exits (death), an engine sleeps (hang; the
deadline floor is 5 s), the node under an engine is removed (node loss).  For each:

- the faulted iteration's wall time against the median clean one;
- fault to detection (the pool's event), and detection to the replacement serving (its ``joined`` event:
  the actor's start, then the catch-up), with the route the pool chose and its estimate;

then a new engine is added twice more, forced once to replay and once to stream, after the same number of
updates, to compare the two routes' catch-up times on this model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from pool_scaling import machine  # noqa: E402

from espert.update import Update  # noqa: E402


def _fixtures():
    spec = importlib.util.spec_from_file_location("ray_cluster", os.path.join(ROOT, "tests/fixtures/ray_cluster.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["ray_cluster"] = mod
    return mod


class Loop:
    """ES iterations on the pool: members, rewards, an update; returns each iteration's wall seconds."""

    def __init__(self, pool, task):
        self.pool, self.task, self.t = pool, task, 0

    def step(self) -> float:
        from espert.es import coefficients, normalize

        self.t += 1
        members = [(1000 * self.t + k, g) for k in range(4) for g in (1, -1)]
        t0 = time.perf_counter()
        rewards = self.pool.evaluate(members, 0.05, self.task.prompts, self.task.answers)
        seeds, coeffs = coefficients(members, rewards, normalize(rewards), 0.02)
        self.pool.update(Update(seeds, coeffs, 0.999))
        return time.perf_counter() - t0


def _fault(pool, loop, cluster, rc, root: str, kind: str) -> dict:
    """Inject one fault in the middle of an iteration; the iteration's time and the pool's events."""
    armed = time.monotonic()
    remover = None
    if kind == "death":
        open(os.path.join(root, "crash"), "w").close()
    elif kind == "hang":
        open(os.path.join(root, "hang"), "w").close()
    else:
        victim = next(e for e in pool.alive if pool.nodes[e] != cluster.head_node.node_id)
        node = rc.node_by_id(cluster, pool.nodes[victim])
        open(os.path.join(root, f"stall-{node.node_id}"), "w").close()

        def remove():
            rc.wait_for(lambda: os.path.exists(os.path.join(root, "stalled")), 120, "the engine to stall")
            os.remove(os.path.join(root, "stalled"))
            cluster.remove_node(node)

        remover = threading.Thread(target=remove)
        remover.start()
    seconds = loop.step()
    if remover is not None:
        remover.join()
    lost = next(e for e in reversed(pool.events) if e["event"] in ("died", "hung"))
    pool.wait_for_engines(600)
    joined = next(e for e in reversed(pool.events) if e["event"] == "joined" and e.get("replaces") == lost["engine"])
    return {
        "fault": kind,
        "iteration_s": seconds,
        "detected_s": lost["time"] - armed,
        "recovery_s": joined["recovery_s"],
        "start_s": joined["start_s"],
        "catch_up_s": joined["catch_up_s"],
        "route": joined["route"],
        "estimate": joined["estimate"],
    }


def _route(pool, route: str) -> dict:
    pool.options.catch_up = route
    new = pool.add_engines(1)
    pool.wait_for_engines(600)
    ev = next(e for e in reversed(pool.events) if e["event"] == "joined" and e["engine"] == new[0])
    pool.remove_engines(1)
    return {"route": route, "updates": ev["estimate"]["updates"], "catch_up_s": ev["catch_up_s"], "start_s": ev["start_s"],
            "estimate": ev["estimate"]}  # fmt: skip


def replay_cost(elements: int = 1 << 24, seeds: int = 16) -> dict:
    """What a replayed update costs per element and seed: espert's CPU update op (the one every engine runs
    on its float32 host master) on ``elements`` float32 values with ``seeds`` seeds, on 1 thread and on all."""
    import torch

    from espert import ops

    w = torch.zeros(elements, dtype=torch.float32)
    out = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        ops.es_update_(w, list(range(seeds)), [1e-5] * seeds, 12345)  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            ops.es_update_(w, list(range(seeds)), [1e-5] * seeds, 12345)
            times.append(time.perf_counter() - t0)
        out[f"ns_per_element_seed_{threads}_threads"] = 1e9 * min(times) / (elements * seeds)
    return out


def transfer_rate(cluster, megabytes: int = 64) -> dict:
    """Ray's engine-to-engine rate on this cluster: an actor on one node makes a ``megabytes`` object, an
    actor on another node fetches it (what a streamed catch-up does with a center)."""
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Holder:
        def node(self):
            return ray.get_runtime_context().get_node_id()

        def make(self, n):
            return np.ones(n, dtype=np.uint8)

        def take(self, array):
            return int(array.nbytes)

    nodes = [n.node_id for n in cluster.list_all_nodes()][:2]
    strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
    a, b = (Holder.options(scheduling_strategy=strategy(n, soft=False)).remote() for n in nodes)
    assert ray.get(a.node.remote()) != ray.get(b.node.remote())
    rates = []
    for _ in range(3):
        ref = a.make.remote(megabytes << 20)
        ray.wait([ref], fetch_local=False)
        t0 = time.perf_counter()
        ray.get(b.take.remote(ref))  # resolved on b's node: fetched from a's object store
        rates.append((megabytes << 20) / (time.perf_counter() - t0))
    return {"megabytes": megabytes, "bytes_per_s": max(rates)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rc = _fixtures()
    import ray

    from espert.tasks import load_task
    from espert.tiny import build_tiny_model
    from espert.vllm import EnginePool

    root = tempfile.mkdtemp(prefix="pool_faults-")
    model = os.path.join(root, "model")
    build_tiny_model(model, seed=0)
    task = load_task("copy", "train", n=12)
    cluster = rc.start_cluster(workers=2, cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(rc)
    t0 = time.perf_counter()
    pool = EnginePool(model, rc.Faults(root, task.score), engines=2, max_new_tokens=6, extract=task.extract,
                      llm_kwargs=dict(max_model_len=64), deadline_floor=5.0, join_timeout=600)  # fmt: skip
    out = {"machine": machine(), "pool_start_s": time.perf_counter() - t0}
    loop = Loop(pool, task)
    out["clean_iteration_s"] = statistics.median(loop.step() for _ in range(args.iterations))
    out["faults"] = []
    for kind in ("death", "hang", "node loss"):
        if kind == "node loss":
            rc.add_node(cluster)  # the removed node's engine needs a node with room elsewhere
        out["faults"].append(_fault(pool, loop, cluster, rc, root, kind))
        print(json.dumps(out["faults"][-1]), flush=True)
    for _ in range(2 * args.iterations):
        loop.step()
    rc.add_node(cluster)
    out["routes"] = [_route(pool, r) for r in ("replay", "stream")]
    pool.close()
    out["transfer"] = transfer_rate(cluster)
    ray.shutdown()
    cluster.shutdown()
    out["replay"] = replay_cost()
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
