"""Compiled vLLM engines and the compile cache: plain vLLM and espert side by side, first and second start.

    python bench/vllm_compile_cache.py [--model DIR] [--out DIR]

Four fresh processes, each starting one in-process compiled engine (``enforce_eager=False``, vLLM's default,
the one ES-at-Scale's trainer uses) on the tiny Llama in bf16, then generating 4 greedy tokens: plain vLLM
twice on one empty ``VLLM_CACHE_ROOT``, then espert (``make_llm`` + ``es_setup``, the self-test included)
twice on another.  Prints per start: seconds to a ready engine, whether vLLM reloaded its AOT-compiled model
or compiled again (and why), the compile-cache hash directories, and the greedy tokens (they must agree).
About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

START = """
import os, sys, time
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
model, mode = sys.argv[1], sys.argv[2]
t0 = time.time()
if mode == "espert":
    from espert.vllm import make_llm
    llm = make_llm(model, dtype="bfloat16", max_model_len=64, enforce_eager=False)
    llm.collective_rpc("es_setup")
else:
    from vllm import LLM
    llm = LLM(model=model, dtype="bfloat16", max_model_len=64, enforce_eager=False, enable_prefix_caching=False)
seconds = time.time() - t0
from vllm import SamplingParams
out = llm.generate(["abca>"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print("RESULT", seconds, list(out[0].outputs[0].token_ids), flush=True)
"""


def start(model: str, mode: str, cache: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, VLLM_CACHE_ROOT=cache, PYTHONPATH=repo, VLLM_LOGGING_LEVEL="INFO")
    p = subprocess.run(
        [sys.executable, "-c", START, model, mode], env=env, capture_output=True, text=True, timeout=1800
    )
    log = p.stdout + p.stderr
    result = next((line.split(" ", 1)[1] for line in log.splitlines() if line.startswith("RESULT ")), None)
    if p.returncode != 0 or result is None:
        raise RuntimeError(f"{mode} start failed:\n{log[-3000:]}")
    seconds, tokens = result.split(" ", 1)
    again = re.search(r"Compiling model again due to a load failure from \S+, reason: (.*)", log)
    aot = os.path.join(cache, "torch_compile_cache", "torch_aot_compile")
    return {
        "mode": mode,
        "start_s": round(float(seconds), 1),
        "aot": "reloaded"
        if "Directly load AOT compilation" in log
        else f"compiled again: {again.group(1)[:80]}"
        if again
        else "compiled",
        "hash_dirs": sorted(os.listdir(aot)) if os.path.isdir(aot) else [],
        "tokens": tokens,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model directory (default: the tiny Llama, built here)")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="espert-compile-cache-"))
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from espert.tiny import build_tiny_model

        model = os.path.join(args.out, "model")
        build_tiny_model(model, seed=0)
    print(f"load average before: {os.getloadavg()}, cpus: {os.cpu_count()}")
    rows = []
    for mode in ("plain", "espert"):
        cache = os.path.join(args.out, f"cache-{mode}")
        for run in ("first", "second"):
            row = {"start": run, **start(model, mode, cache)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"load average after: {os.getloadavg()}")
    plain, espert = rows[0]["hash_dirs"], rows[2]["hash_dirs"]
    print(
        f"compile-cache directories: plain {plain}, espert {espert}: {'apart' if set(plain).isdisjoint(espert) else 'SHARED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
