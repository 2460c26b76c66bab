"""Weight-space analysis of fine-tuned checkpoints against their base model (``espert analyze --base --ckpt``).

Relative L2 drift overall and per parameter group, the distribution of update magnitudes ``|delta|``, and
export of a checkpoint whose updates ``|delta| <= tau`` are reset to the base (docs/eval.md, section 6).
Everything streams tensor by tensor (large tensors in row chunks): at most one chunk of each model is held
in float64 at a time.  Only safetensors weights are supported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from typing import Iterator, Optional, Sequence

from espert.extras import require

from .diagnose import check_outputs, write_json
from .plots import pyplot, save_figure

#: (group, regex) checked in order against the parameter name; the first match wins.
GROUP_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("norm", re.compile(r"(norm|(^|\.)ln_?[0-9a-z]*\.)", re.I)),
    ("lm_head", re.compile(r"(^|\.)(lm_head|embed_out)(\.|$)")),
    (
        "embeddings",
        re.compile(
            r"(embed_tokens|embed_positions|word_embeddings|position_embeddings|"
            r"token_type_embeddings|tok_embeddings|(^|\.)wte\.|(^|\.)wpe\.)"
        ),
    ),
    ("attn_qkv", re.compile(r"(qkv_proj|query_key_value|c_attn|Wqkv|(^|\.)qkv\.)")),
    ("attn_q", re.compile(r"(q_proj|(^|\.)query\.|(^|\.)wq\.)")),
    ("attn_k", re.compile(r"(k_proj|(^|\.)key\.|(^|\.)wk\.)")),
    ("attn_v", re.compile(r"(v_proj|(^|\.)value\.|(^|\.)wv\.)")),
    ("attn_o", re.compile(r"(o_proj|out_proj|(^|\.)wo\.|attn\.c_proj|attention\.dense|attention\.output\.dense)")),
    (
        "mlp",
        re.compile(
            r"(mlp|feed_forward|ffn|gate_proj|up_proj|down_proj|(^|\.)fc[12]\.|c_fc|"
            r"(^|\.)w[123]\.|experts|intermediate\.dense|output\.dense)"
        ),
    ),
]
GROUPS = ["embeddings", "attn_q", "attn_k", "attn_v", "attn_o", "attn_qkv", "mlp", "norm", "lm_head", "other"]

DEFAULT_TAUS = [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2]
#: log10|delta| histogram edges; counts has len(edges)+1 bins (first: < 1e-10, last: >= 10).
HIST_EDGES = [x / 2 for x in range(-20, 3)]  # -10.0, -9.5, ..., 1.0
CHUNK_ELEMENTS = 1 << 24
WEIGHT_INDEX = "model.safetensors.index.json"
COPY_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".py", ".jinja", ".vocab")


def param_group(name: str) -> str:
    """Parameter group of a tensor name (see :data:`GROUP_PATTERNS`); unknown names -> ``"other"``."""
    for group, pat in GROUP_PATTERNS:
        if pat.search(name):
            return group
    return "other"


class SafetensorsWeights:
    """Lazy, read-only access to the tensors of a safetensors checkpoint.

    ``path`` is a ``.safetensors`` file, or a directory holding ``model.safetensors``,
    a sharded ``model.safetensors.index.json``, or exactly one ``*.safetensors`` file.
    """

    def __init__(self, path: str):
        from safetensors import safe_open

        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint not found: {path}")
        self.path = path
        self.is_dir = os.path.isdir(path)
        self.index_file: Optional[str] = None
        if not self.is_dir:
            if not path.endswith(".safetensors"):
                raise ValueError(f"{path}: only .safetensors weight files are supported")
            files = [path]
        elif os.path.isfile(os.path.join(path, WEIGHT_INDEX)):
            self.index_file = os.path.join(path, WEIGHT_INDEX)
            with open(self.index_file, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
            files = [os.path.join(path, x) for x in dict.fromkeys(wm.values())]
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            files = [os.path.join(path, "model.safetensors")]
        else:
            found = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
            if len(found) != 1:
                other = [x for x in os.listdir(path) if x.endswith((".bin", ".pt", ".pth"))]
                hint = " (found non-safetensors weights %s; re-save with save_pretrained)" % other if other else ""
                raise FileNotFoundError(
                    f"{path}: expected model.safetensors, {WEIGHT_INDEX} or one *.safetensors "
                    f"file, found {found or 'none'}{hint}"
                )
            files = [os.path.join(path, found[0])]
        self.files = files
        self._handles = {}
        self.location: dict[str, str] = {}
        for fp in files:
            if not os.path.isfile(fp):
                raise FileNotFoundError(f"weight shard not found: {fp}")
            h = safe_open(fp, framework="pt")
            self._handles[fp] = h
            for k in h.keys():
                if k in self.location:
                    raise ValueError(f"tensor {k!r} appears in two shards of {path}")
                self.location[k] = fp

    def names(self) -> list[str]:
        """All tensor names, in file order."""
        return list(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor without loading it."""
        return tuple(self._handles[self.location[name]].get_slice(name).get_shape())

    def dtype_str(self, name: str) -> str:
        """safetensors dtype string (``F32``, ``BF16``...) without loading the tensor."""
        return self._handles[self.location[name]].get_slice(name).get_dtype()

    def get(self, name: str):
        """Load one tensor (its stored dtype)."""
        return self._handles[self.location[name]].get_tensor(name)

    def chunks(self, name: str, rows: int) -> Iterator:
        """Yield the tensor in slices of ``rows`` along dim 0 (the whole tensor if 0-d/1-chunk)."""
        shp = self.shape(name)
        if len(shp) == 0 or shp[0] <= rows:
            yield self.get(name)
            return
        sl = self._handles[self.location[name]].get_slice(name)
        for a in range(0, shp[0], rows):
            yield sl[a : a + rows]


