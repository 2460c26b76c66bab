"""Anchored weight decay (espert.ops.anchor_decay_) side by side with the torch pattern es-awd applies
(subtract the reference, scale or soft-threshold, add it back: three passes, and a float32 copy of a bf16
reference), the rule written out naively in torch, es-awd as it runs (bf16 weights, no master), the fused ES
update of one member on the same master, and a plain copy; whether each float32 variant gives espert's bits;
then the anchor's host memory on a real model's center.

    python bench/anchor_awd.py [--elements 67108864] [--repeats 5] [--model smollm2-135m-instruct]

Prints one table (median ms, GB/s of the least traffic: master read and written, anchor read) with the CPU path and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from espert import _C, ops
from espert.ops.anchor import anchor_decay_


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def naive_torch(m: torch.Tensor, a: torch.Tensor, f: float) -> None:
    """The rule written out in torch on the float32 master: a float32 copy of the anchor and two temporaries."""
    ref = a.float()
    m.copy_(ref + f * (m - ref))


def esawd_l2(m: torch.Tensor, a: torch.Tensor, f: float) -> None:
    """es-awd's apply_reference_weight_decay_ (l2): the reference cast to the parameter's dtype (a copy when
    they differ), then sub_, mul_, add_: three passes over the parameter."""
    ref = a.to(m.dtype)
    m.sub_(ref).mul_(f).add_(ref)


def esawd_l1(m: torch.Tensor, a: torch.Tensor, step: float) -> None:
    """es-awd's l1 form: sub_, copy_(sign * clamp(|d| - step, 0)), add_."""
    ref = a.to(m.dtype)
    m.sub_(ref)
    m.copy_(torch.sign(m) * torch.clamp(torch.abs(m) - step, min=0.0))
    m.add_(ref)


def same_bits(fn, master: torch.Tensor, expected: torch.Tensor) -> str:
    """Whether one call of ``fn`` on a copy of ``master`` gives ``expected`` bit for bit ('-' if not asked)."""
    if expected is None:
        return "-"
    m = master.clone()
    fn(m)
    return "yes" if torch.equal(m.view(torch.int32), expected.view(torch.int32)) else "no"


def ops_table(n: int, repeats: int) -> list[tuple[str, float, int, str]]:
    """(what, median seconds, bytes moved at the minimum, bit-equal to espert's op) per row."""
    g = torch.Generator().manual_seed(0)
    anchor = (torch.randn(n, generator=g) * 0.02).bfloat16()
    master = anchor.float() + torch.randn(n, generator=g) * 1e-3
    start, other, bf16 = master.clone(), master.clone(), master.bfloat16()
    l2, l1 = {"norm": "l2", "amount": 0.02}, {"norm": "l1", "amount": 1e-4}
    ours = {}
    for name, step in (("l2", l2), ("l1", l1)):
        ours[name] = start.clone()
        anchor_decay_(ours[name], anchor, step)
    f, t = 1.0 - l2["amount"], l1["amount"]
    traffic = n * (4 + 4 + 2)  # master read and written, bf16 anchor read
    rows = [
        ("espert anchor_decay_ l2 (fp32 master, bf16 anchor)", lambda m: anchor_decay_(m, anchor, l2), traffic, "l2"),
        ("espert anchor_decay_ l1 (fp32 master, bf16 anchor)", lambda m: anchor_decay_(m, anchor, l1), traffic, "l1"),
        ("naive torch l2: m.copy_(ref + f*(m - ref)), ref = anchor.float()", lambda m: naive_torch(m, anchor, f), traffic, "l2"),
        ("es-awd pattern l2 on the fp32 master (sub_, mul_, add_)", lambda m: esawd_l2(m, anchor, f), traffic, "l2"),
        ("es-awd pattern l1 on the fp32 master (sub_, sign*clamp, add_)", lambda m: esawd_l1(m, anchor, t), traffic, "l1"),
    ]  # fmt: skip
    out = [
        (name, timed(lambda fn=fn: fn(master), repeats), b, same_bits(fn, start, ours[k])) for name, fn, b, k in rows
    ]
    out.append(("es-awd as it runs: bf16 weights, bf16 reference, l2 (no master)",
                timed(lambda: esawd_l2(bf16, anchor, f), repeats), 6 * n, "-"))  # fmt: skip
    out.append(("espert es_update_, 1 member (for scale)", timed(lambda: ops.es_update_(master, [1], [1e-4], 7), repeats), 8 * n, "-"))  # fmt: skip
    out.append(("plain copy_ of the fp32 master", timed(lambda: master.copy_(other), repeats), 8 * n, "-"))
    return out


def memory(model: str) -> tuple[int, int, int]:
    """(parameters, CenterStore bytes without and with the anchor) of ``model`` as float32 on the CPU."""
    from espert.center import CenterStore
    from espert.evaluators import load_model
    from espert.params import torch_param_views
    from espert.runs import resolve_model_dir
    from espert.runs.gguf import gguf_path

    path = resolve_model_dir(gguf_path(model) or model, print)
    m, _ = load_model(path)
    views = torch_param_views(m)
    n = sum(v.tensor.numel() for v in views)
    return n, CenterStore(views).nbytes, CenterStore(views, anchor=True).nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=1 << 26)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="model whose center's memory is measured ('' to skip)"
    )
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"CPU path {_C.cpu_isa()}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{args.elements} elements, median of {args.repeats}")
    print(f"{'what':70s} {'ms':>9s} {'GB/s':>7s} {'= espert':>8s}")
    for name, sec, nbytes, same in ops_table(args.elements, args.repeats):
        print(f"{name:70s} {1e3 * sec:9.1f} {nbytes / sec / 1e9:7.2f} {same:>8s}")
    if args.model:
        n, plain, anchored = memory(args.model)
        print(f"{args.model}: {n} parameters; center {plain / 1e6:.1f} MB, with the anchor {anchored / 1e6:.1f} MB "
              f"(+{(anchored - plain) / n:.2f} B/parameter)")  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
