"""An ES trainer that speaks only vLLM's native RL weight-update API (espert's ``"espert"`` backend).

The engine is a plain ``vllm.LLM`` with ``weight_transfer_config=WeightTransferConfig(backend="espert")``;
the trainer calls ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` and ``generate``, nothing of espert's.  Every update is a command of a few
dozen bytes (seed, σ, sign; or the population's seeds and coefficients), whatever the model's size.

    python bench/vllm_transfer_client.py [MODEL_DIR] [--iterations 3] [--population 4] [--sigma 0.05]

Without MODEL_DIR it builds espert's tiny random Llama in a temporary directory.  Prints the center's
mean reward per iteration and the bytes per update (vLLM's msgpack encoding of each ``update_info``,
what ``LLM.update_weights`` sends its engine core).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np


def send(llm, *commands: dict) -> list[int]:
    """One weight-update session carrying ``commands`` (``update_info`` dicts, applied in order).

    Returns each command's size in bytes as vLLM's engine-core client encodes it (msgpack)."""
    from vllm.v1.serial_utils import MsgpackEncoder

    enc = MsgpackEncoder()
    llm.start_weight_update()
    for c in commands:
        llm.update_weights({"update_info": c})
    llm.finish_weight_update()
    return [sum(len(b) for b in enc.encode(c)) for c in commands]


def rewards(llm, prompts: list[str], score) -> float:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return float(np.mean(score([o.outputs[0].text for o in outs])))


def es_iteration(llm, prompts, score, seeds: list[int], sigma: float, lr: float) -> tuple[float, list[int]]:
    """One antithetic ES step over ``seeds``; returns (mean member reward, bytes of every update sent)."""
    sent, r = [], {}
    for s in seeds:
        for sign in (1, -1):
            sent += send(llm, {"op": "perturb", "seed": s, "sigma": sigma, "sign": sign})
            r[s, sign] = rewards(llm, prompts, score)
            sent += send(llm, {"op": "restore"})
    diffs = np.array([r[s, 1] - r[s, -1] for s in seeds])
    coeffs = (lr * diffs / (2 * len(seeds) * sigma)).tolist()
    sent += send(llm, {"op": "update", "seeds": seeds, "coeffs": coeffs, "decay": 1.0})
    return float(np.mean(list(r.values()))), sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--population", type=int, default=4)
    ap.add_argument("--sigma", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=0.05)
    a = ap.parse_args()
    model = a.model
    if model is None:
        from espert.tiny import build_tiny_model  # only to have a model on disk

        model = os.path.join(tempfile.mkdtemp(), "tiny")
        build_tiny_model(model, seed=0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    llm = LLM(
        model=model,
        dtype="float32",
        worker_extension_cls="espert.vllm.worker.ESWorkerExtension",
        weight_transfer_config=WeightTransferConfig(backend="espert"),
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=64,
    )
    llm.init_weight_transfer_engine({"init_info": {"optimizer": "sgd"}})
    prompts = [f"copy: {w}\n" for w in ("abc", "hello", "espert", "vllm")]

    def score(texts):  # the share of each prompt's word at the start of the completion
        return [float(t.strip().startswith(p.split(": ")[1].strip())) for t, p in zip(texts, prompts)]

    rng = np.random.default_rng(0)
    for it in range(a.iterations):
        seeds = [int(s) for s in rng.integers(0, 2**63, a.population)]
        mean, sent = es_iteration(llm, prompts, score, seeds, a.sigma, a.lr)
        print(f"iteration {it}: member reward {mean:.3f}; {len(sent)} updates, {min(sent)}-{max(sent)} bytes each")


if __name__ == "__main__":
    main()
