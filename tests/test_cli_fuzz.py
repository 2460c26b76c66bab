"""Property-based fuzzing of the command line (hypothesis): tests/test_fuzz.py's idea one layer up.

For every subcommand (train, replay, repair, tiny, eval, analyze and its run and estimator, compare,
sweep, env) hypothesis draws one to three of its numeric and path arguments and gives each a malformed,
out-of-range or absurd value: words where numbers go, NaN, infinities, negative and 2^64-sized integers,
missing paths, a garbage file where a model or a JSONL goes, a directory where a file goes, a path under a
regular file, a NUL byte, a 300-character name.  The property, for every call:

- a refusal is one line (no traceback; status lines such as ``[espert] run directory: ...`` aside), exit
  code 2, and nothing written: the working directory, and the run directory the command was pointed at,
  are exactly as before;
- a value that no argument of its kind accepts (``MUST``: a word for an integer, NaN, a missing input
  file, a NUL byte ...) is refused;
- anything else may be accepted: the call then stops where its work would begin (``Accepted``), so the
  test never trains, samples or sweeps.

Each call runs in-process (``espert.cli.main``) in a fresh working directory, with the Hub offline.  Time
(2 cores): about 30-45 s for the whole file, the module's one small training run included.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile

import pytest
from conftest import SMALL_RUN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from espert.cli import main

#: values no integer argument takes, and values some take and some refuse
NOT_INT = ["x", "", "1.5", "nan", "1e3", "0x10", "-2"]
ODD_INT = ["0", "-1", "99999999999999999999", str(2**64), str(2**63)]
NOT_FLOAT = ["x", "", "nan", "NaN", "1,5"]
ODD_FLOAT = ["inf", "-inf", "1e309", "-1", "0", "1e-320", "-0"]
#: path values: names in the fresh working directory (see ``workdir``) and two that no filesystem takes
MISSING, GARBAGE, EMPTY, TEXT, DIR = "no/such/path", "garbage.bin", "empty.txt", "notes.txt", "emptydir"
UNDER_FILE, NUL, LONG = "garbage.bin/sub", "a\x00b", "x" * 300
UNUSABLE = [UNDER_FILE, NUL, LONG]
KINDS = {  # kind -> (must be refused, may be either)
    "int": (NOT_INT, ODD_INT),
    "float": (NOT_FLOAT, ODD_FLOAT),
    "in_file": ([MISSING, DIR, GARBAGE, *UNUSABLE], [EMPTY, TEXT]),
    "in_dir": ([MISSING, GARBAGE, DIR, TEXT, *UNUSABLE], []),
    "out_dir": ([GARBAGE, *UNUSABLE], [MISSING, DIR]),
    "out_file": ([DIR, *UNUSABLE], [MISSING, EMPTY]),
}


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument: its flag (or the index of the positional it replaces), its kind, a prefix of its value
    (``base=`` for a model label) and values of its own that must be refused or may be either."""

    flag: str | int
    kind: str
    prefix: str = ""
    must: tuple = ()
    may: tuple | None = None  # None: its kind's

    def values(self) -> tuple[list[str], list[str]]:
        must, may = KINDS[self.kind]
        may = may if self.may is None else self.may
        return [*must, *self.must], [v for v in may if v not in self.must]


class Accepted(Exception):
    """A call got past every check: raised where its work would begin."""


def accepted(*a, **k):
    raise Accepted


def ints(*flags, **kw):
    return [Arg(f, "int", **kw) for f in flags]


def floats(*flags, **kw):
    return [Arg(f, "float", **kw) for f in flags]


QUICK = ["--pretrain-steps", "0", "--iterations", "1", "--population", "2", "--prompts-per-iteration", "2"]
QUICK += ["--train-size", "4", "--eval-size", "2", "--max-new-tokens", "2", "--no-progress"]
TRAIN_INTS = "tiny-seed tiny-hidden-size pretrain-steps train-size eval-size max-new-tokens generation-batch-size "
TRAIN_INTS += "cpu-threads vllm-engines vllm-tensor-parallel-size vllm-max-model-len vllm-max-loras "
TRAIN_INTS += "quant-group-size iterations population prompts-per-iteration seed eval-every checkpoint-every"
TRAIN_FLOATS = "pretrain-reverse-share vllm-gpu-memory-utilization sigma sigma-end alpha alpha-end optimizer-beta1 "
TRAIN_FLOATS += "optimizer-beta2 optimizer-eps reward-std-floor weight-decay"
COMPARE_INTS = "probe-points tiny-seed pretrain-steps train-size eval-size n max-new-tokens iterations population "
COMPARE_INTS += "prompts-per-iteration num-generations prompts-per-step seed"

