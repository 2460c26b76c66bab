"""The ``espert`` command line.

    espert train   [--config FILE.yaml|.toml] [--run-dir DIR] [--resume] [--<field> VALUE ...]
    espert replay  RUN_DIR [--out DIR] [--upto T]
    espert tiny    OUT_DIR [--seed S]
    espert eval    ...   (espert.eval.cli)
    espert analyze ...   (espert.eval.cli)

Every ESConfig field is a ``train`` flag (``population`` -> ``--population``); precedence is
defaults < config file < flags.  ``espert train`` with no arguments runs the main job.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
import typing
from typing import Sequence

from espert.config import RENAMED, ESConfig, deprecated, field_choices, field_help, field_type

TRAIN_EPILOG = """examples:
  espert train                                   # main job: tiny model, copy task, CPU, a few minutes
  espert train --iterations 50 --run-dir runs/quick
  espert train --run-dir runs/quick --resume --iterations 100     # continue (or extend) a run
  espert train --config configs/copy_tiny.yaml --sigma 0.03
  espert train --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --device cuda --dtype bfloat16 \\
      --sigma 0.001 --alpha 0.0005 --population 30 --prompts-per-iteration 200 --max-new-tokens 512 \\
      --chat-template --eval-size 200 --iterations 500
  espert train --task mypkg.rewards:my_reward --train-data train.jsonl --eval-data heldout.jsonl
                                                 # your own reward fn(prompts, completions, answers)
  espert replay runs/quick                       # rebuild the final weights from base model + log