def _rows_per_chunk(shape: Sequence[int]) -> int:
    per_row = 1
    for s in shape[1:]:
        per_row *= s
    return max(1, CHUNK_ELEMENTS // max(1, per_row))


def _check_compatible(base: SafetensorsWeights, ckpt: SafetensorsWeights) -> list[str]:
    bn, cn = set(base.names()), set(ckpt.names())
    only_b, only_c = sorted(bn - cn), sorted(cn - bn)
    if only_b or only_c:
        parts = []
        if only_c:
            parts.append(f"tensor {only_c[0]!r} (and {len(only_c) - 1} more) only in checkpoint {ckpt.path}")
        if only_b:
            parts.append(f"tensor {only_b[0]!r} (and {len(only_b) - 1} more) only in base {base.path}")
        raise ValueError("base and checkpoint have different tensors: " + "; ".join(parts))
    names = ckpt.names()
    for n in names:
        if base.shape(n) != ckpt.shape(n):
            raise ValueError(
                f"tensor {n!r}: shape {list(ckpt.shape(n))} in checkpoint {ckpt.path} "
                f"but {list(base.shape(n))} in base {base.path}"
            )
    return names


def _new_acc() -> dict:
    return {"base_sq": 0.0, "delta_sq": 0.0, "numel": 0, "n_changed": 0, "max_abs": 0.0}


def _finish(acc: dict) -> dict:
    base_l2 = math.sqrt(acc["base_sq"])
    delta_l2 = math.sqrt(acc["delta_sq"])
    return {
        "rel_l2": (delta_l2 / base_l2) if base_l2 > 0 else (0.0 if delta_l2 == 0 else math.inf),
        "delta_l2": delta_l2,
        "base_l2": base_l2,
        "numel": acc["numel"],
        "n_changed": acc["n_changed"],
        "frac_changed": acc["n_changed"] / acc["numel"] if acc["numel"] else 0.0,
        "max_abs_update": acc["max_abs"],
    }


def compute_drift(
    base_path: str, ckpt_path: str, taus: Sequence[float] = DEFAULT_TAUS, per_tensor: bool = True
) -> dict:
    """Drift and update-magnitude statistics of one checkpoint against the base.

    Returns a dict with ``overall`` and ``groups`` (each: ``rel_l2``, ``delta_l2``,
    ``base_l2``, ``numel``, ``n_changed``, ``frac_changed``, ``max_abs_update``),
    ``update_magnitudes`` (``share_le_tau``: fraction of *changed* weights with
    ``|delta| <= tau``; ``histogram`` of log10|delta| over changed weights) and,
    optionally, ``per_tensor`` rows. Raises ``ValueError`` on mismatched names/shapes.
    """
    import torch

    taus = sorted(float(t) for t in taus)
    if any(not t >= 0 for t in taus):
        raise ValueError(f"taus must be >= 0, got {taus}")
    base = SafetensorsWeights(base_path)
    ckpt = SafetensorsWeights(ckpt_path)
    names = _check_compatible(base, ckpt)
    overall = _new_acc()
    groups: dict[str, dict] = {}
    le_tau = [0] * len(taus)
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64)
    hist = torch.zeros(len(HIST_EDGES) + 1, dtype=torch.int64)
    rows_out = []
    for name in names:
        g = param_group(name)
        acc_g = groups.setdefault(g, _new_acc())
        acc_t = _new_acc()
        rows = _rows_per_chunk(ckpt.shape(name))
        for b, c in zip(base.chunks(name, rows), ckpt.chunks(name, rows)):
            stats, vals = _chunk_drift(b, c)
            for acc in (overall, acc_g, acc_t):
                for k in ("base_sq", "delta_sq", "numel", "n_changed"):
                    acc[k] += stats[k]
                acc["max_abs"] = max(acc["max_abs"], stats["max_abs"])
            if stats["n_changed"]:
                for i, t in enumerate(taus):
                    le_tau[i] += int((vals <= t).sum())
                hist += torch.bincount(
                    torch.bucketize(torch.log10(vals), edges, right=True), minlength=len(HIST_EDGES) + 1
                )
            del vals
        if per_tensor:
            row = _finish(acc_t)
            row.update(name=name, group=g, shape=list(ckpt.shape(name)), dtype=ckpt.dtype_str(name))
            rows_out.append(row)
    result = {
        "base": base_path,
        "checkpoint": ckpt_path,
        "warnings": _dtype_warnings(base, ckpt, names),
        "overall": _finish(overall),
        "groups": {g: _finish(groups[g]) for g in GROUPS if g in groups},
        "update_magnitudes": _update_magnitudes(taus, le_tau, overall["n_changed"], hist.tolist()),
    }
    if per_tensor:
        result["per_tensor"] = rows_out
    return result


