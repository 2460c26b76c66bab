"""Run directories and the CLI: every failure is named, and no completed iteration is lost (issue 9, cases 9-17).

Each test shows one case; the shared helpers (a small run config, a finished reference run, record
comparison) are imported by tests/test_chaos.py and tests/test_corruption.py too.
"""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import SMALL_RUN as SMALL

from espert import runs
from espert.cli import main
from espert.config import ESConfig
from espert.trainer import train

FLAGS = [a for k, v in SMALL.items() for a in (f"--{k.replace('_', '-')}", str(v))] + ["--no-progress"]
#: Record fields that are wall-clock measurements (differ between any two runs).
CLOCK = ("time", "seconds", "eval_seconds")


class Crash(Exception):
    pass


def crash_at(t_crash, phase_crash):
    def hook(t, phase):
        if (t, phase) == (t_crash, phase_crash):
            raise Crash(f"crash at {t} {phase}")

    return hook


def espert(*args, env=None, timeout=300):
    """Run the real ``espert`` command line in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "espert", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def records(run_dir):
    """Every log record without its wall-clock fields and "resume" records (they say when a process took
    over, not what the run is: a resumed run ends with the state records of one that never stopped)."""
    log = runs.read_log(os.path.join(run_dir, runs.LOG))
    return [{k: v for k, v in r.items() if k not in CLOCK} for r in log if r["kind"] != "resume"]


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def assert_same_run(a, b):
    """b ended exactly as a: the same center and export bits, the same log records, no leftovers."""
    sa, ia = runs.load_center(os.path.join(a, runs.CENTER))
    sb, ib = runs.load_center(os.path.join(b, runs.CENTER))
    assert ia == ib and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sha(os.path.join(a, runs.CENTER)) == sha(os.path.join(b, runs.CENTER))
    assert sha(os.path.join(a, runs.EXPORT, "model.safetensors")) == sha(
        os.path.join(b, runs.EXPORT, "model.safetensors")
    )
    ra, rb = records(a), records(b)
    assert [(r["kind"], r.get("iteration")) for r in ra] == [(r["kind"], r.get("iteration")) for r in rb]
    assert ra == rb
    # "eval" is the base-vs-ES report the CLI writes after a tiny-model run ends, not run state
    assert sorted(set(os.listdir(b)) - {"eval"}) == sorted(set(os.listdir(a)) - {"eval"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ref") / "run")
    train(ESConfig(**SMALL), d, progress=False, echo=None)
    return d


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def one_line_error(err, *needles):
    """stderr is one error line that names every needle (no traceback)."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert any(all(n in ln for n in needles) for ln in lines), err


# ---- 9: a kill during setup leaves nothing that blocks the next command -----------------------------------------


def test_kill_during_setup_then_train_or_resume(reference, tmp_path):
    """Today: killed while the base model is built, RUN holds log.jsonl but no config.yaml; `train` says it
    already holds a run and `--resume` says it is not one.  Now the directory appears only when complete."""
    d = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "espert", "train", "--run-dir", d, *FLAGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not os.path.exists(d):
            time.sleep(0.002)
        proc.kill()  # the first moment the run directory exists
    finally:
        proc.wait()
    assert not os.path.exists(d) or os.path.exists(os.path.join(d, runs.CONFIG))
    if os.path.exists(d):
        train(None, d, resume=True, progress=False, echo=None)
    else:
        train(ESConfig(**SMALL), d, progress=False, echo=None)
    assert_same_run(reference, d)


def test_kill_point_during_base_build_leaves_no_directory(tmp_path):
    d = str(tmp_path / "run")
    p = espert("train", "--run-dir", d, *FLAGS, env={runs.KILL_ENV: "setup-base"})
    assert p.returncode == -signal.SIGKILL
    assert not os.path.exists(d)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".run.tmp-")]  # the half-built sibling
    cfg = ESConfig(**{**SMALL, "iterations": 1, "eval_size": 0})
    train(cfg, d, progress=False, echo=None)  # the same command works, and removes the dead sibling
    assert os.listdir(tmp_path) == ["run"]


