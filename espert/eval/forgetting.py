"""``espert forgetting``: what fine-tuning cost the model outside its task, in one command.

Four measures of every model against the base, in one report (``forgetting.md``, ``.json``, ``.png``):

1. prior-task accuracy on generation tasks (``--task``, as ``espert eval`` takes them): pass@1, pass@K and
   maj@K per model and their change against the base (:func:`espert.eval.report.forgetting`);
2. prior-task accuracy on multiple choice by log-likelihood (``--mc``; :mod:`espert.eval.mc`): acc, acc_norm;
3. token-level KL(base ‖ model) on a fixed probe set: prompts from the tasks above, each followed by the
   base's greedy continuation, in float64 over the whole vocabulary at every continuation position;
4. the update geometry of θ − θ₀: ‖θ − θ₀‖ per layer, the share of weights moved by more than
   ``--threshold``, and the effective and stable rank of the update of a few matrices.

Definitions, and the models it takes: docs/eval.md, "The forgetting panel".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Optional, Sequence

from espert.tasks import load_spec_task
from espert.tasks.base import chat_prompt

from .analyze import SafetensorsWeights, compute_drift
from .mc import BUILTIN_MC, TEMPLATE, load_mc, score_mc
from .plots import pyplot, save_figure
from .report import forgetting
from .runner import parse_model_specs, write_outputs
from .samplers import is_ensemble, make_sampler, model_dir
from .samples import save_samples

#: A decoder layer's index in a parameter name (the per-layer ‖θ − θ₀‖ groups by it).
LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


# ---- models, tasks, probe --------------------------------------------------------------------------------


def resolve_models(specs: Sequence[str]) -> dict[str, str]:
    """``LABEL=PATH`` -> {label: local model directory}: GGUF files and named models converted, run directories
    as their export; a RandOpt ensemble is refused (it is K models)."""
    from espert.runs import resolve_model_dir
    from espert.runs.gguf import gguf_path

    models = parse_model_specs(specs)
    for label, path in models.items():
        if is_ensemble(path):
            raise ValueError(
                f"{label}: {path} is a RandOpt ensemble (K models); export one with espert replay --member"
            )
        gguf = gguf_path(path)
        path = resolve_model_dir(gguf, lambda s: print(s, file=sys.stderr)) if gguf else model_dir(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory not found for {label!r}: {path}")
        models[label] = path
    return models


def load_tasks(specs: Sequence[str], limit: Optional[int], split: str = "test") -> list[tuple[str, object]]:
    """``TASK`` or ``TASK=JSONL`` -> [(label, Task)], every task loaded before anything is sampled."""
    out, seen = [], set()
    for spec in specs:
        name, _, path = spec.partition("=")
        if path and not os.path.isfile(path):
            raise FileNotFoundError(f"problems file of task {name!r} not found: {path}")
        label = f"{name}:{os.path.splitext(os.path.basename(path))[0]}" if path else name
        if label in seen:
            raise ValueError(f"task {label!r} is given twice")
        seen.add(label)
        task = load_spec_task(name, split, n=limit, path=path or None)
        if task is None or len(task) == 0:
            raise ValueError(f"task {spec!r} has no {split!r} problems")
        out.append((label, task))
    return out


def load_mc_sets(specs: Sequence[str], limit: Optional[int]) -> list[tuple[str, list, str, str]]:
    """``NAME`` (a built-in set, :data:`espert.eval.mc.BUILTIN_MC`) or ``LABEL=FILE`` -> [(label, items,
    template, separator)]."""
    out = []
    for spec in specs:
        label, eq, path = spec.partition("=")
        if eq:
            out.append((label, load_mc(path, limit), TEMPLATE, " "))
        elif label in BUILTIN_MC:
            make, template, sep = BUILTIN_MC[label]
            out.append((label, make(limit or 64), template, sep))
        else:
            raise ValueError(f"--mc {spec!r}: a built-in set ({', '.join(BUILTIN_MC)}) or LABEL=FILE")
    return out


def probe_prompts(tasks, mc_sets, n: int) -> list[str]:
    """n prompts taken in turn from the generation tasks and the MC questions (the KL probe set)."""
    pools = [list(t.prompts) for _, t in tasks] + [[it.question for it in items] for _, items, _, _ in mc_sets]
    out, i = [], 0
    while len(out) < n and any(i < len(p) for p in pools):
        out += [p[i] for p in pools if i < len(p)][: n - len(out)]
        i += 1
    if not out:
        raise ValueError("the KL probe needs prompts: give --task or --mc")
    return out


# ---- KL(base || model) -----------------------------------------------------------------------------------


def probe_sequences(model, tok, prompts: Sequence[str], tokens: int, chat_template: bool) -> list[tuple[list, list]]:
    """(prompt ids, the base's greedy continuation ids) of every probe prompt."""
    import torch

    out = []
    for p in prompts:
        text = chat_prompt(tok, p) if chat_template else p
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            seq = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append((ids[0].tolist(), seq[0, ids.shape[1] :].tolist()))
    return out


def token_kl(base, model, sequences, batch_size: int = 8) -> dict:
    """KL(base ‖ model) at every continuation position of ``sequences`` (float64 over the vocabulary):
    ``{"mean", "prompt_mean", "per_position", "n_tokens"}`` (module docstring, 3)."""
    import torch

    per_prompt, positions = [], []
    for i in range(0, len(sequences), batch_size):
        chunk = [s for s in sequences[i : i + batch_size] if s[1]]
        if not chunk:
            continue
        width = max(len(p) + len(c) for p, c in chunk)
        ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in chunk])
        mask = torch.tensor([[1] * (len(p) + len(c)) + [0] * (width - len(p) - len(c)) for p, c in chunk])
        with torch.inference_mode():
            lb = base(input_ids=ids, attention_mask=mask).logits.double().log_softmax(-1)
            lm = model(input_ids=ids, attention_mask=mask).logits.double().log_softmax(-1)
        kl = (lb.exp() * (lb - lm)).sum(-1)  # [B, width]
        for row, (p, c) in enumerate(chunk):
            k = kl[row, len(p) - 1 : len(p) + len(c) - 1].tolist()  # the positions that predict c
            per_prompt.append(k)
    for j in range(max((len(k) for k in per_prompt), default=0)):
        at = [k[j] for k in per_prompt if len(k) > j]
        positions.append(sum(at) / len(at))
    total = [x for k in per_prompt for x in k]
    return {
        "mean": sum(total) / len(total) if total else 0.0,
        "prompt_mean": sum(sum(k) / len(k) for k in per_prompt) / len(per_prompt) if per_prompt else 0.0,
        "per_position": positions,
        "n_tokens": len(total),
        "n_prompts": len(per_prompt),
    }