def _chunk_drift(b, c) -> tuple[dict, object]:
    """(sums of one base/checkpoint chunk pair, |delta| of its changed elements), in float64."""
    import torch

    b64 = b.to(torch.float64)
    d = c.to(torch.float64) - b64
    absd = d.abs()
    vals = absd[absd > 0]
    stats = {
        "base_sq": float((b64 * b64).sum()),
        "delta_sq": float((d * d).sum()),
        "numel": d.numel(),
        "n_changed": vals.numel(),
        "max_abs": float(vals.max()) if vals.numel() else 0.0,
    }
    return stats, vals


def _update_magnitudes(taus: list[float], le_tau: list[int], n_changed: int, counts: list[int]) -> dict:
    """The ``update_magnitudes`` section: changed weights with ``|delta| <= tau`` and the log10 histogram."""
    return {
        "taus": taus,
        "n_le_tau": {repr(t): le_tau[i] for i, t in enumerate(taus)},
        "share_le_tau": {repr(t): (le_tau[i] / n_changed if n_changed else 0.0) for i, t in enumerate(taus)},
        "histogram": {
            "log10_edges": HIST_EDGES,
            "counts": counts,
            "note": "bin 0: |delta| < 1e-10; bin i: edges[i-1] <= log10|delta| < edges[i]; "
            "last: >= 10; only changed weights",
        },
    }