#: command -> (the arguments of a call that would run, the arguments to fuzz)
COMMANDS = {
    "train": (
        ["train", "--run-dir", "run", *QUICK],
        [
            *ints(*("--" + f for f in TRAIN_INTS.split())),
            *floats(*("--" + f for f in TRAIN_FLOATS.split())),
            *floats("--stop-grace"),
            Arg("--config", "in_file"),
            Arg("--run-dir", "out_dir"),
            Arg("--train-data", "in_file"),
            Arg("--eval-data", "in_file"),
            Arg("--model", "in_dir", must=("no-such-model-xyz",)),
        ],
    ),
    "replay": (["replay", "RUN", "--out", "out"], [Arg(1, "in_dir"), Arg("--out", "out_dir"), *ints("--upto")]),
    "repair": (
        ["repair", "RUN", "--truncate-after", "99"],
        [Arg(1, "in_dir"), Arg("--truncate-after", "int", must=("99999999999999999999", "7"), may=())],
    ),
    "tiny": (["tiny", "model"], [Arg(1, "out_dir"), *ints("--seed")]),
    "eval": (
        ["eval", "--models", "base=TINY", "--task", "copy", "--limit", "2", "-n", "1", "--max-new-tokens", "2"],
        [
            Arg("--models", "in_dir", prefix="base=", must=("no-such-model-xyz",)),
            Arg("--models", "in_dir", must=("base",)),
            Arg("--task", "in_file", prefix="copy="),
            Arg("--data", "in_file"),
            Arg("--out", "out_dir"),
            *ints("--limit", "-n", "--max-new-tokens", "--seed", "--batch-size"),
            *floats("--temperature", "--top-p", "--threshold"),
        ],
    ),
    "eval-samples": (["eval", "--samples", "SAMPLES", "--out", "out"], [Arg("--samples", "in_file")]),
    "analyze": (
        ["analyze", "--base", "TINY", "--ckpt", "RUN/export"],
        [
            Arg("--base", "in_dir"),
            Arg("--ckpt", "in_dir"),
            Arg("--json", "out_file"),
            Arg("--plot-dir", "out_dir"),
            *floats("--taus"),
        ],
    ),
    "analyze-export": (
        ["analyze", "--base", "TINY", "--ckpt", "RUN/export", "--export", "thresholded", "--threshold", "1e-4"],
        [Arg("--export", "out_dir"), *floats("--threshold")],
    ),
    "analyze-run": (
        ["analyze", "run", "RUN"],
        [Arg(2, "in_dir"), Arg("--json", "out_file"), Arg("--plot-dir", "out_dir")],
    ),
    "analyze-estimator": (
        ["analyze", "estimator", "--model", "TINY", "--pool", "4", "--pairs", "2", "--per-member", "2"],
        [
            Arg("--model", "in_dir"),
            Arg("--data", "in_file"),
            Arg("--json", "out_file"),
            *ints("--pool", "--pairs", "--per-member", "--max-new-tokens", "--seed"),
            *floats("--sigma"),
        ],
    ),
    "compare": (
        ["compare", "--fast", "--out", "out"],
        [
            *ints(*("--" + f for f in COMPARE_INTS.split())),
            *floats("--pretrain-lr", "--temperature", "--sigma", "--alpha", "--learning-rate"),
            Arg("--out", "out_dir"),
            Arg("--model", "in_dir"),
            Arg("--train-data", "in_file"),
            Arg("--eval-data", "in_file"),
        ],
    ),
    "sweep": (
        ["sweep", "--out", "out", "--grid", "population=2,4", "--set", "iterations=1"],
        [
            Arg("--out", "out_dir"),
            Arg("--config", "in_file"),
            Arg("--workers", "int", must=("0",)),
            Arg("--grid", "int", prefix="population=", must=("3",)),
            Arg("--grid", "float", prefix="sigma="),
        ],
    ),
    "env": (["env"], [Arg("--json", "int", must=tuple(ODD_INT)), Arg("--out", "out_dir", must=(MISSING, DIR, EMPTY))]),
}

#: where each command's work begins: the call is stopped there once every check has passed
SENTINELS = [
    "espert.runs.run.Run.commit",  # train: the model loaded, the run directory not yet in place
    "espert.eval.runner.generate_samples",
    "espert.evaluators.torch_model.load_model",
    "espert.experiments.compare.base_model",
    "espert.experiments.sweep._run_in_processes",
    "espert.experiments.sweep._run_on_ray",
    "espert.tiny.build_tiny_model",
    "espert.eval.analyze.plot_drift",  # matplotlib: seconds, after every check
    "espert.eval.diagnose.plot_run_diagnostics",
]