# ---- update geometry -------------------------------------------------------------------------------------


def rank_matrices(names: Sequence[str], count: int) -> list[str]:
    """The query and down projections of the first and last layers (then the middle ones), ``count`` of them."""
    layers = sorted({int(m.group(1)) for n in names if (m := LAYER_RE.search(n))})
    order = [layers[0], layers[-1]] + layers[1:-1] if len(layers) > 1 else layers
    pick = []
    for layer in order:
        for kind in ("self_attn.q_proj.weight", "mlp.down_proj.weight"):
            name = next((n for n in names if n.endswith(f".layers.{layer}.{kind}")), None)
            if name and name not in pick:
                pick.append(name)
    return pick[:count]


def effective_rank(delta) -> dict:
    """Effective rank exp(H(s/Σs)) and stable rank ‖Δ‖_F²/‖Δ‖_2² of a matrix update (float64 SVD)."""
    import torch

    s = torch.linalg.svdvals(delta.double())
    if float(s.sum()) == 0:
        return {"effective_rank": 0.0, "stable_rank": 0.0, "top1_energy": 0.0}
    p = s / s.sum()
    h = -float((p[p > 0] * p[p > 0].log()).sum())
    e = s * s
    return {"effective_rank": math.exp(h), "stable_rank": float(e.sum() / e[0]), "top1_energy": float(e[0] / e.sum())}


