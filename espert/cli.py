"""The ``espert`` command line.

    espert train   [--config FILE.yaml|.toml] [--run-dir DIR] [--resume] [--<field> VALUE ...]
    espert replay  RUN_DIR [--out DIR] [--upto T]
    espert repair  RUN_DIR --truncate-after N
    espert tiny    OUT_DIR [--seed S]
    espert eval    ...   (espert.eval.cli)
    espert analyze ...   (espert.eval.cli)

Every ESConfig field is a ``train`` flag (``population`` -> ``--population``); precedence is
defaults < config file < flags.  ``espert train`` with no arguments runs the main job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import sys
import threading
import time
import typing
from typing import Sequence

from espert.config import (
    RENAMED,
    ESConfig,
    Renamed,
    field_choices,
    field_help,
    field_type,
    renamed_keys,
    smoke_capped,
    smoke_caps,
    smoke_line,
)
from espert.extras import MissingExtra

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
    return renamed_keys({k.replace("-", "_"): v for k, v in doc.items()})  # before flags override them


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ESConfig field: type, choices and help come from the field itself (espert.config)."""
    g = p.add_argument_group("ES config (every ESConfig field; defaults run the main job)")
    helps, choices = field_help(), field_choices()
    for f in dataclasses.fields(ESConfig):
        t = field_type(f.name)
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        help_ = helps[f.name]
        if default not in (None, []) and not re.search(r"\(default[ :]", help_):
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
        g.add_argument("--" + old.replace("_", "-"), dest=new, action=Renamed, new="--" + new.replace("_", "-"))