_WIDTH = {"F64": 64, "F32": 32, "BF16": 16, "F16": 16, "F8_E4M3": 8, "F8_E5M2": 8}


def _dtype_warnings(base: SafetensorsWeights, ckpt: SafetensorsWeights, names: Sequence[str]) -> list[str]:
    """A warning when checkpoint tensors are stored in a narrower float type than the base's:
    rounding to that dtype then counts as drift (a bf16 copy of an fp32 base "changes" most weights)."""
    narrower: dict[tuple[str, str], int] = {}
    for n in names:
        b, c = base.dtype_str(n), ckpt.dtype_str(n)
        if b != c and _WIDTH.get(c, 99) < _WIDTH.get(b, 0):
            narrower[(b, c)] = narrower.get((b, c), 0) + 1
    return [
        f"{cnt} tensor(s) are {c} in the checkpoint but {b} in the base: {c} rounding counts as change "
        f"(compare against a base in the checkpoint's dtype to see the training drift alone)"
        for (b, c), cnt in narrower.items()
    ]


def _check_output_dir(out_dir: str, inputs: Sequence[str], force: bool) -> None:
    out_real = os.path.realpath(out_dir)
    for p in inputs:
        real = os.path.realpath(p)
        # A directory input may not contain the export; a bare-file input's folder may not be the export.
        if os.path.isdir(real):
            clash = out_real == real or out_real.startswith(real + os.sep)
        else:
            clash = out_real == os.path.dirname(real) or out_real == real
        if clash:
            raise ValueError(f"refusing to write the export into input location {p!r}; choose another --export dir")
        if os.path.isdir(real) and real.startswith(out_real + os.sep):
            raise ValueError(f"input {p!r} lies inside the export dir {out_dir!r}; choose another --export dir")
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ValueError(f"export path {out_dir!r} exists and is not a directory")
        if os.listdir(out_dir) and not force:
            raise FileExistsError(f"export dir {out_dir!r} exists and is not empty (use --force to write into it)")


def export_thresholded(base_path: str, ckpt_path: str, out_dir: str, tau: float, force: bool = False) -> dict:
    """Write a copy of the checkpoint with every update ``|delta| <= tau`` reset to the base value.

    Names, dtypes and shard layout follow the checkpoint; config/tokenizer files (:data:`COPY_SUFFIXES`) are
    copied (docs/eval.md, section 6).  Refuses an input location, and a non-empty ``out_dir`` unless ``force``
    (then its stale ``*.safetensors``/index files are removed first).  Returns the counts ``numel``,
    ``n_changed`` (updates in the checkpoint), ``n_reset`` (updates reset to base) and ``n_kept``.
    """
    import torch
    from safetensors.torch import save_file

    if not (tau >= 0 and math.isfinite(tau)):
        raise ValueError(f"threshold tau must be a finite number >= 0, got {tau}")
    base = SafetensorsWeights(base_path)
    ckpt = SafetensorsWeights(ckpt_path)
    _check_compatible(base, ckpt)
    _check_output_dir(out_dir, [base_path, ckpt_path], force)
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f == WEIGHT_INDEX:
            os.remove(os.path.join(out_dir, f))
    counts = {"numel": 0, "n_changed": 0, "n_reset": 0}
    for fp in ckpt.files:
        h = ckpt._handles[fp]
        out: dict = {}
        for name in h.keys():
            b, c = base.get(name), h.get_tensor(name)
            d = (c.to(torch.float64) - b.to(torch.float64)).abs()
            reset = d <= tau
            changed = d > 0
            counts["numel"] += c.numel()
            counts["n_changed"] += int(changed.sum())
            counts["n_reset"] += int((reset & changed).sum())
            out[name] = torch.where(reset, b.to(c.dtype), c).contiguous()
            del b, c, d, reset, changed
        meta = h.metadata() or {}
        meta.setdefault("format", "pt")
        name_out = os.path.basename(fp) if ckpt.is_dir else "model.safetensors"
        save_file(out, os.path.join(out_dir, name_out), metadata=meta)
        del out
    if ckpt.index_file:
        shutil.copyfile(ckpt.index_file, os.path.join(out_dir, WEIGHT_INDEX))
    src_dir = ckpt.path if ckpt.is_dir else (base.path if base.is_dir else None)
    copied = []
    if src_dir:
        for f in sorted(os.listdir(src_dir)):
            full = os.path.join(src_dir, f)
            if os.path.isfile(full) and f.endswith(COPY_SUFFIXES) and f != WEIGHT_INDEX:
                shutil.copyfile(full, os.path.join(out_dir, f))
                copied.append(f)
    counts["n_kept"] = counts["n_changed"] - counts["n_reset"]
    return {"out_dir": out_dir, "tau": tau, "copied_files": copied, **counts}