def update_geometry(base_dir: str, model_dir: str, threshold: float, n_rank: int) -> dict:
    """‖θ − θ₀‖ overall and per layer, the fraction of weights moved by more than ``threshold``, and the
    effective rank of the update of ``n_rank`` matrices (module docstring, 4)."""
    drift = compute_drift(base_dir, model_dir, taus=[threshold], per_tensor=True)
    per_layer: dict[str, float] = {}
    for row in drift["per_tensor"]:
        m = LAYER_RE.search(row["name"])
        key = m.group(1) if m else ("embed/lm_head" if "embed" in row["name"] or "lm_head" in row["name"] else "other")
        per_layer[key] = per_layer.get(key, 0.0) + row["delta_l2"] ** 2
    ov = drift["overall"]
    beyond = ov["n_changed"] - drift["update_magnitudes"]["n_le_tau"][repr(float(threshold))]
    b, c = SafetensorsWeights(base_dir), SafetensorsWeights(model_dir)
    ranks = {n: effective_rank(c.get(n).double() - b.get(n).double()) for n in rank_matrices(b.names(), n_rank)}
    return {
        "delta_l2": ov["delta_l2"],
        "rel_l2": ov["rel_l2"],
        "frac_changed": ov["frac_changed"],
        "threshold": threshold,
        "frac_beyond_threshold": beyond / ov["numel"] if ov["numel"] else 0.0,
        "per_layer_l2": {k: math.sqrt(per_layer[k]) for k in sorted(per_layer, key=_layer_key)},
        "rank": ranks,
    }


def _layer_key(k: str):
    return (0, int(k)) if k.isdigit() else (1, k)


# ---- the panel -------------------------------------------------------------------------------------------


def generation_panel(args, tasks, models: dict[str, str], base: str) -> tuple[dict, str]:
    """Sample every model on every generation task (a report per task in OUT/TASK/); the forgetting table."""
    from .runner import generate_samples  # looked up here: tests stop a call at it

    reports = {}
    for label, task in tasks:
        out, groups = os.path.join(args.out, "tasks", re.sub(r"[^\w.-]", "_", label)), {}
        os.makedirs(out, exist_ok=True)
        for m, path in models.items():
            print(f"[espert forgetting] {label}: sampling {m} ({len(task)} problems x {args.n})", file=sys.stderr)
            kw = {"batch_size": 64, "device": "cpu"} if args.evaluator == "torch" else {}
            sampler = make_sampler(args.evaluator, path, chat_template=args.chat_template, dtype="float32", **kw)
            try:
                recs = generate_samples(
                    task, m, sampler, args.n, args.temperature, 1.0, args.max_new_tokens, args.seed,
                    extra_meta={"model_path": path},
                )  # fmt: skip
            finally:
                getattr(sampler, "close", lambda: None)()
            save_samples(os.path.join(out, f"samples_{m}.jsonl"), recs)
            groups[m] = recs
        threshold = task.success_threshold
        reports[label] = write_outputs(groups, out, base, threshold, "any", plots=False, echo=lambda s: None)
    return forgetting(reports, base) if reports else ({"base": base, "tasks": {}}, "")


def model_panel(args, tasks, mc_sets, models: dict[str, str], base: str) -> dict:
    """Per model, with torch on the CPU: the MC sets' accuracies, KL(base ‖ model) on the probe set and the
    update geometry against the base."""
    from espert.evaluators import load_model

    ref, tok = load_model(models[base])
    tok.padding_side = "right"
    prompts = probe_prompts(tasks, mc_sets, args.probe_prompts)
    seqs = probe_sequences(ref, tok, prompts, args.probe_tokens, args.chat_template)
    out = {"mc": {label: {} for label, *_ in mc_sets}, "kl": {}, "geometry": {}}
    for m, path in models.items():
        print(f"[espert forgetting] {m}: multiple choice, KL, geometry", file=sys.stderr)
        model = ref if m == base else load_model(path)[0]
        for label, items, template, sep in mc_sets:
            res = score_mc(model, tok, items, template, sep)
            out["mc"][label][m] = {k: res[k] for k in ("acc", "acc_norm", "n")}
        out["kl"][m] = token_kl(ref, model, seqs)
        if m != base:
            out["geometry"][m] = update_geometry(models[base], path, args.threshold, args.rank_matrices)
        del model
    for label in out["mc"]:
        ref_acc = out["mc"][label][base]
        for m, r in out["mc"][label].items():
            r["change"] = {k: r[k] - ref_acc[k] for k in ("acc", "acc_norm")}
    out["probe"] = {"prompts": len(prompts), "tokens": args.probe_tokens, "chat_template": args.chat_template}
    return out