"""


def load_config_file(path: str) -> dict:
    """A flat mapping of ESConfig fields from YAML or TOML (a run's own config.yaml works too)."""
    from espert.runs import legacy, read_config_file  # syntax errors: one line naming the file and position

    if not path.endswith((".yaml", ".yml", ".toml")):
        raise ValueError(f"config file must end in .yaml, .yml or .toml: {path}")
    doc = read_config_file(path)
    doc = {} if doc is None else doc
    if isinstance(doc, dict) and "format" in doc and isinstance(doc.get("config"), dict):
        doc = legacy.upgrade_config(doc["config"])  # a run directory's config.yaml
    elif isinstance(doc, dict):
        doc = legacy.v1_defaults(doc)  # a version-1 run's config section copied into a file
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping of config fields")
    return doc


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ESConfig field: type, choices and help come from the field itself (espert.config)."""
    g = p.add_argument_group("ES config (every ESConfig field; defaults run the main job)")
    helps, choices = field_help(), field_choices()
    for f in dataclasses.fields(ESConfig):
        t = field_type(f.name)
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        help_ = helps[f.name]
        if default not in (None, []) and "default" not in help_:
            help_ += f" (default: {default})"
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=help_.replace("%", "%%"))
        if f.name in choices:
            g.add_argument(flag, choices=choices[f.name], **kw)
        elif t is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(t) is list:
            g.add_argument(
                flag, nargs="*", metavar="PATTERN" if "exclude" in f.name or f.name == "include" else "NAME", **kw
            )
        elif t in (int, float):
            g.add_argument(flag, type=t, metavar=t.__name__.upper(), **kw)
        else:
            g.add_argument(flag, metavar="STR", **kw)
    for old, new in RENAMED.items():  # deprecated spellings still parse (and say so)
        g.add_argument(
            "--" + old.replace("_", "-"),
            dest=f"_renamed_{old}",
            default=argparse.SUPPRESS,
            metavar="STR",
            help=argparse.SUPPRESS,
        )


def build_parser() -> argparse.ArgumentParser:
    from espert import __version__

    parser = argparse.ArgumentParser(
        prog="espert",
        description="espert: evolution strategies for LLMs with fused, exactly restorable "
        "counter-based noise. Run 'espert COMMAND --help' for details.",
    )
    parser.add_argument("--version", action="version", version=f"espert {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tr = sub.add_parser(
        "train",
        help="train with ES (defaults: the tiny-model main job on CPU)",
        description="Train a model with evolution strategies. Writes a run directory "
        "(config.yaml, log.jsonl, center.safetensors, export/) that resumes and "
        "replays bit-exactly.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tr.add_argument("--config", metavar="FILE", help="YAML or TOML file of ESConfig fields")
    tr.add_argument("--run-dir", metavar="DIR", help="run directory (default: runs/es-YYYYmmdd-HHMMSS)")
    tr.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--verbose", action="store_true", help="vLLM's own INFO logging (default: its warnings only)")
    _add_config_flags(tr)
    tr.set_defaults(func=cmd_train)

    rp = sub.add_parser(
        "replay",
        help="rebuild a run's weights from its base model and log alone",
        description="Apply every logged update to the base model's float32 center on the CPU, "
        "write OUT/center.safetensors and OUT/export/ (HF format), and compare with "
        "the run's checkpoint.",
    )
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--out", metavar="DIR", help="output directory (default: RUN_DIR/replay)")
    rp.add_argument("--upto", type=int, metavar="T", help="stop after iteration T (default: the last logged)")
    rp.set_defaults(func=cmd_replay)

    tn = sub.add_parser(
        "tiny",
        help="build the tiny random model + char tokenizer into a directory",
        description="Write the main job's tiny Llama-architecture model, random init (the main job "
        "then pretrains it: ESConfig.pretrain_steps), and its character tokenizer as a standard HF "
        "model directory.",
    )
    tn.add_argument("out_dir", metavar="OUT_DIR")
    tn.add_argument("--seed", type=int, default=0)
    tn.set_defaults(func=cmd_tiny)

    try:
        from espert.eval.cli import add_analyze_parser, add_eval_parser
    except ImportError:  # the evaluation package is optional at this layer
        pass
    else:
        add_eval_parser(sub)
        add_analyze_parser(sub)
        from espert.compare import add_compare_parser

        add_compare_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> tuple[ESConfig | None, dict]:
    """``(config, overrides)``: file values under flag values; on --resume the run's config is the base."""
    overrides = load_config_file(args.config) if args.config else {}
    names = {f.name for f in dataclasses.fields(ESConfig)}
    for old, new in RENAMED.items():
        if hasattr(args, f"_renamed_{old}"):
            deprecated(f"--{old.replace('_', '-')} is deprecated; use --{new.replace('_', '-')}")
            setattr(args, new, getattr(args, f"_renamed_{old}"))
            overrides.pop(old, None)
    overrides.update({k: v for k, v in vars(args).items() if k in names})
    if args.resume:
        from espert.runs import read_run_config

        if not args.run_dir:
            raise ValueError("--resume needs --run-dir (the run to continue)")
        stored = ESConfig.from_dict(read_run_config(args.run_dir)["config"])
        return ESConfig.from_dict(overrides, base=stored), overrides
    return ESConfig.from_dict(overrides), overrides


def cmd_train(args: argparse.Namespace) -> int:
    from espert.trainer import train

    cfg, _ = config_from_args(args)
    run_dir = args.run_dir or os.path.join("runs", time.strftime("es-%Y%m%d-%H%M%S"))
    echo = lambda s: print(s, file=sys.stderr)  # noqa: E731
    echo(f"[espert] run directory: {run_dir}")
    summary = train(cfg, run_dir, resume=args.resume, progress=not args.no_progress, echo=echo)
    held = summary["heldout"]
    if held:
        curve = "  ".join(f"it {t}: {m:.3f}" for t, m in held)
        echo(f"[espert] held-out mean reward: {curve}")
    if summary["export"]:
        echo(f"[espert] final weights (HF format): {summary['export']}")
    if summary["export"] and cfg.model == "tiny" and ":" not in cfg.task:  # the main job closes with a report
        from espert.eval.runner import evaluate_run

        echo("[espert] base vs ES, 16 samples (temperature 1) on 64 held-out problems:")
        evaluate_run(run_dir, n=16, limit=64, echo=echo)
        echo(f"[espert] report and plots: {os.path.join(run_dir, 'eval')}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from espert.runs import replay

    res = replay(args.run_dir, args.out, upto=args.upto, echo=lambda s: print(s, file=sys.stderr))
    return 1 if res["matches_checkpoint"] is False else 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from espert.tiny import build_tiny_model

    build_tiny_model(args.out_dir, seed=args.seed)
    print(args.out_dir)
    return 0


def run() -> None:
    """The ``espert`` console script and ``python -m espert``: :func:`main`'s code as the exit status.

    After a Ctrl-C the process ends with ``os._exit(130)``: a KeyboardInterrupt that arrived while C
    code ran Python (pybind11's ``py::exec`` in an import) leaves CPython's "unhandled Ctrl-C" flag set
    although main() caught it, and CPython would then end the process by SIGINT instead of code 130.
    Nothing is left to clean up: run directories are crash-safe (write-ahead log, atomic files).
    """
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Ctrl-C at any moment, imports included: one line, exit code 130.

    The interrupt is also noted by the handler: one that lands inside a C extension's import (numpy's,
    under torch's) can come back as another error ("CPU dispatcher tracer already initialized" when the
    half-imported module is imported again), and that is still the user's Ctrl-C, not a crash.
    """
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = (
        signal.signal(signal.SIGINT, on_sigint) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        return _main(argv)
    except BaseException as e:
        if not (isinstance(e, KeyboardInterrupt) or interrupted):
            raise
        print("espert: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command in ("train", "replay", "tiny"):
            from espert.evaluators.torch_model import quiet_transformers

            quiet_transformers()
        from espert.vllm import quiet_logging

        quiet_logging(getattr(args, "verbose", False))
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"espert {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
