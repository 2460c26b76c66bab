"""The report of ``espert compare``: ``OUT/report.md`` (budgets, held-out evaluation, token entropy, drift)
and ``OUT/compare.json`` (the same numbers, and every curve)."""

from __future__ import annotations

import dataclasses
import json
import os


def n_params(model_dir: str) -> int:
    from espert.eval.analyze import SafetensorsWeights

    w = SafetensorsWeights(model_dir)
    total = 0
    for name in w.names():
        k = 1
        for s in w.shape(name):
            k *= s
        total += k
    return total


def _budget_lines(budgets: dict, P: int) -> list[str]:
    from espert.diagnostics import forward_flops

    lines = [
        "| method | budget | trained | rollouts | prompt tokens | generated tokens | rollout forward FLOPs | wall s "
        "| load s | load avg (start, end) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for lab, b in budgets.items():
        fl = forward_flops(P, b["prompt_tokens"] + b["generated_tokens"])
        b["rollout_forward_flops"] = fl
        given = b.get("budget")
        budget = f"{given['value']:g} {given['kind']}" if given else "a phase share"
        trained = next((f"{b[k]} {k}" for k in ("iterations", "steps", "members") if k in b), "")
        lines.append(
            f"| {lab} | {budget} | {trained} | {b['rollouts']} | {b['prompt_tokens']} | {b['generated_tokens']} "
            f"| {fl:.3e} | {b['seconds']} | {b.get('load_seconds', '')} | {', '.join(map(str, b.get('load_avg', [])))} |"
        )
    return lines


def _entropy_table(budgets: dict) -> list[str]:
    """Markdown rows: each method's probe entropy at its probed steps (phase.step for compositions)."""
    lines = ["| method | probe-set token entropy (bits) at step |", "|---|---|"]
    for lab, b in budgets.items():
        cells = []
        for p in b["probe_entropy"]:
            step = f"{p[0]}.{p[1]}" if len(p) == 3 else str(p[0])
            cells.append(f"{step}: {p[-1]:.3f}")
        lines.append(f"| {lab} | {', '.join(cells)} |")
    return lines


def entropy_curves(probes: dict, schedules: dict) -> dict[str, list[tuple[float, float]]]:
    """label -> [(share of the rollout budget spent, bits)] from the probes ``[(step, bits)]`` of a
    method, or ``[(phase, step, bits)]`` of a composition (``schedules``: label -> [(method, share)]),
    so that every method's curve spans 0..1 of the same budget."""
    curves = {}
    for lab, pts in probes.items():
        if not pts:
            continue
        if len(pts[0]) == 2:
            last = pts[-1][0] or 1
            curves[lab] = [(step / last, h) for step, h in pts]
            continue
        shares = [share for _, share in schedules[lab]]
        ends = {}
        for phase, step, _ in pts:
            ends[phase] = max(ends.get(phase, 0), step)
        curves[lab] = [
            (sum(shares[: phase - 1]) + shares[phase - 1] * step / (ends[phase] or 1), h) for phase, step, h in pts
        ]
    return curves


def report_text(cc, described: str, P: int, budgets: dict, summary: str, entropy: dict, drift: dict) -> str:
    """report.md: the budget table, the held-out summary (``summary``: :func:`espert.eval.report.format_summary`),
    token entropies (final and during training) and the drift of every fine-tuned model."""
    from espert.eval.analyze import format_drift_summary

    lines = [f"# ES vs GRPO on `{cc.task}` ({described}, {P} parameters)", ""]
    lines += [f"Config: `{json.dumps(dataclasses.asdict(cc))}`", "", "## Budget", ""]
    lines += _budget_lines(budgets, P)
    lines += ["", "## Held-out evaluation (espert eval)", "", "```", summary, "```", ""]
    lines += [
        "## Token entropy (greedy, held-out prompts, bits per token)",
        "",
        "| model | " + " | ".join(entropy) + " |",
        "|---" * (len(entropy) + 1) + "|",
        "| H | " + " | ".join(f"{h:.3f}" for h in entropy.values()) + " |",
        "",
        "During training (the same probe, at equally spaced steps of each method's budget):",
        "",
    ]
    lines += _entropy_table(budgets)
    lines += ["", "## Drift (espert analyze)", "", "```"]
    lines += [format_drift_summary(lab, d) for lab, d in drift.items()]
    lines += ["```", ""]
    return "\n".join(lines)


def write_report(out_dir: str, doc: dict, text: str) -> None:
    """report.md and compare.json, each whole or not at all (a full disk keeps the old file)."""
    from espert.files import atomic_write_text

    atomic_write_text(os.path.join(out_dir, "report.md"), text)
    atomic_write_text(os.path.join(out_dir, "compare.json"), json.dumps(doc, indent=2) + "\n")


def compare_doc(
    cc, base: str, P: int, budgets: dict, report: dict, entropy: dict, schedules: dict, drift: dict
) -> dict:
    """compare.json: the config, budgets (without their curves), the held-out evaluation and every curve."""
    per_run = ("train_reward", "train_entropy", "probe_entropy")
    return {
        "config": dataclasses.asdict(cc),
        "base": base,
        "n_params": P,
        "budgets": {k: {kk: vv for kk, vv in v.items() if kk not in per_run} for k, v in budgets.items()},
        "train_reward": {k: v["train_reward"] for k, v in budgets.items()},
        "eval": report["models"],
        "comparisons": report["comparisons"],
        "pareto": report["pareto"],
        "token_entropy": entropy,
        "probe_entropy": {k: v["probe_entropy"] for k, v in budgets.items()},
        "grpo_train_entropy": {k: v["train_entropy"] for k, v in budgets.items() if v.get("train_entropy")},
        "schedules": schedules,
        "drift": {k: {"overall": v["overall"], "groups": v["groups"]} for k, v in drift.items()},
    }
