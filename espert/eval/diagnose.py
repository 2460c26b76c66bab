"""Estimator diagnostics of a training run and the one-point vs antithetic experiment: ``espert analyze run`` and
``espert analyze estimator`` (the weight-space analysis is :mod:`espert.eval.analyze`).

* ``run``: per-iteration Corr(X+, X-), kappa, reward spread, answer JS and FLOPs of a run's log, with the training
  curve and ``estimator.png``;
* ``estimator``: one-point vs antithetic variance of the ES gradient estimate, with common and independent prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from espert.extras import have, install_hint, require

from .curve import write_training_png
from .metrics import mean_or_none
from .plots import pyplot, save_figure


def run_diagnostics(run_dir: str) -> dict:
    """Per-iteration estimator diagnostics of a run directory's ``log.jsonl``.

    Recomputed from the logged members and rewards (so older runs work too); FLOPs come from the
    ``diagnostics`` the loop logged, when present.  Returns ``{"iterations": [...], "rows": [...]}``,
    one row per iteration with ``corr_pm``, ``kappa``, ``kappa_eval``, ``reward_std``,
    ``reward_range``, and from the logged diagnostics ``answer_js`` (bits) and ``flops_total`` (None
    when not logged), plus ``heldout`` [(t, mean)].
    """
    from espert.diagnostics import antithetic_stats, reward_spread
    from espert.runs import LOG, iteration_records, read_log

    path = os.path.join(run_dir, LOG)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no run log at {path}")
    records = read_log(path)
    rows = []
    for rec in iteration_records(records):
        a = antithetic_stats(rec["members"], rec["rewards"])
        sp = reward_spread(rec["rewards"])
        logged = rec.get("diagnostics") or {}
        row = {"iteration": rec["iteration"], **{k: a[k] for k in ("corr_pm", "kappa", "kappa_eval")}}
        row.update(reward_std=sp["std"], reward_range=sp["range"], answer_js=(logged.get("answers") or {}).get("js"))
        rows.append({**row, "flops_total": logged.get("flops_total")})
    if not rows:
        raise ValueError(f"{path} has no iterations")
    held = [(r["iteration"], r["mean"]) for r in records if r.get("kind") == "eval"]
    return {"run_dir": run_dir, "rows": rows, "heldout": held}


def format_run_diagnostics(res: dict) -> str:
    rows = res["rows"]
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    half = max(1, len(rows) // 2)
    lines = [f"{res['run_dir']}: {len(rows)} iterations"]
    for name, part in (("first half", rows[:half]), ("second half", rows[half:] or rows[:half])):
        lines.append(
            f"  {name}: Corr(X+,X-) {f(mean_or_none(r['corr_pm'] for r in part))}, "
            f"kappa {f(mean_or_none(r['kappa'] for r in part))}, "
            f"kappa_eval {f(mean_or_none(r['kappa_eval'] for r in part))}, "
            f"reward std {f(mean_or_none(r['reward_std'] for r in part))}, "
            f"answer JS {f(mean_or_none(r['answer_js'] for r in part))} bits"
        )
    tot = rows[-1]["flops_total"]
    lines.append(f"  forward FLOPs (cumulative): {'not logged' if tot is None else f'{tot:.3e}'}")
    return "\n".join(lines)


def plot_run_diagnostics(res: dict, out_dir: str) -> str:
    """``estimator.png``: Corr(X+,X-), kappa, population diversity (reward spread; answer JS in bits on
    a right axis, when logged) and held-out reward per iteration (x: cumulative FLOPs when logged,
    else iterations)."""
    plt = pyplot()
    rows = res["rows"]
    use_flops = all(r["flops_total"] is not None for r in rows)
    x = [r["flops_total"] if use_flops else r["iteration"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=120)
    ax = axes[0]
    ax.plot(x, [np.nan if r["corr_pm"] is None else r["corr_pm"] for r in rows], label="Corr(X+, X-)")
    ax.plot(x, [np.nan if r["kappa"] is None else r["kappa"] for r in rows], label="kappa = Var A / V1")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_title("antithetic estimator")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(x, [np.nan if r["reward_std"] is None else r["reward_std"] for r in rows], label="std")
    ax.plot(x, [np.nan if r["reward_range"] is None else r["reward_range"] for r in rows], label="max - min")
    ax.set_title("population diversity")
    ax.set_ylabel("reward spread")
    ax.legend(fontsize=8, loc="upper left")
    if any(r["answer_js"] is not None for r in rows):
        js = ax.twinx()
        js.plot(x, [np.nan if r["answer_js"] is None else r["answer_js"] for r in rows], "k--", label="answer JS")
        js.set_ylabel("answer JS divergence (bits)")
        js.set_ylim(bottom=0)
        js.legend(fontsize=8, loc="upper right")
    ax = axes[2]
    it_to_x = {r["iteration"]: xx for r, xx in zip(rows, x)}
    it_to_x[0] = 0.0 if use_flops else 0
    held = [(it_to_x[t], m) for t, m in res["heldout"] if t in it_to_x and m is not None]
    if held:
        ax.plot([h[0] for h in held], [h[1] for h in held], "o-")
    ax.set_title("held-out reward")
    for a in axes:
        a.set_xlabel("cumulative forward FLOPs" if use_flops else "iteration")
        a.grid(True, alpha=0.3)
    os.makedirs(out_dir, exist_ok=True)
    return save_figure(fig, os.path.join(out_dir, "estimator.png"))


def run_run(args: argparse.Namespace) -> int:
    """``espert analyze run RUN_DIR`` (or ``espert analyze RUN_DIR``): estimator diagnostics of a training
    run, and its training curve and estimator plots (``training.png``, ``estimator.png``) in --plot-dir,
    by default ``RUN_DIR/eval``."""
    try:
        if args.plot_dir:
            require("matplotlib", "--plot-dir")
        check_outputs(args)
        res = run_diagnostics(args.run_dir)
        print(format_run_diagnostics(res))
        if args.json:
            write_json(args.json, res)
        plot_dir = args.plot_dir or os.path.join(args.run_dir, "eval")
        if have("matplotlib"):
            print(f"wrote {write_training_png(args.run_dir, plot_dir)}")
            print(f"wrote {plot_run_diagnostics(res, plot_dir)}")
        else:
            print(f"espert analyze run: plots skipped: {install_hint('matplotlib')}", file=sys.stderr)
    except (FileNotFoundError, ValueError) as e:
        print(f"espert analyze run: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_estimator(args: argparse.Namespace) -> int:
    """``espert analyze estimator``: one-point vs antithetic variance, common vs independent prompts."""
    try:
        from espert.diagnostics import estimator_variance
        from espert.evaluators import TorchEvaluator, load_model
        from espert.tasks import load_task

        if not os.path.isdir(args.model):
            raise FileNotFoundError(f"model directory not found: {args.model}")
        check_outputs(args)
        _check_estimator_args(args)
        task = load_task(args.task, args.split, n=args.pool, path=args.data)
        model, tok = load_model(args.model)
        ev = TorchEvaluator(model, tok, task.score, max_new_tokens=args.max_new_tokens)
        try:
            res = estimator_variance(ev, task.prompts, task.answers, args.sigma, args.pairs, args.per_member, args.seed)
        finally:
            ev.close()
        f = lambda x: "n/a" if x is None else f"{x:.4g}"  # noqa: E731
        for kind in ("common", "independent"):
            a = res[kind]
            print(
                f"{kind:>11} prompts: Corr(X+,X-) {f(a['corr_pm'])}  one-point var {f(a['var_one'])}  "
                f"antithetic var {f(a['var_anti'])}  kappa {f(a['kappa'])}  kappa_eval {f(a['kappa_eval'])}"
            )
        if args.json:
            write_json(args.json, res)
    except (FileNotFoundError, ValueError) as e:
        print(f"espert analyze estimator: error: {e}", file=sys.stderr)
        return 2
    return 0


def _check_estimator_args(args: argparse.Namespace) -> None:
    """ValueError naming the first of ``analyze estimator``'s numbers out of range, before a model loads."""
    for flag, least in (("pool", 1), ("pairs", 2), ("per_member", 1), ("max_new_tokens", 1)):
        if getattr(args, flag) < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    if args.per_member > args.pool:
        raise ValueError(f"--per-member {args.per_member} is more than the --pool of {args.pool} prompts")
    if not (math.isfinite(args.sigma) and args.sigma > 0):
        raise ValueError(f"--sigma must be a finite number > 0, got {args.sigma}")
    if not 0 <= args.seed < 2**64:
        raise ValueError(f"--seed must be in [0, 2^64), got {args.seed}")