class Version(argparse.Action):
    """``espert --version``: the version and the commit (looked up only when asked)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from espert import __version__
        from espert.environment import git_commit

        print(f"espert {__version__} (commit {git_commit()})")
        parser.exit(0)


class Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (``espert train: error: ...``, exit 2), not the usage
    block first: espert train's usage alone is 40 lines.  Sub-commands inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="espert",
        description="espert: evolution strategies for LLMs with fused, exactly restorable "
        "counter-based noise. Run 'espert COMMAND --help' for details.",
    )
    parser.add_argument("--version", action=Version, help="print espert's version and commit, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, add_command in commands():
        if name == "sweep":  # it runs train's own config parsing over each grid point
            add_command(sub, lambda argv: config_from_args(build_parser().parse_args(argv))[0], _add_config_flags)
        else:
            add_command(sub)
    return parser


def commands() -> tuple:
    """Every sub-command of ``espert``, in the order ``espert --help`` lists them, with the function that adds its
    parser to the sub-parsers (and sets ``func``): the one place the CLI is built (``espert`` and ``python -m
    espert`` are its only entry points).  The evaluation and experiment commands are imported when a parser is
    built, not when espert is."""
    from espert.eval.calibrate import add_calibrate_parser
    from espert.eval.cli import add_analyze_parser, add_eval_parser
    from espert.eval.forgetting import add_forgetting_parser
    from espert.experiments.compare import add_compare_parser
    from espert.experiments.sweep import add_sweep_parser

    return (
        ("env", _env_parser),
        ("train", _train_parser),
        ("replay", _replay_parser),
        ("repair", _repair_parser),
        ("tiny", _tiny_parser),
        ("eval", add_eval_parser),
        ("analyze", add_analyze_parser),
        ("forgetting", add_forgetting_parser),
        ("calibrate", add_calibrate_parser),
        ("compare", add_compare_parser),
        ("sweep", add_sweep_parser),
    )


def _env_parser(sub) -> None:
    en = sub.add_parser(
        "env",
        help="what this installation is and can do (paste it into bug reports)",
        description="espert's version and commit, the compiled kernels (CPU code path, CUDA archs, Triton), "
        "the versions of torch, vLLM, transformers and math-verify, and which extras are installed. "
        "Every run's config.yaml records the same facts.",
    )
    en.add_argument("--json", action="store_true", help="print the facts as JSON")
    en.set_defaults(func=cmd_env)


def _train_parser(sub) -> None:
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
    tr.add_argument(
        "--run-dir",
        metavar="DIR",
        help="run directory (default: runs/es-YYYYmmdd-HHMMSS, and runs/latest points at it)",
    )
    tr.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    tr.add_argument(
        "--no-progress", action="store_true", help="no progress bars (shown only on a terminal; ESPERT_PROGRESS=0/1)"
    )
    tr.add_argument("--no-report", action="store_true", help="skip the main job's closing base-vs-ES report")
    tr.add_argument(
        "--stop-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, finish the current iteration (its log line, and its checkpoint when one is "
        "due) for at most this long, then stop with exit code 143 (SIGINT: 130); past it the iteration is "
        "abandoned, which the log keeps exact (default: 30)",
    )
    tr.add_argument("--verbose", action="store_true", help="vLLM's own INFO logging (default: its warnings only)")
    _add_config_flags(tr)
    tr.set_defaults(func=cmd_train)


def _replay_parser(sub) -> None:
    rp = sub.add_parser(
        "replay",
        help="rebuild a run's weights from its base model and log alone",
        description="Apply every logged update to the base model's float32 center on the CPU, "
        "write OUT/center.safetensors and OUT/export/ (HF format; --write picks), and compare with "
        "the run's checkpoint.",
    )
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--out", metavar="DIR", help="output directory (default: RUN_DIR/replay)")
    rp.add_argument("--upto", type=int, metavar="T", help="stop after iteration T (default: the last logged)")
    rp.add_argument(
        "--member",
        type=int,
        metavar="RANK",
        help="a RandOpt run: also write the weights of the ensemble's member of this rank (from 1) to OUT/export",
    )
    rp.add_argument(
        "--write",
        default="center,export",
        metavar="WHAT",
        help="what to write into --out: center (the float32 checkpoint), export (the HF model, in the run's "
        "export_dtype), both comma-separated, or none (only the comparison with the run's checkpoint); "
        "default: center,export",
    )
    rp.set_defaults(func=cmd_replay)


def _repair_parser(sub) -> None:
    rr = sub.add_parser(
        "repair",
        help="cut a run's log back to one history (after two writers, or damage)",
        description="Keep iterations 1..N of RUN_DIR/log.jsonl (every kept line's checksum verified) and "
        "only the checkpoint and export of those; the old log and anything removed move to "
        "RUN_DIR/repair-STAMP/. Then 'espert train --run-dir RUN_DIR --resume' continues exactly.",
    )
    rr.add_argument("run_dir", metavar="RUN_DIR")
    rr.add_argument("--truncate-after", type=int, required=True, metavar="N", help="the last iteration to keep")
    rr.set_defaults(func=cmd_repair)


def _tiny_parser(sub) -> None:
    tn = sub.add_parser(
        "tiny",
        help="build the tiny random model + char tokenizer into a directory",
        description="Write the main job's tiny Llama-architecture model, random init (the main job "
        "then pretrains it: ESConfig.pretrain_steps), and its character tokenizer as a standard HF "
        "model directory.",
    )
    tn.add_argument("out_dir", metavar="OUT_DIR")
    tn.add_argument("--seed", type=int, default=0, help="initialization seed (default 0)")
    tn.set_defaults(func=cmd_tiny)


def config_from_args(args: argparse.Namespace) -> tuple[ESConfig | None, dict]:
    """``(config, overrides)``: file values under flag values; on --resume the run's config is the base;
    under ``ESPERT_SMOKE=1`` on the smoke-test budget (:func:`espert.config.smoke_capped`)."""
    cfg, overrides = _given_config(args)
    return smoke_capped(cfg)[0], overrides


def _given_config(args: argparse.Namespace) -> tuple[ESConfig, dict]:
    """:func:`config_from_args` before any smoke-test budget."""
    overrides = load_config_file(args.config) if args.config else {}
    names = {f.name for f in dataclasses.fields(ESConfig)}
    overrides.update({k: v for k, v in vars(args).items() if k in names})
    if args.resume:
        from espert.runs import read_run_config

        if not args.run_dir:
            raise ValueError("--resume needs --run-dir (the run to continue)")
        stored = ESConfig.from_dict(read_run_config(args.run_dir)["config"])
        return ESConfig.from_dict(overrides, base=stored), overrides
    return ESConfig.from_dict(overrides), overrides


class Stop(BaseException):
    """SIGTERM or SIGINT before the first iteration (or before a command began): raised in the main thread, so
    every ``finally`` runs (a new run's uncommitted directory is removed, the writer lock released)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Preemption:
    """SIGTERM and SIGINT during ``espert train``.

    Before the first iteration (imports, config, setup) there is nothing to finish: the signal raises
    :class:`Stop` at once.  From the first iteration on the run stops between iterations (every finished
    one logged, its checkpoint written when one was due), with exit code 143 (SIGINT: 130).  An iteration
    that does not end within ``grace`` seconds, or a second signal, is abandoned: the process prints the
    stop line and exits at once, which the write-ahead log makes as safe as a kill (resume redoes that
    iteration exactly)."""

    CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}

    def __init__(self, run_dir: str, grace: float, again: str):
        self.run_dir, self.grace, self.again = run_dir, grace, again
        self.signum: int | None = None
        self.iterating = False  # set by the loop's first stop() question: setup is over
        self._timer: threading.Timer | None = None
        self._previous: dict = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def code(self) -> int:
        return self.CODES[self.signum]

    def requested(self) -> bool:
        """The loop's ``stop()``: asked before each iteration."""
        self.iterating = True
        return self.signum is not None

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.CODES}
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _on_signal(self, signum, frame) -> None:
        if not self.iterating:
            raise Stop(signum)
        if self.signum is not None:  # a second signal: do not wait
            self._abandon(f"a second {signal.Signals(signum).name} abandoned iteration {{next}} at once")
        self.signum = signum
        if math.isfinite(self.grace):  # inf: wait for the iteration however long it takes
            reason = f"iteration {{next}} did not end within the {self.grace:g} s grace period and was abandoned"
            self._timer = threading.Timer(self.grace, self._abandon, (reason,))
            self._timer.daemon = True
            self._timer.start()

    def _abandon(self, reason: str) -> None:
        """Print the stop line (``reason`` with ``{next}``, the iteration abandoned) and exit at once."""
        from espert.runs import LOG, iteration_records, read_log

        try:  # what the log holds now (a reader: a line still being written is not counted)
            n = len(iteration_records(read_log(os.path.join(self.run_dir, LOG))))
        except Exception:  # noqa: BLE001 - the line below must come whatever the log holds
            n = 0
        print(
            f"espert: stopped at iteration {n} ({self.name}); {reason.format(next=n + 1)} (the log keeps the run "
            f"exact); continue with: {self.again}",
            file=sys.stderr,
        )
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(self.code)


