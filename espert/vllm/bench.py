"""Measure espert's per-member overhead inside vLLM, and the bytes an iteration moves between engines.

    python -m espert.vllm.bench                       # tiny model, one in-process engine
    python -m espert.vllm.bench --hidden 256 --layers 4 --engines 2

Per member, the evaluator does: perturb (RPC + fused op on every weight) + prefix-cache reset,
generate, restore (RPC + copy from the host center) + reset.  We time each part over many
members and report the median and the minimum (the minimum is the cost on an idle machine; the
median includes whatever else runs on it).  With ``--engines N > 1`` the population also runs
through an :class:`espert.vllm.EnginePool` and the pickled size of every message is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _stats(xs):
    xs = sorted(xs)
    return {"median_ms": round(1e3 * statistics.median(xs), 3), "min_ms": round(1e3 * xs[0], 3), "n": len(xs)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: build the tiny model)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--members", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from espert.tasks import load_task
    from espert.vllm import VLLMEvaluator, make_llm

    model = args.model
    if model is None:
        from espert.tiny import TinySpec, build_tiny_model

        model = tempfile.mkdtemp(prefix="espert_bench_")
        build_tiny_model(model, seed=0, spec=TinySpec(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                                      num_hidden_layers=args.layers,
                                                      num_attention_heads=max(1, args.hidden // 32)))
    task = load_task("copy", "train", n=args.prompts)
    ev = VLLMEvaluator(make_llm(model, max_model_len=64, multiprocess=False), task.score,
                       max_new_tokens=args.max_new_tokens)
    numel = sum(r["numel"] for r in ev.info)
    ev.evaluate([(1, 1)], 0.02, task.prompts, task.answers)  # warm-up
    t = {"perturb+reset": [], "generate+score": [], "restore+reset": [], "perturb_rpc": [], "restore_rpc": []}
    for k in range(args.members):
        t0 = time.perf_counter()
        ev.perturb(k, 0.02, 1)
        t1 = time.perf_counter()
        ev.rollout(task.prompts, task.answers)
        t2 = time.perf_counter()
        ev.restore()
        t3 = time.perf_counter()
        ev.rpc("es_perturb", k, 0.02, 1)
        t4 = time.perf_counter()
        ev.rpc("es_restore")
        t5 = time.perf_counter()
        for key, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            t[key].append(dt)
    ev.llm.reset_prefix_cache()
    upd, chk = [], []
    start = ev.center_state()
    for k in range(5):
        seeds = list(range(100 * k, 100 * k + args.members // 2))
        t0 = time.perf_counter()
        ev.update(seeds, [1e-4] * len(seeds))
        upd.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ev.checksum()
        chk.append(time.perf_counter() - t0)
    ev.load_center(start)
    res = {"model": model, "numel": numel, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "per_member": {k: _stats(v) for k, v in t.items()},
           f"update_{args.members // 2}_seeds": _stats(upd), "checksum": _stats(chk)}
    g = statistics.median(t["generate+score"])
    ov = statistics.median(t["perturb+reset"]) + statistics.median(t["restore+reset"])
    res["overhead_over_generation"] = round(ov / g, 4)
    from espert.vllm.evaluator import shutdown_llm

    shutdown_llm(ev.llm)

    if args.engines > 1:
        from espert.vllm import EnginePool

        pool = EnginePool(model, task.score, engines=args.engines, max_new_tokens=args.max_new_tokens,
                          llm_kwargs=dict(max_model_len=64))
        members = [(k, s) for k in range(args.members // 2) for s in (1, -1)]
        t0 = time.perf_counter()
        rewards = pool.evaluate(members, 0.02, task.prompts, task.answers)
        t_eval = time.perf_counter() - t0
        from espert.es import coefficients, normalize

        seeds, coeffs = coefficients(members, rewards, normalize(rewards), 0.01)
        pool.update(seeds, coeffs)
        res["pool"] = {"engines": args.engines, "evaluate_s": round(t_eval, 3),
                       "bytes_per_iteration": pool.traffic, "bytes_total": sum(pool.traffic.values()),
                       "weights_broadcast_bytes_per_engine": pool.weights_bytes}
        pool.close()
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