def format_drift_summary(label: str, res: dict) -> str:
    """A few readable lines for one checkpoint's drift result."""
    o, um = res["overall"], res["update_magnitudes"]
    groups = (f"{g} {v['rel_l2']:.2e}" if v["n_changed"] else f"{g} 0 (unchanged)" for g, v in res["groups"].items())
    shares = (f"{t:g}: {um['share_le_tau'][repr(t)]:.3f}" for t in um["taus"])
    head = (
        f"{label}: rel L2 drift {o['rel_l2']:.3e} (|delta| {o['delta_l2']:.3e} / |theta0| {o['base_l2']:.3e}), "
        f"{o['n_changed']}/{o['numel']} weights changed ({100 * o['frac_changed']:.1f}%), "
        f"max |delta| {o['max_abs_update']:.3e}"
    )
    warnings = [f"  warning: {w}" for w in res.get("warnings", [])]
    shared = "  share of changed weights with |delta| <= tau: " + ", ".join(shares)
    return "\n".join([head, "  per group: " + ", ".join(groups), *warnings, shared])


def plot_drift(results: dict[str, dict], out_dir: str) -> list[str]:
    """Write ``drift_groups.png`` (per-group relative drift) and ``update_hist.png`` (log10|delta|)."""
    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    return [_plot_groups(plt, results, out_dir), _plot_update_hist(plt, results, out_dir)]


def _plot_groups(plt, results: dict[str, dict], out_dir: str) -> str:
    labels = list(results)
    groups = [g for g in GROUPS if any(g in r["groups"] for r in results.values())]
    width = min(11.0, max(6.0, 0.45 * len(groups) * (1 + len(labels)) + 1.5))
    fig, ax = plt.subplots(figsize=(width, 4), dpi=120)
    w = 0.8 / max(1, len(labels))
    zero = []  # (x, label) of groups with exactly zero drift: an empty bar would look like missing data
    for i, lab in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * w for j in range(len(groups))]
        vals = [results[lab]["groups"].get(g, {}).get("rel_l2", 0.0) for g in groups]
        bars = ax.bar(xs, vals, width=w, label=lab)
        zero += [
            (x, bars.patches[0].get_facecolor())
            for x, v, g in zip(xs, vals, groups)
            if v == 0 and g in results[lab]["groups"]
        ]
    mark = dict(xycoords=("data", "axes fraction"), xytext=(0, 3), textcoords="offset points", ha="center")
    for x, color in zero:
        ax.annotate("0", (x, 0), **mark, va="bottom", fontsize=8, fontweight="bold", color=color)
    if zero:
        ax.text(
            0.99, 0.98, "0 = group unchanged (zero drift)", transform=ax.transAxes, ha="right", va="top", fontsize=7
        )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right")
    positive = [r["groups"][g]["rel_l2"] for r in results.values() for g in r["groups"] if r["groups"][g]["rel_l2"] > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_yscale("log")  # groups differ by orders of magnitude
    ax.set_ylabel("relative L2 drift  ||Δθ|| / ||θ0||")
    ax.set_title("Per-group relative drift")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, os.path.join(out_dir, "drift_groups.png"))