def test_abandoned_setup_of_older_espert_is_replaced(tmp_path):
    """What a kill during setup left before this fix (an empty log, a half-built base model) is not a run."""
    d = tmp_path / "run"
    os.makedirs(d / ".base_model.tmp-123")
    (d / runs.LOG).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        train(None, str(d), resume=True, progress=False, echo=None)
    cfg = ESConfig(**{**SMALL, "iterations": 1, "eval_size": 0})
    train(cfg, str(d), progress=False, echo=None)
    assert runs.read_run_config(str(d))["config"]["iterations"] == 1


# ---- 10: resume runs the evaluation a kill cut off ----------------------------------------------------------------


@pytest.mark.parametrize("t,phase", [(3, "updated"), (6, "updated"), (4, "logged")])
def test_resume_runs_missing_evaluation_and_checkpoint(reference, tmp_path, t, phase):
    """Today: killed between update 3 and its held-out evaluation, the eval record of iteration 3 never
    appears (and a kill before checkpoint 4 loses that checkpoint record)."""
    d = str(tmp_path / "run")
    with pytest.raises(Crash):
        train(ESConfig(**SMALL), d, progress=False, echo=None, hook=crash_at(t, phase))
    train(None, d, resume=True, progress=False, echo=None)
    assert [r["iteration"] for r in records(d) if r["kind"] == "eval"] == [0, 3, 6]
    assert_same_run(reference, d)


# ---- 11: damaged checkpoints are named, verified by checksum, rebuilt from the log -----------------------------