def report_text(doc: dict, gen_text: str) -> str:
    """forgetting.md: the four measures as tables."""
    base, models = doc["base"], list(doc["models"])
    lines = [f"# Forgetting: {', '.join(models)} against `{base}`", ""]
    lines += ["## Prior tasks, generation (espert eval; d = change against the base)", "", "```", gen_text or "(none)"]
    lines += ["```", "", "## Prior tasks, multiple choice by log-likelihood: acc (acc_norm)", ""]
    lines += ["| set | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for label, per in doc["mc"].items():
        cells = [f"{per[m]['acc']:.3f} ({per[m]['acc_norm']:.3f})" + ("" if m == base else f" {per[m]['change']['acc']:+.3f}") for m in models]  # fmt: skip
        lines.append(f"| {label} (n={per[base]['n']}) | " + " | ".join(cells) + " |")
    p = doc["probe"]
    lines += ["", f"## KL(base ‖ model), nats per token: {p['prompts']} probe prompts × the base's greedy "
              f"continuation (≤ {p['tokens']} tokens)", "", "| model | mean per token | mean per prompt | first "
              "position | last position |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for m, k in doc["kl"].items():
        pos = k["per_position"] or [0.0]
        lines.append(f"| {m} | {k['mean']:.3e} | {k['prompt_mean']:.3e} | {pos[0]:.3e} | {pos[-1]:.3e} |")
    lines += ["", "## Update geometry (θ − θ₀)", "", "| model | ‖Δθ‖ | ‖Δθ‖/‖θ₀‖ | share moved | share > τ | "
              "effective rank (stable rank) of ΔW |", "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for m, g in doc["geometry"].items():
        ranks = ", ".join(
            f"{_short(n)} {r['effective_rank']:.1f} ({r['stable_rank']:.1f})" for n, r in g["rank"].items()
        )
        lines.append(f"| {m} | {g['delta_l2']:.3e} | {g['rel_l2']:.3e} | {g['frac_changed']:.3f} | "
                     f"{g['frac_beyond_threshold']:.3f} (τ={g['threshold']:g}) | {ranks} |")  # fmt: skip
    return "\n".join(lines + ["", "![forgetting panel](forgetting.png)", ""])


def _short(name: str) -> str:
    m = LAYER_RE.search(name)
    return f"L{m.group(1)}.{name.split('.')[-2]}" if m else name


def plot_panel(doc: dict, path: str) -> str:
    """forgetting.png: accuracy changes, KL per position, ‖Δθ‖ per layer and the updates' effective ranks."""
    plt = pyplot()
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    others = [m for m in doc["models"] if m != doc["base"]]
    sets = [(f"{t}", d["models"]) for t, d in doc["generation"]["tasks"].items()]
    labels = [t for t, _ in sets] + list(doc["mc"])
    width = 0.8 / max(1, len(others))
    for i, m in enumerate(others):
        vals = [d[m]["change"]["pass_at_1"] or 0.0 for _, d in sets]
        vals += [mc[m]["change"]["acc"] for mc in doc["mc"].values()]
        ax[0, 0].bar([j + 0.8 * i / max(1, len(others)) for j in range(len(labels))], vals, width, label=m)
    ax[0, 0].set_xticks(range(len(labels)), labels, rotation=20, fontsize=7)
    ax[0, 0].axhline(0, color="k", lw=0.5)
    ax[0, 0].set_title("change against the base (pass@1; MC acc)")
    for m in others:
        ax[0, 1].plot(doc["kl"][m]["per_position"], label=m)
        layers = {k: v for k, v in doc["geometry"][m]["per_layer_l2"].items() if k.isdigit()}
        ax[1, 0].plot(list(layers), list(layers.values()), marker=".", label=m)
        ranks = doc["geometry"][m]["rank"]
        ax[1, 1].plot([_short(n) for n in ranks], [r["effective_rank"] for r in ranks.values()], marker="o", label=m)
    titles = ["KL(base || model) per continuation position (nats)", "||θ − θ0|| per layer", "effective rank of ΔW"]
    for a, t in zip((ax[0, 1], ax[1, 0], ax[1, 1]), titles):
        a.set_title(t)
    for a in ax.flat:
        a.legend(fontsize=7)
    return save_figure(fig, path)


def run_forgetting(args: argparse.Namespace) -> dict:
    """The whole panel; writes OUT/forgetting.{md,json,png} and returns the document."""
    from espert.files import atomic_write_text

    if not args.task and not args.mc:
        raise ValueError("give --task and/or --mc: the prior tasks to measure")
    models = resolve_models(args.models)
    base = args.base or next(iter(models))
    if base not in models:
        raise ValueError(f"--base {base!r} is not among the models ({', '.join(models)})")
    tasks, mc_sets = load_tasks(args.task or [], args.limit), load_mc_sets(args.mc or [], args.limit)
    os.makedirs(args.out, exist_ok=True)
    gen_doc, gen_text = generation_panel(args, tasks, models, base)
    doc = {"base": base, "models": models, "generation": gen_doc, **model_panel(args, tasks, mc_sets, models, base)}
    doc["settings"] = {k: v for k, v in vars(args).items() if k != "func"}
    atomic_write_text(os.path.join(args.out, "forgetting.json"), json.dumps(doc, indent=2) + "\n")
    text = report_text(doc, gen_text)
    atomic_write_text(os.path.join(args.out, "forgetting.md"), text)
    if len(models) > 1:
        plot_panel(doc, os.path.join(args.out, "forgetting.png"))
    print(text)
    return doc


def add_forgetting_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``espert forgetting`` to an argparse ``subparsers`` object; sets ``func``."""
    p = subparsers.add_parser(
        "forgetting",
        help="what fine-tuning cost outside the task: prior-task accuracy (generation and multiple choice by "
        "log-likelihood), token KL against the base, update geometry; one report",
        description=__doc__.split("\n\n")[0] + " See docs/eval.md.",
    )
    p.add_argument("--models", nargs="+", required=True, metavar="LABEL=PATH", help="the base and the tuned models")
    p.add_argument("--base", metavar="LABEL", help="the reference model (default: the first)")
    p.add_argument("--task", nargs="*", metavar="TASK[=JSONL]", help="generation tasks, as espert eval --task")
    p.add_argument("--mc", nargs="*", metavar="NAME|LABEL=FILE", help="multiple-choice sets (multiplication_mc, "
                   "humaneval_mc, or a JSONL/parquet file in lm-eval's or es-awd's layout)")  # fmt: skip
    p.add_argument("--limit", type=int, help="problems / items per task (default: all; built-in MC sets: 64)")
    p.add_argument("-n", "--n", type=int, default=1, help="samples per problem (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument("--max-new-tokens", type=int, default=32, help="generation budget (default 32)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--evaluator", choices=["torch", "vllm"], default="torch", help="generation engine (default: torch)")
    p.add_argument(
        "--chat-template", action="store_true", help="wrap generation and probe prompts in the chat template"
    )
    p.add_argument("--probe-prompts", type=int, default=32, help="KL probe prompts (default 32)")
    p.add_argument("--probe-tokens", type=int, default=32, help="the base's greedy continuation per probe (default 32)")
    p.add_argument("--threshold", type=float, default=1e-5, help="|Δθ| that counts as moved (default 1e-5)")
    p.add_argument("--rank-matrices", type=int, default=4, help="matrices whose update's rank is measured (default 4)")
    p.add_argument("--out", default="forgetting_out", metavar="DIR", help="output directory (default: forgetting_out)")
    p.set_defaults(func=lambda a: run_forgetting(a) and 0)
    return p
