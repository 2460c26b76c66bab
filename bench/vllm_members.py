"""espert's per-member cost inside vLLM against plain, unpatched vLLM generation, on two model sizes.

    python bench/vllm_members.py                          # ~4 M and ~46 M parameters, one run
    python bench/vllm_members.py --sizes 4m --members 8   # quicker
    python bench/vllm_members.py --engines 2              # also: bytes an EnginePool iteration moves
    python bench/vllm_members.py --sizes 05b --members 2 --prompts 4 --max-new-tokens 16 64 256
                                                          # the random 0.5 B Qwen2 (bench/population.py builds it)

For every size, two fresh processes load the same model with the same environment:

- **plain**: ``vllm.LLM`` without espert's worker extension (vLLM's own prepacked CPU GEMMs, nothing
  patched): the time of one greedy ``generate`` of ``--prompts`` prompts × ``--max-new-tokens`` tokens;
- **espert**: :func:`espert.vllm.make_llm` + :class:`espert.vllm.VLLMEvaluator`; per member the
  evaluator's steps: perturb (RPC + fused op + prefix-cache reset), generate (the same call as plain;
  on vLLM-CPU it includes the repack of every edited layer, reported separately from ``es_stats``),
  restore (RPC + exact copy from the host center + reset).  Before each member the same engine also
  generates with no edit (vLLM's packed kernels alone), so ``ratio_to_no_edit`` (median over members
  of total / that generation) compares two timings taken under the same background load.

- **ES-at-Scale pattern** (the espert process, same engine): per member a seeded ``torch.randn`` per tensor
  added in place, generate, the same noise regenerated and subtracted (bench/population.py's
  ``_esatscale_edit``, on every tensor espert moves).

Reported per generation length: medians and minima over members (the minimum is the cost on an idle
machine, the median includes whatever else runs on it), the per-member total, ``ratio`` = total / plain
generation (medians) and ``ratio_min`` (minima), with the CPU seconds of the espert process per member and
the load average.  Generation ignores EOS so both processes produce exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from espert.update import Update

#: Model shapes (espert.tiny.TinySpec fields): about 4.2 M and 46 M parameters; "05b" is bench/population.py's
#: random Qwen2 of Qwen2.5-0.5B's shapes (630 M parameters, float32, built once and kept).
SIZES = {
    "4m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, head_dim=64),
    "46m": dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=6, num_attention_heads=12, head_dim=64),
}


def _stats(xs):
    xs = sorted(xs)
    return {"median_ms": round(1e3 * statistics.median(xs), 3), "min_ms": round(1e3 * xs[0], 3), "n": len(xs)}


def _prompts(model: str, n: int):
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from espert.tasks import load_task

    tok = AutoTokenizer.from_pretrained(model)
    task = load_task("copy", "train", n=n)
    return task, [TokensPrompt(prompt_token_ids=tok(p)["input_ids"]) for p in task.prompts]


def _sampling(max_new_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)


def _child_plain(args) -> dict:
    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=0,
        enable_prefix_caching=False,
    )
    _, prompts = _prompts(args.model, args.prompts)
    out = {}
    for T in args.max_new_tokens:
        sp = _sampling(T)
        llm.generate(prompts, _sampling(2), use_tqdm=False)  # warm-up
        ts = []
        for _ in range(args.members):
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            ts.append(time.perf_counter() - t0)
        out[str(T)] = {"generate": _stats(ts)}
    return out


def _child_espert(args) -> dict:
    from espert.vllm import VLLMEvaluator, make_llm

    task, prompts = _prompts(args.model, args.prompts)
    ev = VLLMEvaluator(
        make_llm(args.model, max_model_len=args.max_model_len, multiprocess=False),
        task.score,
        max_new_tokens=max(args.max_new_tokens),
    )
    numel = sum(r["numel"] for r in ev.info)
    ev.llm.generate(prompts, _sampling(2), use_tqdm=False)  # warm-up
    out = {"numel": numel, "lengths": {}}
    for T in args.max_new_tokens:
        out["lengths"][str(T)] = _members(ev, prompts, _sampling(T), args)
    upd = []
    start = ev.center_state()
    for k in range(2):
        seeds = list(range(100 * k, 100 * k + 8))
        t0 = time.perf_counter()
        ev.update(Update(seeds, [1e-5] * len(seeds)))
        upd.append(time.perf_counter() - t0)
    ev.load_center(start)
    out["update_8_seeds"] = _stats(upd)
    ev.close()
    return out


def _members(ev, prompts, sp, args) -> dict:
    """One generation length: per member, the engine's no-edit generation, espert's perturb / generate (with the
    repack) / restore, and the ES-at-Scale pattern's edit / generate / subtract, interleaved."""
    from population import _esatscale_edit

    def gen():
        ev.llm.generate(prompts, sp, use_tqdm=False)

    def repack_s():
        return ev.rpc("es_stats")[0]["repack_seconds"]

    keys = ("generate_no_edit", "perturb", "generate", "repack", "restore", "total", "cpu_total")
    keys += ("esatscale_edit", "esatscale_generate", "esatscale_subtract", "esatscale_total")
    t = {k: [] for k in keys}
    ratio = []
    for k in range(args.members):
        # the last restore left the packed weights stale: one untimed token repacks them, so the timed no-edit
        # generation below is vLLM's packed kernels alone (a real population's next perturb pays that repack)
        ev.llm.generate(prompts[:1], _sampling(1), use_tqdm=False)
        t0 = time.perf_counter()  # the same engine with no edit, interleaved with the members so both see the
        gen()  # same background load
        t["generate_no_edit"].append(time.perf_counter() - t0)
        r0, c0 = repack_s(), time.process_time()
        t0 = time.perf_counter()
        ev.perturb(k, 0.02, 1 if k % 2 == 0 else -1)
        t1 = time.perf_counter()
        gen()
        t2 = time.perf_counter()
        ev.restore()
        t3 = time.perf_counter()
        for key, dt in zip(("perturb", "generate", "restore", "total"), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            t[key].append(dt)
        t["cpu_total"].append(time.process_time() - c0)
        t["repack"].append(repack_s() - r0)
        ratio.append(t["total"][-1] / t["generate_no_edit"][-1])
        if args.esatscale:
            seed, sign = 1000 + k // 2, 1 if k % 2 == 0 else -1
            e0 = time.perf_counter()
            ev.llm.collective_rpc(_esatscale_edit, args=(seed, 0.02, sign))
            e1 = time.perf_counter()
            gen()
            e2 = time.perf_counter()
            ev.llm.collective_rpc(_esatscale_edit, args=(seed, 0.02, -sign))
            e3 = time.perf_counter()
            for key, dt in zip(("edit", "generate", "subtract", "total"), (e1 - e0, e2 - e1, e3 - e2, e3 - e0)):
                t[f"esatscale_{key}"].append(dt)
            ev.restore()  # their subtraction leaves rounding drift: the next member starts from the exact center
    res = {k: _stats(v) for k, v in t.items() if v}
    res["ratio_to_no_edit"] = round(statistics.median(ratio), 3)
    res["load"] = [round(x, 1) for x in os.getloadavg()]
    return res


def _run_child(kind: str, model: str, args) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        kind,
        "--model",
        model,
        "--members",
        str(args.members),
        "--prompts",
        str(args.prompts),
        "--max-new-tokens",
        *[str(T) for T in args.max_new_tokens],
        "--max-model-len",
        str(args.max_model_len),
    ]
    if not args.esatscale:
        cmd.append("--no-esatscale")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=4 * 3600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"bench child {kind} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def _pool(model: str, args) -> dict:
    from espert.es import coefficients, normalize
    from espert.tasks import load_task
    from espert.vllm import EnginePool

    task = load_task("copy", "train", n=args.prompts)
    pool = EnginePool(
        model,
        task.score,
        engines=args.engines,
        max_new_tokens=8,
        extract=task.extract,  # as the training loop builds it: extracted answers travel back too
        llm_kwargs=dict(max_model_len=args.max_model_len),
    )
    members = [(k, s) for k in range(args.members // 2) for s in (1, -1)]
    t0 = time.perf_counter()
    rewards = pool.evaluate(members, 0.02, task.prompts, task.answers)
    t_eval = time.perf_counter() - t0
    seeds, coeffs = coefficients(members, rewards, normalize(rewards), 0.01)
    pool.update(Update(seeds, coeffs))
    res = {
        "engines": args.engines,
        "evaluate_s": round(t_eval, 3),
        "bytes_per_iteration": pool.traffic,
        "bytes_total": sum(pool.traffic.values()),
        "weights_broadcast_bytes_per_engine": pool.weights_bytes,
    }
    pool.close()
    return res


def table(results: dict) -> str:
    """A markdown table of :func:`main`'s results (medians, ms), one row per model size and generation length."""
    rows = [
        "| model | new tokens | plain vLLM generate | espert perturb | generate (incl. repack) | repack | restore | "
        "per-member total | total / plain (medians) | (minima) | total / no-edit generate (paired) | "
        "ES-at-Scale pattern total (edit, subtract) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, r in results["sizes"].items():
        e = r["espert"]
        for T, m in e["lengths"].items():
            plain = r["plain"][T]["generate"]["median_ms"] if r.get("plain") else float("nan")
            esc = (
                f"{m['esatscale_total']['median_ms']:.0f} ({m['esatscale_edit']['median_ms']:.0f}, "
                f"{m['esatscale_subtract']['median_ms']:.0f})"
                if "esatscale_total" in m
                else ""
            )
            rows.append(
                f"| {size} ({e['numel'] / 1e6:.1f} M) | {T} | {plain:.1f} | {m['perturb']['median_ms']:.1f} | "
                f"{m['generate']['median_ms']:.1f} | {m['repack']['median_ms']:.1f} | "
                f"{m['restore']['median_ms']:.1f} | {m['total']['median_ms']:.1f} | "
                f"{r['ratio'].get(T, float('nan')):.2f}× | {r['ratio_min'].get(T, float('nan')):.2f}× | "
                f"{m['ratio_to_no_edit']:.2f}× | {esc} |"
            )
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4m,46m", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--model", default=None, help="measure this model directory instead of the built ones")
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[32], help="one or more generation lengths")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: longest length + 64")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--no-plain", action="store_true", help="skip the unpatched vLLM process (saves a model load)")
    ap.add_argument("--no-esatscale", dest="esatscale", action="store_false", help="skip the ES-at-Scale rows")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", choices=("plain", "espert"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.max_model_len = args.max_model_len or max(args.max_new_tokens) + 64
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.child:
        res = (_child_plain if args.child == "plain" else _child_espert)(args)
        print("RESULT " + json.dumps(res), flush=True)
        return res

    if args.model:
        models = {os.path.basename(os.path.normpath(args.model)): args.model}
    else:
        from espert.tiny import TinySpec, build_tiny_model

        models = {}
        for size in args.sizes.split(","):
            if size == "05b":
                from population import QWEN2_05B, QWEN2_05B_DIR, build_qwen2

                models[size] = build_qwen2(QWEN2_05B_DIR, QWEN2_05B)
                continue
            if size not in SIZES:
                ap.error(f"unknown size {size!r}; choose from {sorted(SIZES) + ['05b']}")
            models[size] = tempfile.mkdtemp(prefix=f"espert_bench_{size}_")
            build_tiny_model(
                models[size], seed=0, spec=TinySpec(max_position_embeddings=args.max_model_len, **SIZES[size])
            )
    res = {
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "members": args.members,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
        "load_start": [round(x, 1) for x in os.getloadavg()],
        "sizes": {},
    }
    for size, model in models.items():
        plain = None if args.no_plain else _run_child("plain", model, args)
        esp = _run_child("espert", model, args)
        res["sizes"][size] = {"plain": plain, "espert": esp, "ratio": {}, "ratio_min": {}}
        for T, m in esp["lengths"].items():
            if plain is not None:
                res["sizes"][size]["ratio"][T] = round(m["total"]["median_ms"] / plain[T]["generate"]["median_ms"], 3)
                res["sizes"][size]["ratio_min"][T] = round(m["total"]["min_ms"] / plain[T]["generate"]["min_ms"], 3)
    res["load_end"] = [round(x, 1) for x in os.getloadavg()]
    if args.engines > 1:
        res["pool"] = _pool(next(iter(models.values())), args)
    print(json.dumps(res, indent=2))
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
