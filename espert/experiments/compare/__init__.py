"""ES against GRPO (and ES with anchored weight decay, and RandOpt) on one machine and one budget.

    espert compare --out runs/compare           # full run (8 minutes on a loaded 2-core machine)
    espert compare --out runs/compare --fast    # the CI variant (about a minute)

(``python -m espert compare`` is the same command.)

One base model (by default the tiny model pretrained locally, :func:`espert.tiny.build_tiny_model`;
``--model`` takes any model ``espert train`` takes, e.g. ``smollm2-135m-instruct``), one task (by
default the built-in ``copy``; ``--task`` and ``--train-data``/``--eval-data`` as in train), one
reward, one training prompt pool, one rollout budget:

1. **ES**: espert's :func:`espert.es.es_step` on the torch or vLLM evaluator (greedy rollouts of
   perturbed members), ``iterations × population × prompts_per_iteration`` rollouts.
2. **GRPO**: ``trl.GRPOTrainer`` (sampled rollouts, ``num_generations`` per prompt, no KL term),
   as many optimizer steps as give the same number of rollouts.
3. **Evaluation**: base, ES and GRPO with ``espert eval`` (``n`` samples per held-out problem,
   temperature sampling): pass@k and maj@k curves, the 12-bin coverage histograms, progressions
   and regressions against the base, answer entropy.
4. **Drift**: ``espert analyze`` drift of both fine-tuned models against the base.
5. **Token entropy** of every model on the probe set (the held-out prompts), and of ES's center and
   GRPO's policy at ``probe_points + 1`` equally spaced points of their training (:class:`Probe`).

Every budget is counted the same way: one rollout is one completion of one prompt; generated
tokens are the completion's token ids up to and including the end token; forward FLOPs are
``2·P·(prompt + generated tokens)`` for the rollouts (GRPO's backward pass, about twice the forward,
is reported separately).  ``--budget rollouts|tokens|seconds`` (with ``--budget-value``) says what each
method trains until it has spent (default: ES's rollouts); ``--methods es,es_awd,grpo,randopt`` which
methods run (ES+AWD: ES with anchored weight decay; RandOpt: members scored until the budget is spent,
its top K evaluated as an ensemble).  Everything lands in ``OUT/report.md``, ``OUT/compare.json`` and
the PNGs; the report states each method's budget and what it spent.

TRL is an optional extra (``pip install espert[compare]``); without it :func:`run_compare` stops with
:class:`espert.extras.MissingExtra` before it builds anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from espert.config import SMOKE_CAPS, smoke_caps, smoke_line
from espert.experiments.compare.arms import Probe, es_config, run_es, run_grpo, run_randopt
from espert.experiments.compare.config import (
    _HELP,
    ARMS,
    Budget,
    CompareConfig,
    check_numbers,
    load_tasks,
    parse_schedule,
    phase_budget,
    schedule_label,
)
from espert.experiments.compare.report import (
    compare_doc,
    entropy_curves,
    n_params,
    report_text,
    write_report,
)
from espert.extras import require


def run_schedule(
    base_dir: str, out_dir: str, spec: str, cc: CompareConfig, echo=print, probe=None
) -> tuple[dict, dict]:
    """Train the phases of ``spec`` one after the other from ``base_dir``; each phase starts from the
    previous one's model.  Returns (summed budget, {label: checkpoint directory of every phase})."""
    label = schedule_label(spec)
    total = {"rollouts": 0, "prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0, "train_reward": []}
    total["train_entropy"] = []  # GRPO phases: (phase, step, bits)
    total["probe_entropy"] = []  # every phase: (phase, step, bits)
    checkpoints, start = {}, base_dir
    phases = parse_schedule(spec)
    for i, (method, share) in enumerate(phases, 1):
        out = os.path.join(out_dir, f"{i}-{method}")
        n = phase_budget(cc, method, share)
        echo(
            f"[compare] {label} phase {i}/{len(phases)}: {method} for {n} {'iterations' if method == 'es' else 'steps'}"
        )
        if method == "es":
            b = run_es(start, out, cc, echo, iterations=n, probe=probe)
        else:
            b = run_grpo(start, out, cc, echo, steps=n, probe=probe)
        for key in ("rollouts", "prompt_tokens", "generated_tokens", "seconds"):
            total[key] += b[key]
        total["train_reward"] += b["train_reward"]
        total["train_entropy"] += [(i, step, h) for step, h in b.get("train_entropy", [])]
        total["probe_entropy"] += [(i, step, h) for step, h in b["probe_entropy"]]
        checkpoints[label if i == len(phases) else f"{label}.{i}"] = out
        start = out
    total["seconds"] = round(total["seconds"], 1)
    return total, checkpoints


def evaluate(models: dict[str, str], out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """``espert eval`` of every model on the held-out problems (``cc.evaluator``'s sampler); writes
    report.json and PNGs."""
    from espert.eval.runner import generate_samples, write_outputs
    from espert.eval.samplers import make_sampler
    from espert.eval.samples import save_samples

    _, task = load_tasks(cc)
    groups = {}
    for label, path in models.items():
        sampler = make_sampler(cc.evaluator, path, device="cpu", batch_size=256, chat_template=cc.chat_template)
        try:
            recs = generate_samples(
                task,
                label,
                sampler,
                cc.n,
                cc.temperature,
                1.0,
                cc.max_new_tokens,
                cc.seed,
                extra_meta={"model_path": path},
            )
        finally:
            sampler.close()
        save_samples(os.path.join(out_dir, f"samples_{label}.jsonl"), recs)
        groups[label] = recs
    # the summary is printed once, inside the whole report (run_compare)
    return write_outputs(groups, out_dir, base="base", threshold=1.0, solve_rule="any", echo=lambda s: None)


def base_model(out_dir: str, cc: CompareConfig, echo=print) -> tuple[str, str]:
    """(directory of the base model, its description for the report): ``OUT/base`` built for 'tiny',
    else the model ``espert train --model`` would load (a GGUF: its converted directory)."""
    from espert.runs import resolve_model_dir
    from espert.runs.gguf import gguf_path

    if cc.model == "tiny":
        from espert.tiny import build_tiny_model

        base, t0 = os.path.join(out_dir, "base"), time.time()
        build_tiny_model(base, seed=cc.tiny_seed, pretrain_steps=cc.pretrain_steps, pretrain_lr=cc.pretrain_lr)
        echo(f"[compare] base: tiny model pretrained {cc.pretrain_steps} steps ({time.time() - t0:.0f} s)")
        return base, "tiny model"
    gguf = gguf_path(cc.model)
    base = resolve_model_dir(gguf or cc.model, echo)
    echo(f"[compare] base: {cc.model} ({base})")
    return base, f"`{cc.model}`"


def run_compare(out_dir: str, cc: CompareConfig, echo=print) -> dict:
    """The whole comparison; returns the ``compare.json`` document.  The packages it needs, every
    schedule and the task's problems are checked before anything is trained or written."""
    from espert.eval.analyze import compute_drift, plot_drift
    from espert.eval.report import format_summary
    from espert.files import check_output_path

    check_output_path(out_dir, "--out")
    heldout = _check(cc)
    os.makedirs(out_dir, exist_ok=True)
    base, described = base_model(out_dir, cc, echo)
    probe = Probe(base, heldout.prompts, cc)
    try:
        budgets, models = train_all(base, out_dir, cc, echo, probe)
        report = evaluate(models, os.path.join(out_dir, "eval"), cc, echo)
        single = {lab: path for lab, path in models.items() if lab != "randopt"}  # an ensemble is no one model
        entropy = {label: probe.of_dir(path) for label, path in single.items()}
    finally:
        probe.close()
    drift = {lab: compute_drift(base, path, per_tensor=False) for lab, path in single.items() if lab != "base"}
    plot_drift(drift, os.path.join(out_dir, "eval"))
    schedules = {schedule_label(sp): parse_schedule(sp) for sp in cc.schedules}
    _plot_probe_entropy(budgets, schedules, os.path.join(out_dir, "eval", "probe_entropy.png"))
    P = n_params(base)
    text = report_text(cc, described, P, budgets, format_summary(report), entropy, drift)
    doc = compare_doc(cc, base, P, budgets, report, entropy, schedules, drift)
    write_report(out_dir, doc, text)
    echo(text)
    return doc


def _check(cc: CompareConfig):
    """The packages and settings the run needs, checked before anything is written; returns the held-out task."""
    for module in ("trl", "accelerate", "datasets", "matplotlib"):
        require(module, "espert compare")
    if cc.evaluator == "vllm":
        from espert.vllm.patches import require_vllm

        require_vllm("espert compare --evaluator vllm")
    elif cc.evaluator != "torch":
        raise ValueError(f"evaluator {cc.evaluator!r}: use torch or vllm")
    for spec in cc.schedules:
        parse_schedule(spec)
    if cc.schedules and cc.budget != "rollouts":
        raise ValueError("--schedule shares a rollout budget; use it with --budget rollouts")
    if "randopt" in cc.arms() and cc.n % cc.randopt_top_k:
        raise ValueError(f"RandOpt's ensemble of {cc.randopt_top_k} gives a multiple of K samples: -n {cc.n}")
    Budget.of(cc)
    check_numbers(cc)
    es_config(cc, cc.model)  # the ES arm's settings, checked by ESConfig (sizes that cannot fit, ...)
    if cc.model != "tiny":  # a directory, a Hub id (cache, else one short request) or a GGUF file: found
        from espert.runs import resolve_model_dir
        from espert.runs.gguf import gguf_path

        if gguf_path(cc.model) is None:
            found = resolve_model_dir(cc.model)
            if not os.path.isfile(os.path.join(found, "config.json")):
                raise ValueError(f"--model {cc.model}: {found} holds no config.json (no Hugging Face model)")
    return load_tasks(cc)[1]


def train_all(base: str, out_dir: str, cc: CompareConfig, echo, probe) -> tuple[dict, dict]:
    """Every method of ``--methods`` until the budget is spent, and every ``--schedule`` composition, from
    ``base``: (budgets spent by label, {label: model directory, or RandOpt's ensemble directory})."""
    budget = Budget.of(cc)
    budgets, models = {}, {"base": base}
    for arm in cc.arms():
        out, load = os.path.join(out_dir, arm), os.getloadavg()[0]  # a shared machine: the load is part of the time
        if arm in ("es", "es_awd"):
            spent = run_es(base, out, cc, echo, probe=probe, budget=budget, anchor=arm == "es_awd")
        elif arm == "grpo":
            spent = run_grpo(base, out, cc, echo, probe=probe, budget=budget)
        else:
            spent = run_randopt(base, out, cc, echo, budget=budget)
        load = [round(load, 1), round(os.getloadavg()[0], 1)]
        budgets[ARMS[arm]] = {**spent, "budget": {"kind": budget.kind, "value": budget.value}, "load_avg": load}
        models[arm] = out
    for spec in cc.schedules:
        label = schedule_label(spec)
        budgets[label], phases = run_schedule(base, os.path.join(out_dir, label), spec, cc, echo, probe=probe)
        models.update(phases)
    return budgets, models


def _plot_probe_entropy(budgets: dict, schedules: dict, path: str) -> None:
    from espert.eval.plots import plot_lines

    curves = entropy_curves({k: v["probe_entropy"] for k, v in budgets.items()}, schedules)
    plot_lines(
        curves,
        path,
        "share of the rollout budget spent",
        "token entropy (bits)",
        "probe-set token entropy during training",
    )


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/compare", metavar="DIR", help="output directory (default runs/compare)")
    p.add_argument("--fast", action="store_true", help="the small CI variant (about a minute)")
    p.add_argument(
        "--schedule",
        action="append",
        default=[],
        metavar="PHASES",
        help="also train a sequential composition, e.g. es,grpo or grpo:0.25,es:0.75 (phases share the "
        "rollout budget of ES alone: equally unless given); repeatable; every phase's model is evaluated "
        "(default: none, ES and GRPO alone)",
    )
    full, fast = CompareConfig(), CompareConfig.fast()
    for f in dataclasses.fields(CompareConfig):
        if f.name == "schedules":
            continue
        value, small = getattr(full, f.name), getattr(fast, f.name)
        what = _HELP[f.name]
        shown = f"default {value}" + (f"; --fast: {small}" if small != value else "")
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=f"{what} ({shown})"
            )
        else:
            kind = type(value) if value is not None else str
            p.add_argument(
                flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(), help=f"{what} ({shown})"
            )
    p.set_defaults(func=run_cli)


def add_compare_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``espert compare`` to an argparse ``subparsers`` object; sets ``func``."""
    p = subparsers.add_parser(
        "compare",
        help="ES vs GRPO (trl) end to end on one base model and task: budgets, "
        "pass@k/maj@k, coverage, drift (needs espert[compare])",
        description=__doc__.split("\n\n")[0],
    )
    _add_arguments(p)
    return p


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``espert compare``: 0, or 2 with a one-line error (e.g. TRL missing)."""
    import torch

    threads = torch.get_num_threads()
    try:
        cc = CompareConfig.fast() if args.fast else CompareConfig()
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cc) if hasattr(args, f.name)}
        given.pop("schedules", None)
        cc = dataclasses.replace(cc, schedules=tuple(args.schedule), **given)
        lowered = smoke_caps(dataclasses.asdict(cc), {**SMOKE_CAPS, "n": 2, "num_generations": 2, "probe_points": 1})
        if lowered:
            print(smoke_line(lowered).replace("[espert]", "[compare]"), file=sys.stderr)
            cc = dataclasses.replace(cc, **{k: new for k, (_, new) in lowered.items()})
        torch.set_num_threads(1)
        run_compare(args.out, cc, echo=lambda s: print(s, file=sys.stderr))
    except (ImportError, ValueError, FileNotFoundError) as e:
        print(f"espert compare: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # a caller's process (tests, notebooks) keeps its thread count
    return 0