def _plot_update_hist(plt, results: dict[str, dict], out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    edges = HIST_EDGES
    centers = [edges[0] - 0.25] + [(edges[i - 1] + edges[i]) / 2 for i in range(1, len(edges))] + [edges[-1] + 0.25]
    for lab in results:
        counts = results[lab]["update_magnitudes"]["histogram"]["counts"]
        tot = sum(counts) or 1
        ax.step(centers, [c / tot for c in counts], where="mid", label=lab)
    ax.set_xlabel("log10 |Δθ|  (changed weights only; ends are open bins)")
    ax.set_ylabel("share of changed weights")
    ax.set_title("Update magnitude distribution")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, os.path.join(out_dir, "update_hist.png"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``espert analyze`` (shared by the stand-alone and the espert CLI)."""
    p.add_argument("--base", help="base model dir or .safetensors file (drift)")
    p.add_argument("--ckpt", nargs="+", metavar="[LABEL=]PATH", help="checkpoint dir(s)/file(s) (drift)")
    p.add_argument(
        "--taus",
        nargs="+",
        type=float,
        default=DEFAULT_TAUS,
        help="thresholds for the |delta| <= tau shares (default 1e-7 ... 1e-2)",
    )
    p.add_argument("--json", metavar="FILE", help="write the full analysis as JSON")
    p.add_argument("--plot-dir", metavar="DIR", help="write drift_groups.png and update_hist.png here")
    p.add_argument("--no-per-tensor", action="store_true", help="leave per-tensor rows out of the JSON")
    p.add_argument("--export", metavar="DIR", help="export a thresholded copy of the (single) checkpoint here")
    p.add_argument("--threshold", type=float, metavar="TAU", help="with --export: reset updates with |delta| <= TAU")
    p.add_argument("--force", action="store_true", help="allow --export into an existing non-empty dir")


def _parse_ckpts(specs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in specs:
        label, path = s.split("=", 1) if "=" in s and not os.path.exists(s) else (None, s)
        label = label or os.path.basename(os.path.normpath(path))
        if label in out:
            raise ValueError(f"checkpoint label {label!r} given twice")
        out[label] = path
    return out


def run_analyze(args: argparse.Namespace) -> int:
    """Entry point of ``espert analyze`` (returns a process exit code; 2 on bad input)."""
    try:
        if args.plot_dir:
            require("matplotlib", "--plot-dir")
        check_outputs(args)
        if not args.base or not args.ckpt:
            raise ValueError(
                "give a run directory (espert analyze RUN_DIR), or --base and --ckpt (drift), or a "
                "sub-command (run, estimator)"
            )
        ckpts = _parse_ckpts(args.ckpt)
        if args.export and len(ckpts) != 1:
            raise ValueError("--export needs exactly one --ckpt")
        if args.export and args.threshold is None:
            raise ValueError("--export needs --threshold TAU")
        if args.export:  # fail before the (possibly long) drift pass
            _check_output_dir(args.export, [args.base, *ckpts.values()], args.force)
        results = {}
        for label, path in ckpts.items():
            results[label] = res = compute_drift(args.base, path, args.taus, per_tensor=not args.no_per_tensor)
            print(format_drift_summary(label, res))
            for w in res["warnings"]:
                print(f"espert analyze: warning: {label}: {w}", file=sys.stderr)
        report = {"base": args.base, "checkpoints": results}
        if args.export:
            ((label, path),) = ckpts.items()
            from espert.files import writing_into

            with writing_into(args.export):  # an export into a run directory: one writer at a time
                ex = export_thresholded(args.base, path, args.export, args.threshold, force=args.force)
            report["export"] = ex
            print(
                f"exported {label} with |delta| <= {args.threshold:g} reset to base -> {args.export} "
                f"({ex['n_reset']} of {ex['n_changed']} changed weights reset, {ex['n_kept']} kept)"
            )
        if args.json:
            write_json(args.json, report)
        if args.plot_dir:
            for p in plot_drift(results, args.plot_dir):
                print(f"wrote {p}")
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"espert analyze: error: {e}", file=sys.stderr)
        return 2
    return 0
