"""The model-shaped part of the GPU check (bench/gpu_check.sh runs it after the GPU tests).

On a Qwen2.5-1.5B-shaped list of random bf16 tensors (338 tensors, 1.54 B parameters, no download) it
measures, against the device copy bandwidth and the pinned host-to-device bandwidth it measures first:

- perturb and the N=32 update on the device weights, per backend (CUDA against Triton);
- CenterStore restore (from the pinned mirror when the store has one), the per-member overhead
  (perturb + restore) in ms with the launches and host-to-device copies per member (ops.counting),
  and the N=32 CenterStore update on the host and, where the store supports it, staged on the GPU;
- torch.cuda.max_memory_allocated beyond the weights during all of that;
- CUDA-graph capture of a perturb-forward-restore step (through CenterStore and through the raw ops).

    python bench/gpu_check.py OUT_DIR [--dry-run] [--junit FILE ...]

writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md.  --dry-run runs the same flow on CPU tensors
with a tiny model of the same structure and the "cpu" backend.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from espert import _C, ops
from espert.center import CenterStore
from espert.params import ParamView
from espert.update import Update

QWEN25_1_5B = dict(hidden=1536, inter=8960, layers=28, kv=256, vocab=151936)
TINY = dict(hidden=64, inter=192, layers=2, kv=16, vocab=512)  # same structure, for --dry-run
SIGMA = 1e-3
FAMILY_TIMINGS = ("gaussian-icdf", "rademacher")  # perturb timed per backend besides the default gaussian


def model_shapes(hidden: int, inter: int, layers: int, kv: int, vocab: int) -> list[tuple[str, tuple]]:
    """Qwen2 parameter names and shapes (tied embeddings, q/k/v biases)."""
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    return out + [("model.norm.weight", (hidden,))]


class Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median(self, fn, reps: int, warmup: int = 1) -> float:
        """Median seconds of fn() over reps (device events on CUDA, after warm-up)."""
        for _ in range(warmup):
            fn()
        self.sync()
        ts = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    def kernel_median(self, fn, reps: int, warmup: int = 1) -> tuple[float, float | None]:
        """(median device seconds of the kernels fn() enqueues, median host seconds fn() takes to return).

        On CUDA a sleep kernel is queued first, so the device is still busy while the host builds the
        plan and pins the tables: the events around fn() then time the kernels alone, and the host
        work (plan, pinning, launches) is the separate second number.  On CPU (the dry run) the two are
        the same work: (wall seconds, None)."""
        if not self.cuda:
            return self.median(fn, reps, warmup), None
        for _ in range(warmup):
            fn()
        self.sync()
        dev, host = [], []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: longer than any host work below
            a.record()
            t = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t)
            b.record()
            b.synchronize()
            dev.append(a.elapsed_time(b) / 1e3)
        return statistics.median(dev), statistics.median(host)


def junit_summary(paths: list[str]) -> dict:
    out = {}
    for p in paths:
        if not Path(p).exists():
            out[Path(p).name] = {"error": "no report (the test run did not finish)"}
            continue
        root = ET.parse(p).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        agg = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        agg["failed"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for s in suites
            for c in s.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ][:20]
        out[Path(p).name] = agg
    return out


def capture(step, device: str) -> dict:
    """Capture step() in a CUDA graph, replay it once; the result or the error, never an exception."""
    if device != "cuda":
        step()  # the dry run still executes the step eagerly
        return {"ok": None, "note": "no CUDA: eager step only"}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up on a side stream, as torch.cuda.graphs requires
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        return {"ok": True, "graph": g}
    except Exception as e:  # the check reports what breaks capture; it must not stop the run
        torch.cuda.synchronize()
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def graph_checks(device: str, dtype=torch.bfloat16) -> dict:
    """A perturb-forward-restore step on a small MLP, captured two ways; replay must give the eager bits."""
    torch.manual_seed(0)
    h = 256 if device == "cuda" else 32
    model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)).to(device, dtype)
    views = [ParamView(n, p.data) for n, p in model.named_parameters()]
    x = torch.randn(8, h, device=device, dtype=dtype)
    store = CenterStore(views, pin=device == "cuda")
    centers = [p.data.clone() for p in model.parameters()]
    out = torch.empty(8, h, device=device, dtype=dtype)
    with torch.no_grad():
        ops.perturb_many_([(v.tensor, v.key, None) for v in views], 5, SIGMA)
        want = model(x).clone()
        store.restore()
    be = "cuda" if device == "cuda" and _C.has_cuda else None
    items = [(v.tensor, v.key, None) for v in views]
    mirrors = [p.data.to("cpu").pin_memory() if device == "cuda" else p.data.clone() for p in model.parameters()]

    def store_step():
        with torch.no_grad():
            store.perturb(5, SIGMA, backend=be)
            out.copy_(model(x))
            store.restore()

    def ops_step():
        with torch.no_grad():
            ops.perturb_many_(items, 5, SIGMA, backend=be)
            out.copy_(model(x))
            for v, m in zip(views, mirrors):
                ops.restore_(v.tensor, m, non_blocking=True)

    res = {}
    for name, step in (("CenterStore perturb-forward-restore", store_step), ("ops perturb-forward-restore", ops_step)):
        out.zero_()
        r = capture(step, device)
        if r.get("ok") is not False:
            same_out = torch.equal(out.view(torch.int16), want.view(torch.int16))
            restored = all(
                torch.equal(p.data.view(torch.int16), c.view(torch.int16)) for p, c in zip(model.parameters(), centers)
            )
            r.update(replay_matches_eager=bool(same_out), restored_exactly=bool(restored))
        r.pop("graph", None)
        res[name] = r
    res["Prepared perturb-forward-restore, members switched between replays"] = member_switch(
        model, views, store, x, out, be, device, centers
    )
    return res


def member_switch(model, views, store, x, out, backend, device: str, centers, seeds=(5, 6, 2**64 - 1)) -> dict:
    """One captured ops.Prepared perturb-forward-restore step replayed for several members, each set by
    rewriting the staged seed between replays: every replay must give that member's eager output (the
    dry run, without CUDA, runs the same step eagerly for each member)."""
    items = [(v.tensor, v.key, None) for v in views]
    want = []
    with torch.no_grad():
        for seed in seeds:
            ops.perturb_many_(items, seed, SIGMA)
            want.append(model(x).clone())
            store.restore()
    p = ops.Prepared(items, backend=backend)
    p.set_members([seeds[0]], [SIGMA])

    def step():
        with torch.no_grad():
            p.apply()
            out.copy_(model(x))
            store.restore()

    r = capture(step, device)
    if r.get("ok") is False:
        return r
    g = r.pop("graph", None)
    matches = []
    for seed, w in zip(seeds, want):
        p.set_members([seed], [SIGMA])
        out.zero_()
        if g is not None:
            g.replay()
            torch.cuda.synchronize()
        else:
            step()
        matches.append(bool(torch.equal(out.view(torch.int16), w.view(torch.int16))))
    centers_ok = all(torch.equal(v.tensor.view(torch.int16), c.view(torch.int16)) for v, c in zip(views, centers))
    distinct = len({tuple(w.view(torch.int16).flatten()[:64].tolist()) for w in want}) == len(want)
    r.update(replay_matches_eager=all(matches) and distinct, members=matches, restored_exactly=bool(centers_ok))
    return r


class Report(dict):
    """The report, written to OUT_DIR/gpu_check.json after every section, so a failure (or a kill at the
    device command's limit) keeps the numbers of the sections before it.  A section that raises is
    recorded as {"error": ...} and the next one runs."""

    def __init__(self, out_dir: Path | None):
        super().__init__()
        self.out_dir = out_dir

    def write(self) -> None:
        if self.out_dir is not None:
            (self.out_dir / "gpu_check.json").write_text(json.dumps(self, indent=1, default=str))

    def section(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # the check reports what breaks; it must not stop the run
            traceback.print_exc()
            prev = self.get(name) if isinstance(self.get(name), dict) else {}
            self[name] = {**prev, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        self.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 3)
        self.write()


def run(out_dir: Path | None, dry: bool, junit: list[str]) -> dict:
    device = "cuda" if torch.cuda.is_available() and not dry else "cpu"
    if not dry and device != "cuda":
        raise SystemExit("gpu_check.py: no CUDA device (use --dry-run for the CPU rehearsal)")
    t = Timer(device)
    reps = 5 if device == "cuda" else 1
    cfg = TINY if dry else QWEN25_1_5B
    if device == "cuda":
        backends = (["cuda"] if _C.has_cuda else []) + ["triton"]
    else:  # interpreted Triton takes minutes even on the tiny model; tests/test_gpu.py covers it in the dry run
        backends = ["cpu"]
    report = Report(out_dir)
    report.update(
        {
            "device": torch.cuda.get_device_name() if device == "cuda" else f"CPU dry run ({platform.processor()})",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "has_cuda": bool(_C.has_cuda),
            "cpu_isa": _C.cpu_isa(),
            "model": "Qwen2.5-1.5B-shaped" if not dry else "tiny Qwen2-shaped (dry run)",
            "tests": junit_summary(junit),
        }
    )
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None

    report.write()
    st: dict = {}  # the objects the sections share

    # -- weights --------------------------------------------------------------------------------
    shapes = model_shapes(**cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    weights = [(torch.randn(s, device=device, generator=gen) * 0.02).to(torch.bfloat16) for _, s in shapes]
    views = [ParamView(n, w) for (n, _), w in zip(shapes, weights)]
    items = [(v.tensor, v.key, None) for v in views]
    numel = sum(w.numel() for w in weights)
    wbytes = 2 * numel
    report.update(tensors=len(weights), parameters=numel, weight_bytes=wbytes)

    report.write()

    # -- ceilings: device copy and pinned host-to-device bandwidth ------------------------------
    def ceilings():
        src = torch.empty(numel, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        copy_s = t.median(lambda: dst.copy_(src), reps)  # noqa: F821 - runs before the del below
        copy_bw = 2 * wbytes / copy_s
        del src, dst
        h2d_n = min(wbytes, 1 << 30)
        host = torch.empty(h2d_n, dtype=torch.uint8, pin_memory=device == "cuda")
        devbuf = torch.empty(h2d_n, dtype=torch.uint8, device=device)
        h2d_s = t.median(lambda: devbuf.copy_(host, non_blocking=True), reps)  # noqa: F821 - runs before the del below
        h2d_bw = h2d_n / h2d_s
        del host, devbuf
        st.update(copy_s=copy_s, h2d_bw=h2d_bw)
        report["ceilings"] = {
            "device_copy_GBps": copy_bw / 1e9,
            "device_copy_ms": copy_s * 1e3,
            "pinned_h2d_GBps": h2d_bw / 1e9,
        }

    report.section("ceilings", ceilings)
    copy_s, h2d_bw = st.get("copy_s", float("nan")), st.get("h2d_bw", float("nan"))

    # -- kernels on the device weights, per backend ---------------------------------------------
    seeds32, coeffs32 = list(range(1, 33)), [1e-5] * 32
    per_backend: dict = {}
    report["backends"] = per_backend
    for be in backends:

        def kernels(be=be):
            r = per_backend.setdefault(be, {})
            with ops.counting() as c:
                ops.perturb_many_(items, 1, SIGMA, backend=be)
            r["perturb_launches"], r["perturb_h2d"] = c["launches"], c["h2d"]
            p, p_host = t.kernel_median(lambda: ops.perturb_many_(items, 1, SIGMA, backend=be), reps)
            r.update(perturb_ms=p * 1e3, perturb_GBps=2 * wbytes / p / 1e9, perturb_vs_copy=copy_s / p)
            if p_host is not None:
                r["perturb_host_ms"] = p_host * 1e3  # plan building, pinning and launches, not in perturb_ms
            report.write()
            u, u_host = t.kernel_median(
                lambda: ops.es_update_many_(items, seeds32, coeffs32, backend=be), max(1, reps // 2)
            )
            r.update(update_n32_ms=u * 1e3, update_n32_in_perturbs=u / p, update_n32_vs_copy=copy_s / u)
            if u_host is not None:
                r["update_n32_host_ms"] = u_host * 1e3

        report.section(f"backends.{be}", kernels)
        if f"backends.{be}" in report:  # a failed section: its error belongs to the backend's entry
            per_backend.setdefault(be, {})["error"] = report.pop(f"backends.{be}")["error"]
            report.write()

    # -- the center store: restore, per-member overhead, update ---------------------------------
    def store_section():
        sig = inspect.signature(CenterStore).parameters
        t0 = time.perf_counter()
        store = CenterStore(views, pin=device == "cuda")
        report["store"] = {
            "build_s": time.perf_counter() - t0,
            "host_bytes": store.nbytes,
            "host_bytes_per_param": store.nbytes / numel,
            "pinned_mirror": getattr(store, "mirrors", None) is not None,
        }
        base_mem = torch.cuda.memory_allocated() if device == "cuda" else 0
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        st = report["store"]
        rs = t.median(store.restore, reps)
        st.update(restore_ms=rs * 1e3, restore_GBps=wbytes / rs / 1e9, restore_vs_pinned_h2d=(wbytes / rs) / h2d_bw)
        report.write()

        def member():
            store.perturb(3, SIGMA, 1)
            store.restore()

        with ops.counting() as c:
            member()
        st.update(member_launches=c["launches"], member_h2d=c["h2d"])
        st["member_ms"] = t.median(member, reps) * 1e3
        report.write()
        t.sync()
        u0 = time.perf_counter()
        store.update(Update(seeds32, coeffs32))
        t.sync()
        st["update_n32_host_s"] = time.perf_counter() - u0
        if "update_on" in sig and device == "cuda":
            store.update_on = torch.device("cuda")
            u0 = time.perf_counter()
            store.update(Update(seeds32, coeffs32))
            t.sync()
            st["update_n32_staged_gpu_s"] = time.perf_counter() - u0
            store.update_on = None
        if device == "cuda":
            st["max_memory_beyond_weights_bytes"] = torch.cuda.max_memory_allocated() - base_mem

    report.section("store", store_section)

    # -- CUDA graphs --------------------------------------------------------------------------
    def graphs():
        report["cuda_graph"] = graph_checks(device)

    report.section("cuda_graph", graphs)

    # -- the other families' perturb, last (a Triton compile each; nothing above waits for them) ----------
    for be in backends:
        if "error" in per_backend.get(be, {}) or be not in per_backend:  # its kernels never ran: nothing to time
            continue

        def families(be=be):
            for fam in FAMILY_TIMINGS:  # the SASS counts' prediction (README), measured
                f, _ = t.kernel_median(lambda fam=fam: ops.perturb_many_(items, 1, SIGMA, backend=be, noise=fam), reps)
                per_backend[be].setdefault("families", {})[fam] = {"perturb_ms": f * 1e3, "perturb_vs_copy": copy_s / f}
                report.write()

        report.section(f"families.{be}", families)

    # -- restore="patch" against the copy (docs/architecture.md), last: it builds a second center --------
    def patch_section():
        before = [v.tensor.clone() for v in views]
        pstore = CenterStore(views, pin=device == "cuda", restore="patch")

        def member():
            pstore.perturb(3, SIGMA, 1)
            pstore.restore()

        ms = t.median(member, reps) * 1e3
        st = pstore.patch_stats
        records = st["records"] / max(st["patched"], 1)
        report["patch"] = {
            "member_ms": ms,
            "member_copy_ms": report.get("store", {}).get("member_ms"),
            "patched": st["patched"],
            "copied": st["copied"],
            "records_per_member": records,
            "pcie_bytes_per_param": 2 * ops.patch.RECORD_BYTES * records / numel,
            "exact": all(torch.equal(a, v.tensor) for a, v in zip(before, views)),
        }

    report.section("patch", patch_section)
    return report


def summary(r: dict) -> str:
    """A few short lines, printed last: the device reply may carry only the tail of the output."""
    out = [f"SUMMARY {r.get('device')} | {r.get('tensors')} tensors, {r.get('parameters')} params"]
    c = r.get("ceilings", {})
    if "error" in c or not c:
        out.append(f"ceilings: {c.get('error', 'missing')}")
    else:
        out.append(f"ceilings: copy {c['device_copy_GBps']:.0f} GB/s, pinned h2d {c['pinned_h2d_GBps']:.1f} GB/s")
    for be, b in r.get("backends", {}).items():
        if "error" in b:
            out.append(f"{be}: ERROR {b['error'][:200]}")
            continue
        host = f" (+host {b['perturb_host_ms']:.2f} ms)" if "perturb_host_ms" in b else ""
        upd = f", update N=32 {b['update_n32_ms']:.1f} ms" if "update_n32_ms" in b else ""
        fams = "".join(f", {k} {100 * v['perturb_vs_copy']:.0f}%" for k, v in b.get("families", {}).items())
        out.append(
            f"{be}: perturb {b.get('perturb_ms', float('nan')):.2f} ms{host} "
            f"{100 * b.get('perturb_vs_copy', float('nan')):.0f}% of copy{upd}{fams}"
        )

    def line(name: str, fmt) -> str:  # a section's line, or its error
        d = r.get(name, {})
        return f"{name}: ERROR {d.get('error', 'missing')}" if "error" in d or not d else f"{name}: {fmt(d)}"

    nan = float("nan")
    out.append(
        line(
            "store",
            lambda s: (
                f"restore {s.get('restore_ms', nan):.1f} ms, member {s.get('member_ms', nan):.1f} ms, "
                f"update N=32 {s.get('update_n32_host_s', nan):.2f} s"
            ),
        )
    )
    out.append(
        line(
            "patch",
            lambda p: (
                f"member {p['member_ms']:.1f} ms (copy {p['member_copy_ms'] or nan:.1f} ms), "
                f"{p['records_per_member']:.0f} records/member, {p['pcie_bytes_per_param']:.3f} B/param, "
                f"patched {p['patched']} copied {p['copied']}, exact={p['exact']}"
            ),
        )
    )
    out.append(
        line(
            "cuda_graph",
            lambda g: "; ".join(
                f"{k.split(',')[0]}: captured={v.get('ok')} eager_bits={v.get('replay_matches_eager')}"
                for k, v in g.items()
            ),
        )
    )
    for name, tst in r.get("tests", {}).items():
        if "error" in tst:
            out.append(f"{name}: {tst['error']}")
        else:
            out.append(
                f"{name}: {tst['tests'] - tst['failures'] - tst['errors'] - tst['skipped']} passed, "
                f"{tst['failures'] + tst['errors']} failed {tst['failed'][:3]}, {tst['skipped']} skipped"
            )
    return "\n".join(out) + "\n"


def markdown(r: dict) -> str:
    gb = 1e9
    lines = [
        f"GPU check: {r['device']}; torch {r['torch']}, triton {r['triton']}, espert._C has_cuda={r['has_cuda']}; "
        f"{r['model']}: {r['tensors']} bf16 tensors, {r['parameters']:,} parameters "
        f"({r['weight_bytes'] / gb:.3f} GB).",
        "",
        f"Ceilings (measured): device copy {r['ceilings']['device_copy_GBps']:.0f} GB/s (read + write), "
        f"pinned host-to-device {r['ceilings']['pinned_h2d_GBps']:.1f} GB/s.",
        "",
        "| backend | perturb ms | perturb GB/s | vs copy | update N=32 ms | in perturbs | launches / h2d per call |",
        "|---|---|---|---|---|---|---|",
    ]
    for be, b in r["backends"].items():
        if "error" in b:
            lines.append(f"| {be} | error: {b['error'][:120]} | | | | | |")
            continue
        lines.append(
            f"| {be} | {b['perturb_ms']:.2f} | {b['perturb_GBps']:.0f} | {100 * b['perturb_vs_copy']:.0f}% | "
            f"{b['update_n32_ms']:.1f} | {b['update_n32_in_perturbs']:.1f} | "
            f"{b['perturb_launches']} / {b['perturb_h2d']} |"
        )
    s = r["store"]
    lines += [
        "",
        "| CenterStore | value |",
        "|---|---|",
        f"| host memory | {s['host_bytes'] / gb:.2f} GB ({s['host_bytes_per_param']:.1f} B/param), "
        f"pinned mirror: {s['pinned_mirror']} |",
        f"| restore | {s['restore_ms']:.1f} ms, {s['restore_GBps']:.1f} GB/s = "
        f"{100 * s['restore_vs_pinned_h2d']:.0f}% of pinned h2d |",
        f"| per-member overhead (perturb + restore) | {s['member_ms']:.1f} ms; {s['member_launches']} launches, "
        f"{s['member_h2d']} host-to-device copies |",
        f"| update N=32 (host master) | {s['update_n32_host_s']:.2f} s |",
    ]
    if "update_n32_staged_gpu_s" in s:
        lines.append(f"| update N=32 (staged on the GPU) | {s['update_n32_staged_gpu_s']:.2f} s |")
    if "max_memory_beyond_weights_bytes" in s:
        lines.append(
            f"| max device memory beyond the weights | {s['max_memory_beyond_weights_bytes'] / 2**20:.1f} MiB |"
        )
    p = r.get("patch", {})
    if "member_ms" in p:
        lines.append(
            f'| per-member overhead, restore="patch" | {p["member_ms"]:.1f} ms; {p["records_per_member"]:.0f} '
            f"records ({p['pcie_bytes_per_param']:.3f} B/param over PCIe), exact: {p['exact']} |"
        )
    lines += ["", "| CUDA graph capture | result |", "|---|---|"]
    for name, g in r["cuda_graph"].items():
        res = {True: "captured and replayed", False: f"failed: {g.get('error')}", None: g.get("note")}[g["ok"]]
        if "replay_matches_eager" in g:
            res += f"; output equals eager: {g['replay_matches_eager']}, restored exactly: {g['restored_exactly']}"
        lines.append(f"| {name} | {res} |")
    if r["tests"]:
        lines += ["", "| tests | passed | failed + errors | skipped |", "|---|---|---|---|"]
        for name, s in r["tests"].items():
            if "error" in s:
                lines.append(f"| {name} | {s['error']} | | |")
            else:
                bad = s["failures"] + s["errors"]
                lines.append(f"| {name} | {s['tests'] - bad - s['skipped']} | {bad} | {s['skipped']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--junit", nargs="*", default=[])
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    report = run(a.out, a.dry_run, a.junit)
    report.write()
    try:
        md = markdown(report)
    except Exception as e:  # a failed section leaves holes in the table: the JSON and the summary have it all
        md = f"(no table: {type(e).__name__}: {e}; see gpu_check.json)\n"
    (a.out / "gpu_check.md").write_text(md)
    print(md)
    summ = summary(report)
    (a.out / "gpu_check_summary.txt").write_text(summ)
    print(summ, end="")
    failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    failed += [f"backends.{k}" for k, v in report.get("backends", {}).items() if "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
