"""Driver scaling of an EnginePool: the driver's time and bytes per iteration against engines and members.

    python bench/pool_scaling.py                                   # 8..64 engines, population 64..16384
    python bench/pool_scaling.py --engines 8 16 --population 1024 --iterations 3 --json out.json

Each engine is a Ray actor holding a :class:`HashEngine`: a stand-in whose work is a hash (its center is
a 16-byte digest, an update hashes the seeds and coefficients into it, a member's reward is a number from
the digest of (center, seed, sign, σ)).  Its own time is microseconds, so what is measured is the
pool's real code: chunking the population, submitting chunks, waiting for answers, the update broadcast
and the checksum comparison, the bookkeeping of deadlines and of the update log.  The replicas agree bit
for bit, as vLLM engines do, so every check runs.

Per (engines, population), over ``--iterations`` ES iterations after one warm-up: the driver process's
CPU seconds (``time.process_time``, every thread of the driver, Ray's included) and wall seconds for
``evaluate`` and ``update``, and the pickled bytes of every message of one iteration (``pool.traffic``,
counted in a separate iteration so that counting costs no timed one).  On a machine with fewer cores
than engines the actors share the cores with the driver: the wall time then includes the actors',
the driver's CPU time does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import struct
import sys
import time

from espert.update import Update

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class HashEngine:
    """A deterministic stand-in engine (the module docstring).  numel: the parameter count it reports."""

    def __init__(self, numel: int = 1000):
        self.center = hashlib.blake2b(b"espert pool_scaling base", digest_size=16).digest()
        self.info = [{"numel": numel, "rank": 0}]
        self.timings = {"update": 0.0}
        self.member_answers = None

    def _reward(self, seed: int, sign: int, sigma: float) -> float:
        h = hashlib.blake2b(self.center + struct.pack("<Qqd", seed, sign, sigma), digest_size=8).digest()
        return int.from_bytes(h[:6], "little") / float(1 << 48)

    def evaluate(self, members, sigma, prompts, answers) -> list[float]:
        return [self._reward(s, g, sigma) for s, g in members]

    def evaluate_center(self, prompts, answers) -> list[float]:
        return [self._reward(0, 0, 0.0)] * len(prompts)

    def update(self, step) -> None:
        t0 = time.perf_counter()
        h = hashlib.blake2b(self.center, digest_size=16)
        h.update(step.seeds.tobytes() + step.coeffs.tobytes() + struct.pack("<dd", step.decay, step.lr or 0.0))
        if step.anchor:  # an AWD step changes the center too
            h.update(repr(step.anchor).encode())
        self.center = h.digest()
        self.timings["update"] += time.perf_counter() - t0

    def checksum(self) -> list[dict]:
        c = self.center
        return [{"rank": 0, "live_bits": int.from_bytes(c[:8], "little"), "center_bits": int.from_bytes(c[8:], "little"),
                 "hash": c.hex(), "live_sum": 0.0, "center_sum": 0.0}]  # fmt: skip

    def center_state(self) -> dict:
        """The center as a tensor (what a streamed catch-up copies; torch is imported only here)."""
        import torch

        return {"center": torch.tensor(list(self.center), dtype=torch.int64)}

    def load_center(self, state) -> None:
        self.center = bytes(int(x) for x in state["center"].tolist())

    def close(self) -> None:
        pass


def _members(population: int, t: int) -> list[tuple[int, int]]:
    return [(t * 1_000_003 + k, g) for k in range(population // 2) for g in (1, -1)]


def _iteration(pool, population: int, t: int, prompts: list[str]) -> dict:
    """One ES iteration through the pool: the driver's CPU and wall seconds of evaluate and update."""
    members = _members(population, t)
    c0, w0 = time.process_time(), time.perf_counter()
    rewards = pool.evaluate(members, 0.01, prompts, prompts)
    c1, w1 = time.process_time(), time.perf_counter()
    seeds = [s for s, g in members[::2]]
    coeffs = [rewards[2 * k] - rewards[2 * k + 1] for k in range(len(seeds))]
    pool.update(Update(seeds, coeffs, 1.0))
    c2, w2 = time.process_time(), time.perf_counter()
    return {"eval_cpu": c1 - c0, "eval_wall": w1 - w0, "update_cpu": c2 - c1, "update_wall": w2 - w1}


def measure(pool, population: int, iterations: int, prompts: list[str], t0: int) -> dict:
    """Medians over ``iterations`` timed iterations (traffic off), and one iteration's bytes (traffic on)."""
    pool.options.count_traffic = True
    _iteration(pool, population, t0, prompts)  # warm-up, and the bytes of one iteration
    traffic = dict(pool.traffic)
    pool.options.count_traffic = False
    runs = [_iteration(pool, population, t0 + 1 + i, prompts) for i in range(iterations)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out.update(
        engines=len(pool.alive),
        population=population,
        chunks=pool.last_round["chunks"],
        bytes=traffic,
        bytes_total=sum(traffic.values()),
        seed_log_bytes_per_iteration=sum(a.nbytes for a in pool.log.updates[-1][:2]),
    )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--population", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    from espert.vllm.driver.pool import EnginePool

    ray.init(num_cpus=max(args.engines), include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    prompts = [f"prompt {k}: 12 + {k} =" for k in range(args.prompts)]
    rows = []
    for engines in args.engines:
        t0 = time.perf_counter()
        pool = EnginePool.of(HashEngine, engines=engines, num_cpus_per_engine=1, deadline_floor=60.0)
        start_s = time.perf_counter() - t0
        for population in args.population:
            row = measure(pool, population, args.iterations, prompts, 10 * len(rows))
            row["pool_start_s"] = start_s
            rows.append(row)
            print(json.dumps(row), flush=True)
        pool.close()
    ray.shutdown()
    result = {"machine": machine(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(rows))
    return result


def machine() -> dict:
    """The CPU, its vector path and the load, as every number here must say."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    name = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), "?")
    return {"cpu": name, "cores": os.cpu_count(), "avx512": "avx512f" in flags, "load": os.getloadavg()}


def table(rows: list[dict]) -> str:
    """Markdown: per (engines, population) the driver's CPU ms per iteration, wall ms, and bytes."""
    out = [
        "| engines | population | chunks | driver CPU ms: evaluate | update | wall ms: evaluate | update | "
        "bytes per iteration | µs driver CPU per member |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = r["eval_cpu"] + r["update_cpu"]
        out.append(
            f"| {r['engines']} | {r['population']} | {r['chunks']} | {1e3 * r['eval_cpu']:.1f} | "
            f"{1e3 * r['update_cpu']:.1f} | {1e3 * r['eval_wall']:.1f} | {1e3 * r['update_wall']:.1f} | "
            f"{r['bytes_total']:,} | {1e6 * cpu / r['population']:.1f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