def stopped_before_training(run_dir: str, stop: Stop, again: str) -> str:
    """The line for a signal before the first iteration: what the run directory holds, and how to go on."""
    name = signal.Signals(stop.signum).name
    state = None
    if "espert.runs" in sys.modules:  # else never opened (and importing it now could meet a half-done import)
        from espert.runs import intact_state

        state = intact_state(run_dir)
    if state is None or state.startswith("nothing"):
        return f"espert: stopped by {name} before the first iteration; nothing was written, so the same command starts again"
    held = state.split("(", 1)[1].rstrip(")")
    return (
        f"espert: stopped by {name} before the next iteration; the run directory holds {held}; continue with: {again}"
    )


def cmd_train(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or os.path.join("runs", time.strftime("es-%Y%m%d-%H%M%S"))
    again = f"espert train --run-dir {run_dir} --resume"
    if not args.stop_grace >= 0:
        raise ValueError(f"--stop-grace must be 0 or more seconds, got {args.stop_grace}")
    if args.no_progress:
        os.environ["ESPERT_PROGRESS"] = "0"  # every bar of the run: pretraining, loading, export, the report
    with Preemption(run_dir, args.stop_grace, again) as pre:
        try:
            cfg, summary = _train(args, run_dir, pre)
        except Stop as stop:
            print(stopped_before_training(run_dir, stop, again), file=sys.stderr)
            return Preemption.CODES[stop.signum]
        except OSError as e:
            from espert import runs

            if not runs.is_write_error(e):
                raise
            state = runs.intact_state(run_dir)
            fix = "run the same command again" if state.startswith("nothing") else f"continue with: {again}"
            return _write_failed(e, f"{state}; once space is freed (or the filesystem writable), {fix}")
        finally:
            if not args.run_dir:
                _point_latest(run_dir)
    if pre.requested():  # also when the last iteration ended meanwhile: the report is left to the resume
        n = summary["iterations"] if summary["stopped"] is None else summary["stopped"]
        print(f"espert: stopped at iteration {n} ({pre.name}); continue with: {again}", file=sys.stderr)
        return pre.code
    return _after_training(args, cfg, run_dir, summary, again)


def _say(line: str) -> None:
    """A status line of a command: on stderr, so that stdout holds only results."""
    print(line, file=sys.stderr)


def _train(args: argparse.Namespace, run_dir: str, pre: Preemption) -> tuple[ESConfig, dict]:
    from espert.trainer import train

    cfg, lowered = smoke_capped(_given_config(args)[0])
    if lowered:
        _say(smoke_line(lowered))
    _say(f"[espert] run directory: {run_dir}")
    return cfg, train(cfg, run_dir, resume=args.resume, progress=not args.no_progress, echo=_say, stop=pre.requested)


def _write_failed(e: OSError, what: str) -> int:
    """One line for a failed write: the file, the errno and what is intact; exit code 1."""
    from espert import runs

    _say(f"espert train: error: {runs.write_error_line(e)}; {what}")
    return 1


def _after_training(args, cfg, run_dir: str, summary: dict, again: str) -> int:
    """What a finished ``espert train`` says: the held-out curve, the export, the training picture and,
    for the main job, the closing base-vs-ES report."""
    from espert import runs

    held = summary["heldout"]
    if held:
        curve = "  ".join(f"it {t}: {m:.3f}" for t, m in held)
        _say(f"[espert] held-out mean reward: {curve}")
    if summary["export"]:
        _say(f"[espert] final weights (HF format): {summary['export']}")
    _training_curve(run_dir, _say)
    if not (summary["export"] and cfg.model == "tiny" and ":" not in cfg.task and cfg.eval_size and not args.no_report):
        return 0  # only the main job closes with a report (on its held-out problems: none with eval_size 0)
    from espert.eval.runner import evaluate_run

    size = {"n": 16, "limit": 64}
    lowered = smoke_caps(size, {"n": 2, "limit": 8})
    if lowered:
        _say(smoke_line(lowered))
    size.update({k: new for k, (_, new) in lowered.items()})
    _say(f"[espert] base vs ES, {size['n']} samples (temperature 1) on {size['limit']} held-out problems:")
    try:
        evaluate_run(run_dir, **size, echo=_say)
    except OSError as e:
        if not runs.is_write_error(e):
            raise
        return _write_failed(
            e,
            f"training is complete and intact ({runs.intact_state(run_dir).split('(', 1)[1]}, and its "
            f"export; only the report is missing: once space is freed, write it with: {again}",
        )
    _say(f"[espert] report: {os.path.join(run_dir, 'eval')}")
    return 0


def _point_latest(run_dir: str) -> None:
    """``runs/latest`` -> the run ``espert train`` just made in ``runs/`` (a relative link, replaced
    atomically), so that the next commands can name it: ``espert replay runs/latest``."""
    if not os.path.isdir(run_dir):
        return  # a start that failed leaves nothing to point at
    parent, name = os.path.split(run_dir)
    link, tmp = os.path.join(parent, "latest"), os.path.join(parent, f".latest-{os.getpid()}")
    try:
        os.symlink(name, tmp)
        os.replace(tmp, link)
    except OSError:  # a filesystem without links, or "latest" is a real directory: the path still works
        if os.path.lexists(tmp):
            os.remove(tmp)


def _training_curve(run_dir: str, echo) -> None:
    """RUN/eval/training.png when the plotting library is there (the report says once when it is not)."""
    from espert.extras import have

    if have("matplotlib"):
        from espert.eval.curve import write_training_png

        echo(f"[espert] training curve: {write_training_png(run_dir)}")


def cmd_env(args: argparse.Namespace) -> int:
    from espert.environment import describe, format_environment

    facts = describe()
    print(json.dumps(facts, indent=2) if args.json else format_environment(facts))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from espert.runs import replay

    write = () if args.write.strip() == "none" else tuple(w.strip() for w in args.write.split(",") if w.strip())
    res = replay(args.run_dir, args.out, upto=args.upto, echo=_say, write=write, member=args.member)
    return 1 if res["matches_checkpoint"] is False else 0


def cmd_repair(args: argparse.Namespace) -> int:
    from espert.runs.repair import repair

    repair(args.run_dir, args.truncate_after, echo=_say)
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from espert.config import U64
    from espert.files import check_output_path
    from espert.tiny import build_tiny_model

    if not 0 <= args.seed < U64:
        raise ValueError(f"--seed must be in [0, 2^64), got {args.seed}")
    check_output_path(args.out_dir, "OUT_DIR")

    build_tiny_model(args.out_dir, seed=args.seed)
    print(args.out_dir)
    return 0


def run() -> None:
    """The ``espert`` console script and ``python -m espert``: :func:`main`'s code as the exit status.

    After a Ctrl-C the process ends with ``os._exit(130)``: a KeyboardInterrupt that arrived while C
    code ran Python (pybind11's ``py::exec`` in an import) leaves CPython's "unhandled Ctrl-C" flag set
    although main() caught it, and CPython would then end the process by SIGINT instead of code 130.
    Nothing is left to clean up: run directories are crash-safe (write-ahead log, atomic files).  A signal
    after main() has returned ends the process with main()'s code at once.
    """
    codes = []

    def exiting(signum, frame):  # outside main()'s own handlers: before it installs them, or while the process
        if not codes:  # exits (a second SIGTERM right after the first, atexit hooks), after main() said its line
            print(_stopped_line(signum, []), file=sys.stderr)
        sys.stderr.flush()  # run directories are crash-safe: end with main()'s code, not killed by the signal
        os._exit(codes[0] if codes else 128 + signum)

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, exiting)  # main() restores these when it returns
    code = main(owns_process=True)
    codes.append(code)
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


