"""Run directories: crash anywhere, resume, and get bit-identical weights; replay from the log alone."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import SMALL_RUN as SMALL

from espert import runs, train
from espert.config import ESConfig

FLAGS = [
    "--pretrain-steps",  # random-init tiny base (pretraining costs ~30 s and is not what these tests check)
    "0",
    "--iterations",
    "6",
    "--population",
    "4",
    "--prompts-per-iteration",
    "6",
    "--train-size",
    "64",
    "--eval-size",
    "6",
    "--max-new-tokens",
    "5",
    "--checkpoint-every",
    "2",
    "--eval-every",
    "3",
    "--sigma",
    "0.05",
    "--alpha",
    "0.05",
    "--weight-decay",
    "0.01",
]


class Crash(Exception):
    pass


def crash_at(t_crash, phase_crash):
    def hook(t, phase):
        if (t, phase) == (t_crash, phase_crash):
            raise Crash(f"crash at {t} {phase}")

    return hook


def center(run_dir):
    state, it = runs.load_center(os.path.join(run_dir, runs.CENTER))
    return state, it


def iters(run_dir):
    return [r for r in runs.read_log(os.path.join(run_dir, runs.LOG)) if r["kind"] == "iter"]


def assert_same_run(a, b, iterations=SMALL["iterations"]):
    sa, ia = center(a)
    sb, ib = center(b)
    assert ia == ib == iterations
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ra, rb = iters(a), iters(b)
    for key in ("iteration", "members", "rewards", "seeds", "coeffs", "decay", "prompt_indices", "sigma", "alpha"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ref") / "run")
    train(ESConfig(**SMALL), d, progress=False, echo=None)
    return d


def test_reference_run_layout(reference):
    doc = runs.read_run_config(reference)
    assert doc["base_model"] == "base_model" and doc["config"]["population"] == 4 and doc["task"] == "copy"
    log = runs.read_log(os.path.join(reference, runs.LOG))
    assert [r["iteration"] for r in log if r["kind"] == "eval"] == [0, 3, 6]
    its = iters(reference)
    assert [r["iteration"] for r in its] == list(range(1, 7))
    r = its[0]
    assert len(r["members"]) == 4 and len(r["rewards"]) == 4 and r["decay"] == pytest.approx(1 - 0.05 * 0.01)
    assert set(r["reward"]) == {"mean", "max", "min", "std", "n_valid"}
    assert any(r["seeds"] for r in its)  # something was learnt / applied
    state, it = center(reference)
    assert it == 6 and all(v.dtype == torch.float32 for v in state.values())
    # export: the model's own format, loadable, equal to the float32 center
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(os.path.join(reference, runs.EXPORT))
    AutoTokenizer.from_pretrained(os.path.join(reference, runs.EXPORT))
    for k, v in state.items():
        assert torch.equal(m.get_parameter(k), v), k
    base = AutoModelForCausalLM.from_pretrained(os.path.join(reference, runs.BASE))
    assert not torch.equal(base.get_parameter(k), v)


@pytest.mark.parametrize("t,phase", [(1, "logged"), (3, "logged"), (3, "updated"), (4, "checkpointed"), (6, "updated")])
def test_crash_and_resume_is_bit_identical(reference, tmp_path, t, phase):
    d = str(tmp_path / "run")
    with pytest.raises(Crash):
        train(ESConfig(**SMALL), d, progress=False, echo=None, hook=crash_at(t, phase))
    assert len(iters(d)) == t
    train(None, d, resume=True, progress=False, echo=None)  # None: the stored config
    assert_same_run(reference, d)


def test_torn_log_line_is_dropped(reference, tmp_path):
    d = str(tmp_path / "run")
    with pytest.raises(Crash):
        train(ESConfig(**SMALL), d, progress=False, echo=None, hook=crash_at(3, "logged"))
    log = os.path.join(d, runs.LOG)
    # leftovers of a process killed while writing a checkpoint and swapping in an export
    open(os.path.join(d, "center.safetensors.tmp-999"), "wb").write(b"partial")
    os.makedirs(os.path.join(d, "export.tmp-999"))
    os.replace(os.path.join(d, "export"), os.path.join(d, "export.old-999"))
    good = open(log, "rb").read()
    # the process died in the middle of writing iteration 3's record: no newline, half the JSON
    lines = good.split(b"\n")
    torn = b"\n".join(lines[:-2]) + b"\n" + lines[-2][: len(lines[-2]) // 2]
    open(log, "wb").write(torn)
    assert [r["iteration"] for r in runs.read_log(log) if r["kind"] == "iter"] == [1, 2]
    train(ESConfig(**SMALL), d, resume=True, progress=False, echo=None)
    assert_same_run(reference, d)
    assert open(log, "rb").read().endswith(b"\n")
    assert sorted(os.listdir(d)) == ["base_model", "center.safetensors", "config.yaml", "export", "log.jsonl"]
    # damage before the end is not guessed at
    data = open(log, "rb").read().split(b"\n")
    data[2] = data[2][:10]
    open(log, "wb").write(b"\n".join(data))
    with pytest.raises(ValueError, match="damaged"):
        runs.read_log(log)


def test_replay_rebuilds_final_center(reference, tmp_path):
    out = str(tmp_path / "replayed")
    res = runs.replay(reference, out, echo=None)
    assert res == {"iteration": 6, "out": out, "matches_checkpoint": True}
    a, _ = center(reference)
    b, it = runs.load_center(os.path.join(out, runs.CENTER))
    assert it == 6 and all(torch.equal(a[k], b[k]) for k in a)
    from safetensors.torch import load_file

    ea = load_file(os.path.join(reference, runs.EXPORT, "model.safetensors"))
    eb = load_file(os.path.join(out, runs.EXPORT, "model.safetensors"))
    assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
    # partial replay stops at an earlier iteration (no checkpoint there to compare with)
    res = runs.replay(reference, str(tmp_path / "r3"), upto=3, echo=None)
    assert res["iteration"] == 3 and res["matches_checkpoint"] is None
    # the CLI reports success with exit code 0
    p = subprocess.run(
        [sys.executable, "-m", "espert", "replay", reference, "--out", str(tmp_path / "cli")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "bit-identical" in p.stderr and ": yes" in p.stderr, p.stderr


def test_extending_a_finished_run_equals_a_longer_run(reference, tmp_path):
    d = str(tmp_path / "run")
    train(ESConfig(**{**SMALL, "iterations": 4}), d, progress=False, echo=None)
    train(ESConfig(**SMALL), d, resume=True, progress=False, echo=None)
    assert_same_run(reference, d)


def test_refusals_and_mismatch(reference, tmp_path):
    with pytest.raises(FileExistsError, match="--resume"):
        train(ESConfig(**SMALL), reference, progress=False, echo=None)
    with pytest.raises(ValueError, match=r"config mismatch.*sigma: run has 0.05, given 0.03"):
        train(ESConfig(**{**SMALL, "sigma": 0.03}), reference, resume=True, progress=False, echo=None)
    with pytest.raises(FileNotFoundError, match="run directory not found"):
        train(ESConfig(**SMALL), str(tmp_path / "nope"), resume=True, progress=False, echo=None)
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        train(
            ESConfig(**{**SMALL, "model": str(tmp_path / "missing" / "model")}),
            str(tmp_path / "r"),
            progress=False,
            echo=None,
        )
    # a finished run resumed with its own config is a no-op
    before = open(os.path.join(reference, runs.LOG), "rb").read()
    train(ESConfig(**SMALL), reference, resume=True, progress=False, echo=None)
    assert open(os.path.join(reference, runs.LOG), "rb").read() == before
    json.dumps(runs.read_run_config(reference))  # plain data


def test_bfloat16_live_weights_resume_and_replay(tmp_path):
    """bf16 live weights, float32 master: crash/resume and replay are still bit-identical."""
    cfg = ESConfig(**{**SMALL, "dtype": "bfloat16", "iterations": 4, "checkpoint_every": 0, "eval_every": 0})
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(cfg, a, progress=False, echo=None)
    with pytest.raises(Crash):
        train(cfg, b, progress=False, echo=None, hook=crash_at(3, "updated"))
    train(cfg, b, resume=True, progress=False, echo=None)
    assert_same_run(a, b, iterations=4)
    state, _ = center(a)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert runs.replay(a, str(tmp_path / "r"), echo=None)["matches_checkpoint"] is True


def test_vllm_adam_run_resumes_and_replays_bit_identically(tmp_path, monkeypatch):
    """evaluator: vllm with adam, rademacher noise, sigma_mode rms, decay exclusions and anchored weight decay
    (l1): the checkpoint holds the optimizer state the workers keep (``optim.*``), a run crashed after a
    checkpoint resumes bit-identically to an uninterrupted one (answer diversity included; the workers' anchor
    is the base again after the restart), and replay (the torch center) rebuilds its checkpoint exactly."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core: faster to start
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = ESConfig(
        **{
            **SMALL,
            "evaluator": "vllm",
            "vllm_max_model_len": 64,
            "iterations": 4,
            "optimizer": "adam",
            "noise": "rademacher",
            "sigma_mode": "rms",
            "anchor_decay": 0.02,
            "anchor_decay_norm": "l1",
        }
    )
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train(cfg, a, progress=False, echo=None)
    with pytest.raises(Crash):
        train(cfg, b, progress=False, echo=None, hook=crash_at(3, "updated"))  # after iteration 2's checkpoint
    assert center(b)[1] == 2
    train(cfg, b, resume=True, progress=False, echo=None)
    assert_same_run(a, b, iterations=4)
    # the loop's answer diversity, from the vLLM members' extracted answers: logged, and equal after the resume
    answers = [r["diagnostics"]["answers"] for r in iters(a)]
    assert answers == [r["diagnostics"]["answers"] for r in iters(b)]
    assert all(0.0 <= x["js"] <= 2.0 for x in answers if x["js"] is not None)  # 4 members: at most 2 bits
    assert any(x["js"] is not None for x in answers)
    state, _ = center(a)
    assert state["optim.step"].tolist() == [4] and any(k.startswith("optim.v/") for k in state)
    assert runs.replay(b, str(tmp_path / "r"), echo=None)["matches_checkpoint"] is True