CLI_FUZZ = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
EXAMPLES = {"train": 40, "eval": 20, "compare": 20, "analyze-estimator": 10, "sweep": 10}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_dir):
    """A finished small run and a samples file, read-only inputs of the calls."""
    from espert.config import ESConfig
    from espert.eval.samples import make_records, save_samples
    from espert.tasks import load_task
    from espert.trainer import train

    root = tmp_path_factory.mktemp("inputs")
    run = str(root / "run")
    train(ESConfig(**{**SMALL_RUN, "iterations": 2, "eval_size": 2}), run, progress=False, echo=None)
    task = load_task("copy", "test", n=2)
    samples = str(root / "samples_base.jsonl")
    save_samples(samples, make_records("base", task, [["a"], ["b"]]))
    return {"RUN": run, "TINY": tiny_dir, "SAMPLES": samples}


def snapshot(root: str) -> dict[str, str]:
    """Every path under ``root`` with a hash of its bytes (directories: "dir")."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = "dir"
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def workdir(inputs: dict) -> str:
    """A fresh working directory with the path values' files and its own copy of the run."""
    work = tempfile.mkdtemp(prefix="cli-fuzz-")
    with open(os.path.join(work, GARBAGE), "wb") as f:
        f.write(b"\xff\xe1garbage\x00\x9c" * 8)
    open(os.path.join(work, EMPTY), "w").close()
    with open(os.path.join(work, TEXT), "w") as f:
        f.write("hello\n")
    os.mkdir(os.path.join(work, DIR))
    shutil.copytree(inputs["RUN"], os.path.join(work, "RUN"))
    return work


def argv_of(base: list[str], drawn: list[tuple[Arg, str]], inputs: dict) -> list[str]:
    """``base`` with the drawn values (TINY and SAMPLES: the module's inputs; RUN: the working directory's copy)."""
    argv = [a.replace("TINY", inputs["TINY"]).replace("SAMPLES", inputs["SAMPLES"]) for a in base]
    for arg, value in drawn:
        if isinstance(arg.flag, int):
            argv[arg.flag] = arg.prefix + value
        else:
            argv += [arg.flag, arg.prefix + value]
    return argv


def call(argv: list[str], capsys) -> tuple[int | str, str, str]:
    """``(exit code or "accepted", stdout, stderr)`` of ``espert ARGV``; anything else propagates."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    except Accepted:
        code = "accepted"
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("[espert")]


@pytest.fixture
def offline(monkeypatch):
    """The Hub offline (a Hub id is refused at once) and every command's work replaced by ``Accepted``."""
    import huggingface_hub.constants

    import espert.eval.analyze  # noqa: F401 - modules the sentinels patch
    import espert.eval.diagnose  # noqa: F401
    import espert.evaluators.torch_model  # noqa: F401
    import espert.experiments.compare
    import espert.experiments.sweep
    import espert.trainer  # noqa: F401

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for target in SENTINELS:
        monkeypatch.setattr(target, accepted)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_cli_refusals_are_one_line_exit_2_and_write_nothing(command, inputs, offline, capsys):
    """The property of the module docstring, for one subcommand."""
    base, args = COMMANDS[command]

    @settings(CLI_FUZZ, max_examples=EXAMPLES.get(command, 12))
    @given(data=st.data())
    def check(data):
        picked = data.draw(st.lists(st.sampled_from(args), min_size=1, max_size=min(3, len(args)), unique=True))
        drawn = []
        for arg in picked:
            must, may = arg.values()
            drawn.append((arg, data.draw(st.sampled_from(must + may))))
        work, cwd = workdir(inputs), os.getcwd()
        try:
            os.chdir(work)
            argv = argv_of(base, drawn, inputs)
            before = snapshot(work)
            code, out, err = call(argv, capsys)
            refused = code not in (0, "accepted")
            if refused:
                lines = error_lines(err)
                assert code == 2 and len(lines) == 1 and "Traceback" not in err, (argv, code, err)
                assert snapshot(work) == before, (argv, "wrote on refusal")
            must = [(a.flag, v) for a, v in drawn if v in a.values()[0]]
            assert refused or not must, (argv, f"accepted {must}", err)
        finally:
            os.chdir(cwd)
            shutil.rmtree(work, ignore_errors=True)

    check()