def main(argv: Sequence[str] | None = None, owns_process: bool = False) -> int:
    """Ctrl-C at any moment, imports included: one line, exit code 130; SIGTERM: one line, 143.

    The signal is also noted by the handler: one that lands inside a C extension's import (numpy's,
    under torch's) can come back as another error ("CPU dispatcher tracer already initialized" when the
    half-imported module is imported again), and that is still the user's signal, not a crash.  Before
    the command's own code runs nothing has been written, and the line says so (``espert train`` says
    what its run directory holds itself: :class:`Preemption`).  ``owns_process`` (the console script): a
    signal before the command starts exits the process at once with that line, since one that lands inside a
    C++ callback of an import (torch.distributed's) cannot be raised through it.
    """
    signals, started = [], []

    def on_signal(signum, frame):
        signals.append(signum)
        if owns_process and not started:  # raised inside an import's C++ callback, pybind11 would terminate
            print(_stopped_line(signum, started), file=sys.stderr)
            sys.stderr.flush()
            os._exit(128 + signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else Stop(signum)

    previous = (
        {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        return _main(argv, started)
    except BaseException as e:
        if not (isinstance(e, (KeyboardInterrupt, Stop)) or signals):
            raise
        signum = signals[-1] if signals else signal.SIGINT
        print(_stopped_line(signum, started), file=sys.stderr)
        return 128 + signum
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {k: v for a in parser._actions if isinstance(a, argparse._SubParsersAction) for k, v in a.choices.items()}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` and of its sub-commands."""
    own = [o for a in parser._actions if a.help is not argparse.SUPPRESS for o in a.option_strings]
    return own + [o for sp in _subparsers(parser).values() for o in _flags(sp)]


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args`` whose "unrecognized arguments" error suggests the closest option."""
    import difflib

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from espert.eval.cli import analyze_shorthand
    except ImportError:  # the evaluation package is optional at this layer
        pass
    else:
        argv = analyze_shorthand(argv)
    args, rest = parser.parse_known_args(argv)
    if rest:
        sub = _subparsers(parser).get(getattr(args, "command", None) or "", parser)
        flags, said = _flags(sub), []
        for r in rest:
            close = difflib.get_close_matches(r.split("=")[0], flags, n=1) if r.startswith("-") else []
            said.append(f"{r} (did you mean {close[0]}?)" if close else r)
        sub.error("unrecognized arguments: " + " ".join(said))
    return args


def _stopped_line(signum: int, started: list) -> str:
    said = "interrupted" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})"
    return f"espert: {said}" + ("" if started else "; nothing was written")


def _main(argv: Sequence[str] | None, started: list) -> int:
    """Parse, then run the command (``started`` gets an entry once its own code runs)."""
    parser = build_parser()
    args = parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command in ("train", "replay", "tiny", "compare", "calibrate"):
            from espert.evaluators.torch_model import quiet_transformers

            quiet_transformers()
        from espert.vllm import quiet_logging

        quiet_logging(getattr(args, "verbose", False))
        started.append(args.command)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, MissingExtra) as e:
        print(f"espert {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a quota, an I/O error, a read-only filesystem: one line, exit 1
        from espert.files import is_write_error, write_error_line

        if not is_write_error(e):
            raise
        print(f"espert {args.command}: error: {write_error_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