def damage(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncated":
        data = data[: len(data) // 3]
    elif how == "empty":
        data = bytearray()
    elif how == "zeroed":
        data[100:4196] = bytes(4096)
    elif how == "flipped":  # one bit of one weight: still a valid safetensors file
        data[-5] ^= 0x10
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "empty", "zeroed", "flipped"])
def test_damaged_center_is_named_and_rebuilt(reference, tmp_path, capsys, how):
    """Today: truncated/empty -> SafetensorError traceback on --resume and replay; one flipped byte -> accepted."""
    d = copy_run(reference, tmp_path / "run")
    damage(os.path.join(d, runs.CENTER), how)
    assert main(["replay", d, "--out", str(tmp_path / "rp")]) == 1
    one_line_error(capsys.readouterr().err, "center.safetensors", "damaged center checkpoint")
    assert main(["train", "--run-dir", d, "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    one_line_error(err, "center.safetensors", "damaged center checkpoint", "rebuilding")
    sa, _ = runs.load_center(os.path.join(reference, runs.CENTER))
    sb, it = runs.load_center(os.path.join(d, runs.CENTER))
    assert it == 6 and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sha(os.path.join(d, runs.CENTER)) == sha(os.path.join(reference, runs.CENTER))


def test_every_checkpoint_checksum_is_logged(reference):
    cks = [r for r in records(reference) if r["kind"] == "checkpoint"]
    assert [r["iteration"] for r in cks] == [2, 4, 6]
    assert cks[-1]["sha256"] == sha(os.path.join(reference, runs.CENTER))
    assert len({r["sha256"] for r in cks}) == 3


# ---- 12: invalid config files --------------------------------------------------------------------------------


def test_invalid_yaml_and_toml_name_the_file(tmp_path, capsys):
    """Today: a yaml.parser.ParserError traceback; TOML errors do not name the file."""
    y = tmp_path / "bad.yaml"
    y.write_text("sigma: 0.01\npopulation: [4, 8\nalpha: 0.1\n")
    assert main(["train", "--config", str(y), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    one_line_error(err, str(y), "invalid YAML", "line 3")
    t = tmp_path / "bad.toml"
    t.write_text("sigma = 0.01\npopulation = \n")
    assert main(["train", "--config", str(t), "--run-dir", str(tmp_path / "r")]) == 2
    one_line_error(capsys.readouterr().err, str(t), "invalid TOML", "line 2")
    assert not os.path.exists(tmp_path / "r")


# ---- 13: the base model's fingerprint covers contents ----------------------------------------------------------


@pytest.fixture
def local_model_run(tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    d = str(tmp_path / "run")
    train(ESConfig(**{**SMALL, "model": str(model), "iterations": 2, "eval_size": 0}), d, progress=False, echo=None)
    return str(model), d


def replace_weights(model_dir):
    """Another model.safetensors of exactly the same size (other random weights)."""
    from espert.tiny import build_tiny_model

    other = model_dir + "-other"
    build_tiny_model(other, seed=7)
    src, dst = os.path.join(other, "model.safetensors"), os.path.join(model_dir, "model.safetensors")
    assert os.path.getsize(src) == os.path.getsize(dst)
    shutil.copyfile(src, dst)


def test_replaced_base_weights_are_refused(local_model_run, tmp_path, capsys):
    """Today: with another model.safetensors of the same size, replay --upto 1 returns 0 with wrong weights,
    and --resume after deleting the center returns 0 with a different center."""
    model, d = local_model_run
    before = open(os.path.join(d, runs.LOG), "rb").read()
    replace_weights(model)
    assert main(["replay", d, "--upto", "1", "--out", str(tmp_path / "rp")]) == 2
    one_line_error(capsys.readouterr().err, "model.safetensors: contents changed")
    os.unlink(os.path.join(d, runs.CENTER))
    assert main(["train", "--run-dir", d, "--resume", "--no-progress"]) == 2
    one_line_error(capsys.readouterr().err, "model.safetensors: contents changed", "not the one this run started")
    assert open(os.path.join(d, runs.LOG), "rb").read() == before
    assert not os.path.exists(os.path.join(d, runs.CENTER))


def test_changed_config_json_is_named(local_model_run, capsys):
    model, d = local_model_run
    with open(os.path.join(model, "config.json"), "a") as f:
        f.write("\n")
    assert main(["replay", d]) == 2
    one_line_error(capsys.readouterr().err, "config.json: size changed")


def test_unchanged_base_is_not_hashed_again(local_model_run, monkeypatch):
    model, d = local_model_run
    fp = runs.read_run_config(d)["base_fingerprint"]
    calls = []
    monkeypatch.setattr(runs.fingerprint, "sha256_file", lambda p: calls.append(p) or "x")
    runs.check_base(model, fp)
    assert calls == []  # same size, times and inode: the stored hashes stand
    shutil.copyfile(os.path.join(model, "model.safetensors"), os.path.join(model, "m.tmp"))
    os.replace(os.path.join(model, "m.tmp"), os.path.join(model, "model.safetensors"))
    with pytest.raises(runs.RunError, match="model.safetensors: contents changed"):
        runs.check_base(model, fp)  # a replaced file is hashed again (here by the stand-in hash)
    assert [os.path.basename(p) for p in calls] == ["model.safetensors"]


def test_resume_from_another_directory_with_a_relative_model_path(tiny_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_dir, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    cfg = ESConfig(**{**SMALL, "model": "model", "iterations": 1, "eval_size": 0})
    train(cfg, "run", progress=False, echo=None)
    assert runs.read_run_config("run")["base_model"] == str(tmp_path / "model")
    os.makedirs("elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")
    train(None, "../run", resume=True, progress=False, echo=None)  # the run's absolute base path is used


def make_old_style(run_dir):
    """Turn a run directory into what espert wrote before this change: a size-only base fingerprint, no
    checksums in the log, no checkpoint records."""
    doc = runs.read_run_config(run_dir)
    doc["base_fingerprint"] = runs.legacy.fingerprint_v1(os.path.join(run_dir, doc["base_model"]))
    runs.atomic_write_text(os.path.join(run_dir, runs.CONFIG), runs._dump_config(doc))
    log = os.path.join(run_dir, runs.LOG)
    lines = [json.dumps(r, separators=(",", ":")) for r in runs.read_log(log) if r["kind"] != "checkpoint"]
    open(log, "w").write("".join(ln + "\n" for ln in lines))


def test_old_run_directories_resume_and_replay(reference, tmp_path, capsys):
    d = copy_run(reference, tmp_path / "run")
    make_old_style(d)
    assert main(["replay", d, "--out", str(tmp_path / "rp")]) == 0
    err = capsys.readouterr().err
    assert "bit-identical" in err and ": yes" in err and "cannot be verified" in err
    assert main(["train", "--run-dir", d, "--resume", "--iterations", "8", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "loaded unverified" in err and "cannot be verified" in err
    assert [r["iteration"] for r in records(d) if r["kind"] == "checkpoint"] == [8]
    # an old fingerprint still catches what it covers
    d2 = copy_run(reference, tmp_path / "run2")
    make_old_style(d2)
    with open(os.path.join(d2, runs.BASE, "config.json"), "a") as f:
        f.write("\n")
    assert main(["replay", d2]) == 2
    one_line_error(capsys.readouterr().err, "not the one this run started from")


def test_runs_from_before_pretraining_rebuild_a_random_init_base(reference, tmp_path, capsys):
    """A run directory written before the tiny base was pretrained has no pretrain fields: its
    missing base is rebuilt random-init (what it trained on), not with today's pretraining."""
    import yaml

    d = copy_run(reference, tmp_path / "run")
    path = os.path.join(d, runs.CONFIG)
    doc = yaml.safe_load(open(path, encoding="utf-8"))
    for k in ("pretrain_steps", "pretrain_reverse_share"):
        del doc["config"][k]
    open(path, "w", encoding="utf-8").write(yaml.safe_dump(doc, sort_keys=False))
    log = os.path.join(d, runs.LOG)  # nor did such a run record its fixed settings in the log (legacy rule 8)
    lines = open(log, "rb").read().splitlines(keepends=True)
    open(log, "wb").write(b"".join(ln for ln in lines if not ln.startswith(b'{"kind":"config"')))
    assert runs.read_run_config(d)["config"]["pretrain_steps"] == 0
    shutil.rmtree(os.path.join(d, runs.BASE))
    assert main(["train", "--run-dir", d, "--resume", "--iterations", "7", "--no-progress"]) == 0
    assert main(["replay", d]) == 0
    assert "bit-identical" in capsys.readouterr().err
    assert sha(os.path.join(d, runs.BASE, "model.safetensors")) == sha(
        os.path.join(reference, runs.BASE, "model.safetensors")
    )


# ---- 14: replay refuses a log that ends before the checkpoint ---------------------------------------------------


def test_replay_refuses_a_log_missing_records(reference, tmp_path, capsys):
    """Today: with an empty log, replay returns 0 and writes the base weights although the checkpoint is at 6."""
    d = copy_run(reference, tmp_path / "run")
    open(os.path.join(d, runs.LOG), "wb").close()
    out = tmp_path / "rp"
    assert main(["replay", d, "--out", str(out)]) == 2
    one_line_error(capsys.readouterr().err, "log.jsonl ends at iteration 0", "iteration 6", "missing")
    assert not out.exists()
    assert main(["train", "--run-dir", d, "--resume", "--no-progress"]) == 2
    one_line_error(capsys.readouterr().err, "center.safetensors is at iteration 6", "log.jsonl ends at iteration 0")


# ---- 15: inputs are checked before the run directory exists ------------------------------------------------------


def test_bad_inputs_leave_no_directory(tmp_path, capsys):
    """Today: an unknown task, --device cuda without CUDA (AssertionError traceback), a missing or unreachable
    Hub model each fail after RUN was created, so the corrected command is refused."""
    d = str(tmp_path / "run")
    small = [
        "--iterations",
        "1",
        "--eval-size",
        "0",
        "--population",
        "2",
        "--prompts-per-iteration",
        "2",
        "--train-size",
        "4",
        "--max-new-tokens",
        "2",
        "--pretrain-steps",
        "0",
        "--no-progress",
    ]
    assert main(["train", "--run-dir", d, "--task", "no_such_task", *small]) == 2
    one_line_error(capsys.readouterr().err, "no_such_task")
    assert not os.path.exists(d)
    if not torch.cuda.is_available():
        assert main(["train", "--run-dir", d, "--device", "cuda", *small]) == 2
        one_line_error(capsys.readouterr().err, "'cuda' is not available")
        assert not os.path.exists(d)
    assert main(["train", "--run-dir", d, "--device", "cpu:banana", *small]) == 2
    one_line_error(capsys.readouterr().err, "cpu:banana")
    assert not os.path.exists(d)
    assert main(["train", "--run-dir", d, "--model", str(tmp_path / "no" / "model"), *small]) == 2
    one_line_error(capsys.readouterr().err, "model directory not found")
    assert not os.path.exists(d)
    assert main(["train", "--run-dir", d, *small]) == 0  # the corrected command


@pytest.mark.parametrize("hub_id", ["espert-tests/no-such-model", "no-such-model-xyz"])
def test_unknown_hub_model_fails_fast(tmp_path, capsys, hub_id):
    """A Hub id that is not cached fails in seconds with one line (the Hub is unreachable here, or says 404).
    Today: an org/name id is refused as a missing directory, and a bare name retries for over a minute
    (74 s measured) and ends in an OSError traceback, leaving RUN behind."""
    d = str(tmp_path / "run")
    t0 = time.time()
    code = main(["train", "--run-dir", d, "--model", hub_id, "--iterations", "1", "--no-progress"])
    took = time.time() - t0
    assert code == 2
    one_line_error(capsys.readouterr().err, f"model {hub_id!r}")
    assert took < 20, took
    assert not os.path.exists(d)


def test_hub_ids_are_not_paths():
    assert runs.is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and runs.is_hub_id("gpt2")
    for p in ("./model", "/abs/model", "a/b/c", "../m", "runs/x/"):
        assert not runs.is_hub_id(p), p


# ---- 16: Ctrl-C during startup ---------------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.4, 0.8, 1.2, 1.5, 2.0])
def test_ctrl_c_during_startup_is_one_line(tmp_path, delay):
    """Today: SIGINT while espert imports prints a KeyboardInterrupt traceback; one that lands inside a C++
    callback of torch's import (torch.distributed's) printed pybind11's "terminate called after throwing" and a
    stack (1 of about 10 runs at 1.5 s on an idle machine)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "espert", "train", "--run-dir", str(tmp_path / "run"), *FLAGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    # while espert imports (__main__) or once the command's handlers are up (how far 1.5 s gets depends on the
    # machine's speed): one line either way, and nothing of the run written
    lines = (
        "espert: interrupted; nothing was written",
        "espert: stopped by SIGINT before the first iteration; nothing was written, so the same command starts again",
    )
    assert "Traceback" not in err and err.strip().splitlines()[-1] in lines, err
    assert not (tmp_path / "run" / "center.safetensors").exists() and not (tmp_path / "run" / "log.jsonl").exists()


# ---- 17: byte-identical checkpoint files -------------------------------------------------------------------------


def test_center_files_are_byte_identical(reference, tmp_path):
    """Today: the safetensors metadata order varies between processes, so identical runs hash differently."""
    for i in range(2):  # in fresh processes: the library's order is random per process
        p = subprocess.run(
            [
                sys.executable,
                "-c",
                f"""
import torch
from espert import runs
runs.save_center({str(tmp_path / f"c{i}.safetensors")!r}, {{'b': torch.ones(3), 'a': torch.zeros(2, 2)}}, 3)
""",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
    assert sha(tmp_path / "c0.safetensors") == sha(tmp_path / "c1.safetensors")
    d = str(tmp_path / "again")
    train(ESConfig(**SMALL), d, progress=False, echo=None)
    assert_same_run(reference, d)


def test_write_safetensors_reads_back(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).to(torch.bfloat16),
        "i64": torch.arange(3),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    p = str(tmp_path / "t.safetensors")
    h = runs.write_safetensors(p, tensors, {"z": "1", "a": "2"})
    assert h == sha(p)
    back = load_file(p)
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.parametrize("chunk_bytes", [1, 6, 4096])
def test_file_chunks_rewrite_a_file_byte_identically(tmp_path, chunk_bytes):
    """A streamed checkpoint exports from its center file read back in chunks (FileChunks): any chunk size,
    including one smaller than an element, gives the same tensors and bytes."""
    from espert.tensorfile import FileChunks, write_chunks

    state = {
        "w": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
        "h": torch.arange(9, dtype=torch.bfloat16),
        "optim.step": torch.tensor([3], dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    src, dst = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    sha = runs.write_safetensors(src, state, {"iteration": "3"})
    chunks = FileChunks(src, chunk_bytes)
    assert all(flat.numel() * flat.element_size() <= max(chunk_bytes, flat.element_size()) for _, _, flat in chunks)
    assert write_chunks(dst, chunks, {"iteration": "3"}) == sha
    assert open(src, "rb").read() == open(dst, "rb").read()


# ---- one writer per run (issue: what clusters do to jobs) --------------------------------------------------------


def test_a_second_writer_is_refused_and_the_run_survives(tmp_path):
    """Today: two ``train --resume`` of one run both ran to the end and wrote iterations 3-6 twice into
    log.jsonl; the run could then neither resume nor replay ("expected iteration 7, found 3")."""
    d = str(tmp_path / "run")
    assert main(["train", "--run-dir", d, *FLAGS, "--iterations", "2"]) == 0
    more = [*FLAGS, "--iterations", "12"]
    first = subprocess.Popen(
        [sys.executable, "-m", "espert", "train", "--run-dir", d, "--resume", *more],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lock = runs.lock_path(d)
    deadline = time.time() + 120
    while not (os.path.exists(lock) and open(lock).read().strip()) and first.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    second = subprocess.run(
        [sys.executable, "-m", "espert", "train", "--run-dir", d, "--resume", *more],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert second.returncode == 2, second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert "Traceback" not in second.stderr and line.startswith("espert train: error:"), second.stderr
    assert f"pid {first.pid}" in line and "is being written by" in line, line
    its = [r["iteration"] for r in runs.read_log(os.path.join(d, runs.LOG)) if r.get("kind") == "iter"]
    assert its == list(range(1, 13))  # one history, no iteration twice
    res = runs.replay(d, str(tmp_path / "replayed"), echo=None)
    assert res["matches_checkpoint"] is True
    # the lock died with its holder: the run resumes again
    assert main(["train", "--run-dir", d, "--resume", *FLAGS, "--iterations", "13"]) == 0


# ---- 25: a start writes nothing until everything has loaded ----------------------------------------------------


def test_a_failed_start_leaves_nothing_and_the_retry_works(tiny_dir, tmp_path, capsys, monkeypatch):
    """Before: with a model whose tokenizer (or weights) could not be loaded, RUN/config.yaml and a task
    record were written first, and the retry was refused ("already holds an espert run; pass --resume");
    broken weights also ended in a SafetensorError traceback.  Now every loading stage fails with one
    line, leaves nothing beside the models, and the same command then works."""
    from espert.evaluators import EVALUATORS

    d = str(tmp_path / "runs" / "run")
    small = [*FLAGS, "--iterations", "1", "--eval-size", "0"]
    tok = shutil.copytree(tiny_dir, tmp_path / "tok")
    (tok / "tokenizer.json").write_text("{not json")
    weights = shutil.copytree(tiny_dir, tmp_path / "weights")
    with open(weights / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    (tmp_path / "failing_task.py").write_text("raise RuntimeError('the task data server is down')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken(cfg, path, score):
        raise RuntimeError("out of engines")

    monkeypatch.setitem(EVALUATORS, "broken", broken)
    good = str(shutil.copytree(tiny_dir, tmp_path / "good"))
    stages = [
        (["--model", str(tok)], "JSONDecodeError"),
        (["--model", str(weights)], "SafetensorError"),
        (["--model", good, "--task", "failing_task:reward"], "failing_task"),
        (["--model", good, "--evaluator", "broken"], "out of engines"),
    ]
    for args, needle in stages:
        assert main(["train", "--run-dir", d, *small, *args]) == 2, args
        one_line_error(capsys.readouterr().err, needle)
        assert not os.path.exists(d), args
        assert os.listdir(tmp_path / "runs") == [], args  # no temporary sibling, no lock file
    assert main(["train", "--run-dir", d, *small, "--model", good]) == 0  # the same command, fixed
    assert [r["kind"] for r in runs.read_log(os.path.join(d, runs.LOG))][:3] == ["config", "task", "iter"]


def fork_log(run_dir, from_iteration):
    """What two writers of one run left: the lines from iteration ``from_iteration`` on, written again."""
    path = os.path.join(run_dir, runs.LOG)
    lines = open(path, "rb").read().splitlines(keepends=True)
    first = next(i for i, ln in enumerate(lines) if json.loads(ln).get("iteration") == from_iteration)
    with open(path, "ab") as f:
        f.writelines(lines[first:])
    return len(lines) + 1  # the first line of the second history


def test_a_forked_log_is_refused_then_repaired_and_resumes_exactly(reference, tmp_path, capsys):
    """Before: a log holding iterations 3-6 twice made resume and replay fail with "log.jsonl: expected
    iteration 7, found 3" and no way out.  Now both name the file, line and iteration and give the exact
    recovery; `espert repair` keeps one history, and the resume ends bit for bit where an uninterrupted
    run ends."""
    d = copy_run(reference, tmp_path / "run")
    line = fork_log(d, 3)
    for argv in (["train", "--run-dir", d, "--resume", "--no-progress"], ["replay", d, "--out", str(tmp_path / "r")]):
        assert main(argv) == 2
        one_line_error(
            capsys.readouterr().err,
            f"log.jsonl: line {line} holds iteration 3 again",
            f"espert repair {os.path.abspath(d)} --truncate-after 6",
        )
    before = open(os.path.join(d, runs.LOG), "rb").read()
    assert main(["repair", d, "--truncate-after", "7"]) == 2  # beyond the one history: refused, nothing changed
    one_line_error(capsys.readouterr().err, "only iterations 1..6 form one intact history")
    assert open(os.path.join(d, runs.LOG), "rb").read() == before
    assert main(["repair", d, "--truncate-after", "4"]) == 0  # further back than needed: checkpoint 6 goes
    err = capsys.readouterr().err
    assert "keeps iterations 1..4" in err and "moved center.safetensors, export" in err, err
    backup = [n for n in os.listdir(d) if n.startswith("repair-")]
    assert len(backup) == 1 and open(os.path.join(d, backup[0], runs.LOG), "rb").read() == before
    shutil.rmtree(os.path.join(d, backup[0]))
    train(None, d, resume=True, progress=False, echo=None)  # (the CLI's resume, without its closing report)
    assert_same_run(reference, d)


# ---- 25: SIGTERM and SIGINT stop a run between iterations ------------------------------------------------------


def logged_iterations(run_dir):
    try:
        return sum(b'"kind":"iter"' in ln for ln in open(os.path.join(run_dir, runs.LOG), "rb"))
    except FileNotFoundError:
        return 0


def test_sigterm_and_sigint_stop_cleanly_and_the_resume_is_exact(reference, tmp_path):
    """Before: SIGTERM ended `espert train` with code 143 and not a word.  Now: the iteration in flight ends
    (or, past --stop-grace, is abandoned), one line says where the run stopped and how to continue, and the
    resumed run is bit for bit the uninterrupted one.  Signals land at seeded random moments."""
    rng = random.Random(25)
    # 24 iterations: room for three stops (at 12, a fast machine had finished them all by the third one)
    longer = copy_run(reference, tmp_path / "reference")
    train(ESConfig(**{**SMALL, "iterations": 24}), longer, resume=True, progress=False, echo=None)
    d = str(tmp_path / "run")
    again = f"continue with: espert train --run-dir {d} --resume"
    for sig, extra, after in [
        (signal.SIGTERM, [*FLAGS, "--iterations", "24"], rng.randint(1, 3)),
        (signal.SIGINT, ["--resume", "--no-progress"], None),
        (signal.SIGTERM, ["--resume", "--no-progress", "--stop-grace", "0"], None),
    ]:
        before = logged_iterations(d)
        after = after or before + 1
        p = subprocess.Popen(
            [sys.executable, "-m", "espert", "train", "--run-dir", d, *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # see test_ctrl_c_during_startup
        )
        deadline = time.time() + 120
        while logged_iterations(d) < after and p.poll() is None:
            assert time.time() < deadline
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.15))
        p.send_signal(sig)
        err = p.communicate(timeout=120)[1]
        assert p.returncode == 128 + sig, err
        last = err.strip().splitlines()[-1]
        n = logged_iterations(d)
        assert "Traceback" not in err and last.startswith(f"espert: stopped at iteration {n} ({sig.name}); "), err
        assert last.endswith(again), err
        assert ("did not end within the 0 s grace period" in last) == ("--stop-grace" in extra), err
        assert runs.read_log(os.path.join(d, runs.LOG))  # whole lines only
        assert 1 <= n < 24
    train(None, d, resume=True, progress=False, echo=None)
    assert_same_run(longer, d)


# ---- 25: every writer of a run takes its lock; readers take none and see whole lines only -----------------------


def test_other_writers_take_the_lock_and_readers_see_whole_lines(reference, tmp_path, capsys):
    """Before: `replay` (into RUN/replay) and `analyze --export` into the run wrote while a writer held it.
    Now they exit 2 with one line naming the holder and change nothing; replay elsewhere and analyze without
    --export take no lock, and a log line still being written is invisible to them (and left to its writer)."""
    from espert.files import lock_run, unlock_run

    d = copy_run(reference, tmp_path / "run")
    log = os.path.join(d, runs.LOG)
    with open(log, "ab") as f:  # the writer is halfway through its next line
        f.write(runs.log_line({"kind": "iter", "iteration": 7, "seeds": [1], "coeffs": [0.5]})[:30])
    torn = open(log, "rb").read()
    listing = sorted(os.listdir(d))
    base, export = os.path.join(d, runs.BASE), os.path.join(d, runs.EXPORT)
    lock = lock_run(d)  # a writer holds the run (another open file: flock refuses this process too)
    try:
        for argv in (
            ["replay", d],
            ["analyze", "--base", base, "--ckpt", export, "--export", os.path.join(d, "thin"), "--threshold", "0"],
        ):
            assert main(argv) == 2, argv
            one_line_error(capsys.readouterr().err, f"{d} is being written by pid {os.getpid()} on ", "heartbeat")
            assert sorted(os.listdir(d)) == listing and open(log, "rb").read() == torn
        other = str(tmp_path / "replayed")
        assert main(["replay", d, "--out", other]) == 0  # reads whole lines: 6 iterations, as the checkpoint
        assert sha(os.path.join(other, runs.CENTER)) == sha(os.path.join(reference, runs.CENTER))
        assert main(["analyze", "--base", base, "--ckpt", export]) == 0
        assert open(log, "rb").read() == torn  # readers never touch the writer's line
    finally:
        unlock_run(lock)
    capsys.readouterr()


def test_a_holder_record_from_another_host_refuses_the_lock(reference, tmp_path, capsys):
    """flock is unreliable on some network filesystems: a fresh heartbeat from another host refuses the lock
    even where flock grants it; a stale one (the writer is gone) does not."""
    from espert.files import HEARTBEAT_STALE, lock_run, unlock_run

    d = copy_run(reference, tmp_path / "run")
    rec = "pid 4242 on other-host since 2026-12-01T10:00:00 heartbeat {:.0f}\n"
    with open(runs.lock_path(d), "w") as f:
        f.write(rec.format(time.time() - 5))
    assert main(["train", "--run-dir", d, "--resume", "--no-progress"]) == 2
    one_line_error(capsys.readouterr().err, "pid 4242 on other-host", "flock is unreliable", runs.lock_path(d))
    assert runs.read_log(os.path.join(d, runs.LOG)) == runs.read_log(os.path.join(reference, runs.LOG))
    with open(runs.lock_path(d), "w") as f:
        f.write(rec.format(time.time() - HEARTBEAT_STALE - 5))
    unlock_run(lock_run(d))
