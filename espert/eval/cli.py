"""argparse front ends for ``espert eval`` and ``espert analyze``.

``espert/cli.py`` (its ``commands()``) adds them to ``espert``'s sub-commands: ``add_eval_parser(subparsers)``
-> ``espert eval``, ``add_analyze_parser(subparsers)`` -> ``espert analyze``; ``args.func(args)`` -> exit code.
``python -m espert eval ...`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

from espert.config import Renamed, smoke_caps, smoke_line

from ..tasks import PYTHON_PREFIX, load_spec_task
from .analyze import add_arguments, run_analyze
from .diagnose import add_subcommands
from .report import forgetting
from .runner import load_sample_files, parse_model_specs, write_outputs
from .samplers import check_sampling_args, make_sampler
from .samples import save_samples

#: eval's generation budget when no run gives one
MAX_NEW_TOKENS = 512

EVAL_EPILOG = """examples:
  espert eval --models base=runs/latest/base_model es=runs/latest/export       # the run's task and budget
  espert eval --task gsm8k --data test.jsonl --models base=Qwen2.5-0.5B es=runs/es/final \\
      --base base -n 16 --limit 200 --out eval_out
  espert eval --samples eval_out/samples_base.jsonl eval_out/samples_es.jsonl --base base --out rescored
"""


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` sub-command to an argparse ``subparsers`` object; sets ``func``."""
    p = subparsers.add_parser(
        "eval",
        help="sample models on a task and report pass@k, maj@k, histograms, progressions",
        description="Sample n completions per problem from one or more models (or re-score saved samples) "
        "and write report.json, summary.txt and PNG plots.",
        epilog=EVAL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for add_group in (_source_args, _task_args, _sampling_args, _report_args):
        add_group(p)
    p.set_defaults(func=run_eval)
    return p


def _source_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("what to evaluate")
    src.add_argument(
        "--models",
        nargs="+",
        metavar="LABEL=PATH",
        help="models to sample from: directories, Hub ids, GGUF files or smollm2-135m-instruct",
    )
    src.add_argument(
        "--samples", nargs="+", metavar="FILE", help="re-score saved samples_*.jsonl files instead of generating"
    )
    src.add_argument(
        "--no-rescore", action="store_true", help="with --samples: use the stored rewards instead of recomputing them"
    )
    src.add_argument("--base", metavar="LABEL", help="reference model for progressions/regressions (default: first)")


def _task_args(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("task")
    data.add_argument(
        "--task",
        nargs="+",
        metavar="TASK",
        help="default: the run's, when a model is in a run directory (RUN/base_model, RUN/export), with its "
        "held-out problems, generation budget and chat template; "
        "a built-in task (copy, arithmetic, countdown, humaneval, gsm8k, math500, ...) or an import path "
        "package.module:name, as espert train takes it (a reward function takes its problems from --data); "
        "several tasks: a report per task in OUT/TASK/ and the forgetting table (base vs tuned per task); "
        "TASK=JSONL gives one task its own problems file (e.g. gsm8k=heldout.jsonl arithmetic countdown)",
    )
    data.add_argument("--data", metavar="JSONL", help="local JSONL file with the problems (instead of the Hub)")
    data.add_argument("--split", default="test", help="dataset split (default: test)")
    data.add_argument("--limit", type=int, help="evaluate only the first LIMIT problems")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    samp = p.add_argument_group("sampling")
    samp.add_argument("-n", "--n", type=int, default=8, help="samples per problem (default 8)")
    samp.add_argument("--temperature", type=float, default=0.6, help="default 0.6; 0 = greedy")
    samp.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    samp.add_argument(
        "--max-new-tokens",
        type=int,
        default=argparse.SUPPRESS,
        help=f"max new tokens per sample (default: the run's, for a task taken from a run; else {MAX_NEW_TOKENS}: "
        "room for sampled reasoning; train's 8 fits the tiny main job)",
    )
    samp.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    samp.add_argument(
        "--evaluator", choices=["torch", "vllm"], default="torch", help="generation engine, as in train (default torch)"
    )
    samp.add_argument("--batch-size", type=int, default=64, help="sequences per generate call (torch; default 64)")
    samp.add_argument(
        "--device",
        help="torch device for the torch evaluator (default: cuda if available, else cpu; train's is cpu, "
        "where a run's weights live)",
    )
    samp.add_argument(
        "--dtype",
        default="auto",
        help="model dtype, e.g. bfloat16 (default auto: the checkpoint's own; with --evaluator vllm on a CPU, float32 "
        "where vLLM's packed GEMMs cannot take it; said once; train's float32 is the ES master's)",
    )
    samp.add_argument(
        "--chat-template", action="store_true", help="wrap prompts with the tokenizer's chat template (default off)"
    )
    # the names of earlier versions: they still work, and say once what they are now called
    samp.add_argument("--max-tokens", type=int, dest="max_new_tokens", action=Renamed, new="--max-new-tokens")
    samp.add_argument(
        "--backend",
        dest="evaluator",
        action=Renamed,
        new="--evaluator",
        convert={"transformers": "torch", "vllm": "vllm"},
    )
    samp.add_argument("--verbose", action="store_true", help="vLLM's own INFO logging (default: its warnings only)")


def _report_args(p: argparse.ArgumentParser) -> None:
    rep = p.add_argument_group("report")
    rep.add_argument("--out", default="eval_out", metavar="DIR", help="output directory (default eval_out)")
    rep.add_argument(
        "--threshold", type=float, help="a sample is correct if reward >= THRESHOLD (default: the task's, 1.0)"
    )
    rep.add_argument(
        "--solve-rule",
        choices=["any", "majority", "vote"],
        default="any",
        help="when a model 'solves' a problem, for progressions/regressions (default any)",
    )
    rep.add_argument(
        "--maj",
        choices=["subsets", "first"],
        default="subsets",
        help="maj@k: exact average over all k-subsets of the n samples, or the first k samples only (default subsets)",
    )
    rep.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def run_eval(args: argparse.Namespace) -> int:
    """Entry point of ``espert eval``: returns 0, or 2 with a one-line error on bad input."""
    try:
        return _run_eval(args)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as e:
        print(f"espert eval: error: {e}", file=sys.stderr)
        return 2


def _run_eval(args: argparse.Namespace) -> int:
    if bool(args.models) == bool(args.samples):
        raise ValueError("give exactly one of --models (generate) or --samples (re-score)")
    if args.threshold is not None and not math.isfinite(args.threshold):
        raise ValueError(f"--threshold must be a finite number, got {args.threshold}")
    from ..files import check_output_path

    check_output_path(args.out, "--out")
    tasks = args.task or []
    if args.samples:
        if len(tasks) > 1:
            raise ValueError("--samples re-scores one task at a time (give one --task)")
        groups = load_sample_files(
            args.samples, task_name=tasks[0] if tasks else None, rescore_rewards=not args.no_rescore
        )
        threshold = 1.0 if args.threshold is None else args.threshold
        _write(args, groups, args.out, threshold)
        return 0
    if not tasks:
        tasks = _task_of_run(args)
    if getattr(args, "max_new_tokens", None) is None:
        args.max_new_tokens = MAX_NEW_TOKENS
    lowered = smoke_caps(vars(args), {"n": 2, "limit": 4, "max_new_tokens": 8})
    if lowered:
        print(smoke_line(lowered), file=sys.stderr)
        vars(args).update({k: new for k, (_, new) in lowered.items()})
    _check_sampling(args)
    if len(tasks) > 1 and args.data:
        raise ValueError("--data goes with one --task; several tasks each load their own problems")
    if args.evaluator == "vllm":
        from ..vllm.patches import require_vllm

        require_vllm("--evaluator vllm")
    named = [spec.partition("=")[::2] for spec in tasks]  # (task, its own problems file or "")
    if len({name for name, _ in named}) < len(named):
        raise ValueError(f"a task is given twice: {' '.join(tasks)}")
    loaded = [(name, _load(args, name, path)) for name, path in named]  # every task's problems before sampling
    models = _resolve_models(args.models)  # after the tasks: a bad task name needs no Hub request
    from ..evaluators.torch_model import quiet_transformers
    from ..vllm import quiet_logging

    quiet_transformers()
    quiet_logging(args.verbose)
    reports = {}
    for name, task in loaded:
        out = args.out if len(tasks) == 1 else os.path.join(args.out, _dir_name(name))
        threshold = task.success_threshold if args.threshold is None else args.threshold
        reports[name] = _write(args, _sample(args, task, models, out), out, threshold)
    if len(tasks) > 1:
        from ..files import atomic_write_text

        doc, text = forgetting(reports, base=args.base or next(iter(models)))
        atomic_write_text(os.path.join(args.out, "forgetting.json"), json.dumps(doc, indent=2) + "\n")
        atomic_write_text(os.path.join(args.out, "forgetting.md"), text + "\n")
        print(text)
        print(f"[espert eval] forgetting table: {os.path.join(args.out, 'forgetting.md')}", file=sys.stderr)
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling arguments, checked before a model loads or a file is written."""
    import torch

    from ..runs import check_device

    check_sampling_args([], args.n, args.temperature, args.top_p, args.max_new_tokens)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise ValueError(f"--batch-size and --limit must be >= 1, got {args.batch_size} and {args.limit}")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2^63), got {args.seed}")
    if args.dtype != "auto" and not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        raise ValueError(f"--dtype must be auto or a torch dtype (float32, bfloat16, ...), got {args.dtype!r}")
    if args.device is not None:
        check_device(args.device)


def _resolve_models(specs: Sequence[str]) -> dict[str, str]:
    """``{label: local model directory}`` of ``--models``, resolved before anything is written, as ``espert
    train`` resolves ``--model`` (a directory, a GGUF file or named model, or a Hub id).  A spec without
    ``LABEL=`` must name a local model or an ``org/name`` Hub id: a bare word ('base') is a missing label
    far more often than a Hub model."""
    from ..runs import resolve_model_dir
    from ..runs.gguf import gguf_path

    models = parse_model_specs(specs)
    for spec, (label, path) in zip(specs, models.items()):
        gguf = gguf_path(path)  # a GGUF file or a named model: its converted directory (espert/runs/gguf.py)
        if gguf is None and "=" not in spec and "/" not in spec and not os.path.exists(path):
            raise ValueError(
                f"--models {spec!r} is no directory, GGUF file or known model here; give each model as "
                f"LABEL=MODEL (a directory, a Hub id, a GGUF file or smollm2-135m-instruct), e.g. base=Qwen/Qwen2.5-0.5B"
            )
        models[label] = resolve_model_dir(gguf or os.path.expanduser(path), lambda s: print(s, file=sys.stderr))
    return models


def _run_of(model_specs) -> tuple[str, dict] | None:
    """``(run directory, its config.yaml)`` of the first model that is a run's ``base_model`` or ``export``
    (or the run directory itself), else None."""
    from ..runs import CONFIG, read_run_config

    for path in parse_model_specs(model_specs).values():
        for d in (path, os.path.dirname(os.path.normpath(path))):
            if os.path.isfile(os.path.join(d, CONFIG)):
                try:
                    return d, read_run_config(d)
                except (ValueError, OSError):
                    continue
    return None


def _task_of_run(args: argparse.Namespace) -> list[str]:
    """The task a run was trained on, and its held-out problems, generation budget and chat template as the
    defaults of what was not given; ValueError when no model is in a run directory."""
    found = _run_of(args.models)
    if found is None:
        raise ValueError("--task is required when generating (no --models path is in a run directory)")
    run_dir, doc = found
    cfg = doc["config"]
    if str(cfg["task"]).startswith(PYTHON_PREFIX):
        raise ValueError(f"{run_dir} was trained on a task given as Python objects ({cfg['task']}): give --task")
    args.data = args.data or cfg.get("eval_data")
    if args.split == "test":  # not given: the run's held-out split
        args.split = cfg.get("eval_split") or args.split
    if getattr(args, "max_new_tokens", None) is None:
        args.max_new_tokens = int(cfg["max_new_tokens"])
    args.chat_template = args.chat_template or bool(cfg.get("chat_template"))
    print(
        f"[espert eval] task {cfg['task']}, {args.max_new_tokens} new tokens"
        f"{', chat template' if args.chat_template else ''}: from {os.path.join(run_dir, 'config.yaml')}",
        file=sys.stderr,
    )
    return [cfg["task"]]


def _dir_name(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in spec)


def _load(args: argparse.Namespace, spec: str, path: str = ""):
    """The problems of task ``spec``: from ``path`` (its own file, ``TASK=JSONL``), else --data or its source."""
    if path and not os.path.isfile(path):
        raise FileNotFoundError(f"problems file of task {spec!r} not found: {path}")
    task = load_spec_task(spec, args.split, n=args.limit, path=path or args.data)
    if task is None or len(task) == 0:
        raise ValueError(f"task {spec!r} has no {args.split!r} problems (give them with --data JSONL or {spec}=JSONL)")
    return task


def _sample(args: argparse.Namespace, task, models: dict[str, str], out: str) -> dict[str, list[dict]]:
    """Sample every model on ``task``; saves ``out/samples_LABEL.jsonl`` and returns the records by label."""
    from ..evaluators import loading_model
    from .runner import generate_samples  # looked up here: tests stop a call at it

    groups = {}
    for label, path in models.items():
        print(f"[espert eval] sampling {label} ({path}): {len(task)} {task.name} problems x {args.n}", file=sys.stderr)
        kwargs = dict(chat_template=args.chat_template, dtype=args.dtype)
        if args.evaluator == "torch":
            kwargs.update(batch_size=args.batch_size, device=args.device)
        with loading_model(path, args.evaluator):  # the check espert train makes of its base model
            sampler = make_sampler(args.evaluator, path, **kwargs)
        meta = {"model_path": path, "evaluator": args.evaluator, "split": args.split, "data": args.data}
        sampling = (args.n, args.temperature, args.top_p, args.max_new_tokens, args.seed)
        try:
            recs = generate_samples(task, label, sampler, *sampling, meta, progress=f"[espert eval] sampling {label}")
        finally:
            getattr(sampler, "close", lambda: None)()
        out_path = os.path.join(out, f"samples_{label}.jsonl")
        save_samples(out_path, recs)  # makes `out` once a model has loaded and sampled: a refusal writes nothing
        print(f"[espert eval] wrote {out_path}", file=sys.stderr)
        groups[label] = recs
    return groups


def _write(args: argparse.Namespace, groups: dict, out: str, threshold: float) -> dict:
    report = write_outputs(groups, out, args.base, threshold, args.solve_rule, not args.no_plots, maj_method=args.maj)
    print(f"[espert eval] report: {os.path.join(out, 'report.json')}", file=sys.stderr)
    return report


ANALYZE_USAGE = """
  espert analyze RUN_DIR [--plot-dir DIR] [--json FILE]        (= espert analyze run RUN_DIR)
  espert analyze --base BASE --ckpt [LABEL=]PATH ... [--taus TAU ...] [--json FILE] [--plot-dir DIR]
                 [--no-per-tensor] [--export DIR --threshold TAU [--force]]
  espert analyze estimator --model DIR [...]"""


def analyze_shorthand(argv: Sequence[str]) -> list[str]:
    """``analyze RUN_DIR ...`` -> ``analyze run RUN_DIR ...`` (argparse would take RUN_DIR for a sub-command)."""
    argv = list(argv)
    if len(argv) > 1 and argv[0] == "analyze" and not argv[1].startswith("-") and argv[1] not in ("run", "estimator"):
        return ["analyze", "run", *argv[1:]]
    return argv


def add_analyze_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``analyze`` sub-command to an argparse ``subparsers`` object; sets ``func``."""
    p = subparsers.add_parser(
        "analyze",
        help="a run's training curve and estimator diagnostics; weight drift of checkpoints vs a base model",
        usage=ANALYZE_USAGE,
        description="'espert analyze RUN_DIR' (the same as 'espert analyze run RUN_DIR'): a training run's "
        "estimator diagnostics, its training curve (RUN_DIR/eval/training.png) and estimator plot. "
        "'espert analyze --base BASE --ckpt CKPT': relative L2 drift overall and per parameter group, "
        "update-magnitude distribution, and export of a checkpoint whose small updates (|delta| <= tau) are "
        "reset to the base weights. 'espert analyze estimator --model DIR': one-point vs antithetic variance, "
        "common vs independent prompt sets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    add_subcommands(p)
    p.set_defaults(func=run_analyze)
    return p
