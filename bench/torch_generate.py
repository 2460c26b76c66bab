"""The torch evaluator's generation against plain transformers ``generate`` of the same prompts, side by side.

    python bench/torch_generate.py                               # the random 0.5 B Qwen2 (built once), 8 x 12
    python bench/torch_generate.py --model DIR --prompts 8 --max-new-tokens 12 --threads 1 2
    python bench/torch_generate.py --dtypes float32 bfloat16 --out torch_generate.json

One child process per (threads, OpenMP wait policy, dtype): it loads the model once and, in the same
process, times interleaved rounds of

- **plain generate**: ``model.generate(**batch, max_new_tokens=T, do_sample=False)`` on the batch the
  evaluator tokenized (the same token ids, the same padding);
- **TorchEvaluator.generate**: a member's rollout (espert's greedy generation, decoding included);
- **TorchEvaluator.evaluate_center**: the held-out check (the same, plus every step's logits for the
  token-entropy diagnostic);
- **TransformersSampler.sample**: ``espert eval``'s greedy sampler (n = 1) on the same prompts.

Wall and CPU seconds are both reported, with the load average at the start and end: on a shared machine
the wall time of a multi-threaded run is what the load makes of it (see "threads" in docs/bench.md).
The ratio column is each row's median wall time over plain generate's, measured in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(args) -> dict:
    import torch

    from espert.eval.samplers import TransformersSampler
    from espert.evaluators.torch_model import TorchEvaluator, load_model, quiet_transformers
    from espert.tasks import load_task

    quiet_transformers()
    threads = args.threads[0]
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    task = load_task("arithmetic", "test", n=args.prompts)
    ev = TorchEvaluator(model, tok, task.score, max_new_tokens=args.max_new_tokens, chat_template=True)
    batch = ev._encoded(task.prompts)[0]
    sampler = TransformersSampler.__new__(TransformersSampler)  # the eval sampler over the same loaded model
    sampler.model, sampler.tokenizer, sampler.device = model, tok, "cpu"
    sampler.batch_size, sampler.chat_template, sampler.model_path = 64, True, args.model
    gc = ev.generation_config

    @torch.inference_mode()
    def plain():
        model.generate(**batch, generation_config=gc)

    rows = {
        "plain generate": plain,
        "TorchEvaluator.generate": lambda: ev.generate(task.prompts),
        "TorchEvaluator.evaluate_center": lambda: ev.evaluate_center(task.prompts, task.answers),
        "TransformersSampler.sample": lambda: sampler.sample(task.prompts, 1, 0.0, 1.0, args.max_new_tokens),
    }
    plain()  # warm-up (allocator, oneDNN primitives)
    wall = {k: [] for k in rows}
    cpu = {k: [] for k in rows}
    for _ in range(args.repeats):
        for k, f in rows.items():
            w, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.process_time() - c)
    base = statistics.median(wall["plain generate"])
    return {
        "threads": threads,
        "wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "dtype": args.dtype,
        "prompt_tokens": list(batch["input_ids"].shape),
        "load_s": round(load_s, 1),
        "rows": {
            k: {
                "wall_s": round(statistics.median(wall[k]), 2),
                "cpu_s": round(statistics.median(cpu[k]), 2),
                "ratio": round(statistics.median(wall[k]) / base, 3),
                "runs": [round(x, 2) for x in wall[k]],
            }
            for k in rows
        },
    }


def _run_child(args, threads: int, policy: str, dtype: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--dtype", dtype]
    cmd += ["--threads", str(threads), "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--repeats", str(args.repeats)]
    env = dict(os.environ)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"bench child failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def table(results: list[dict]) -> str:
    out = [
        "| threads | OMP wait | dtype | row | wall s | CPU s | / plain generate |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, v in r["rows"].items():
            out.append(
                f"| {r['threads']} | {r['wait_policy']} | {r['dtype']} | {name} | {v['wall_s']} | "
                f"{v['cpu_s']} | {v['ratio']:.2f} |"
            )
    return "\n".join(out)


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the random 0.5 B Qwen2, built once)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--policies", nargs="+", default=["default", "PASSIVE"], help="OMP_WAIT_POLICY values")
    ap.add_argument("--dtypes", nargs="+", default=["float32"])
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return None
    if args.model is None:
        sys.path.insert(0, HERE)
        from population import QWEN2_05B, QWEN2_05B_DIR, build_qwen2

        args.model = build_qwen2(QWEN2_05B_DIR, QWEN2_05B)
    load = [round(x, 1) for x in os.getloadavg()]
    results = []
    for dtype in args.dtypes:
        for threads in args.threads:
            for policy in args.policies if threads > 1 else ["default"]:
                results.append(_run_child(args, threads, policy, dtype))
                print(table(results[-1:]), flush=True)
    doc = {
        "model": args.model,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "cpu": _cpu_name(),
        "load_start": load,
        "load_end": [round(x, 1) for x in os.getloadavg()],
        "results": results,
    }
    print(table(results))
    print(f"load average at start {load}, at end {doc['load_end']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        name = "?"
    return f"{name}, {os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