def check_outputs(args: argparse.Namespace) -> None:
    """The --json file, --plot-dir and --export paths a command was given, checked before anything is computed
    or written (a directory as --json, a file among the parents, a name too long)."""
    from espert.files import check_output_path

    if getattr(args, "json", None):
        check_output_path(args.json, "--json", kind="file", spare=16)
    for flag in ("plot_dir", "export"):
        if getattr(args, flag, None):
            check_output_path(getattr(args, flag), "--" + flag.replace("_", "-"))


def write_json(path: str, obj) -> None:
    from espert.files import atomic_write_text  # whole or not at all (a full disk keeps the old file)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def add_subcommands(p: argparse.ArgumentParser) -> None:
    """``espert analyze run`` and ``espert analyze estimator`` (drift stays the flag-only default)."""
    sub = p.add_subparsers(dest="analyze_command", metavar="SUBCOMMAND", prog="espert analyze")  # not the usage block
    r = sub.add_parser(
        "run", help="estimator diagnostics of a training run (Corr(X+,X-), kappa, spread, answer JS, FLOPs)"
    )
    r.add_argument("run_dir", metavar="RUN_DIR")
    r.add_argument(
        "--plot-dir", metavar="DIR", help="write training.png and estimator.png here (default: RUN_DIR/eval)"
    )
    r.add_argument("--json", metavar="FILE", help="write the diagnostics as JSON")
    r.set_defaults(func=run_run)
    e = sub.add_parser("estimator", help="one-point vs antithetic variance with common and independent prompts")
    e.add_argument("--model", required=True, help="local HF model directory")
    e.add_argument("--task", default="copy", help="task name or import path (default copy)")
    e.add_argument("--data", metavar="JSONL", help="local JSONL file with the problems")
    e.add_argument("--split", default="train", help="dataset split (default train)")
    e.add_argument("--pool", type=int, default=256, help="prompts in the pool (default 256)")
    e.add_argument("--sigma", type=float, default=0.02, help="noise scale (default 0.02)")
    e.add_argument("--pairs", type=int, default=16, help="antithetic pairs per estimate (default 16)")
    e.add_argument("--per-member", type=int, default=16, help="prompts per member (default 16)")
    e.add_argument("--max-new-tokens", type=int, default=8, help="greedy generation budget (default 8)")
    e.add_argument("--seed", type=int, default=0, help="member seeds derive from it (default 0)")
    e.add_argument("--json", metavar="FILE", help="write the results as JSON")
    e.set_defaults(func=run_estimator)
