"""espert sweep: one config over a grid, one normal run directory per point, resumable, and the
second seed paper's smoothed-reward table (debiased exponential smoothing, weight 0.99)."""

import json
import os

import pytest

from espert.cli import main
from espert.experiments.sweep import format_table, parse_grid, point_name, points, smooth
from espert.runs import LOG, read_log

SMALL = [
    "--set",
    "pretrain_steps=0",
    "--set",
    "eval_every=0",
    "--set",
    "prompts_per_iteration=4",
    "--set",
    "population=4",
]


def test_smoothing_is_debiased():
    assert smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # no pull towards 0
    s = smooth([0.0, 1.0], weight=0.5)  # s1 = 0 / 0.5; s2 = (0.5·0 + 0.5·1) / 0.75
    assert s == pytest.approx([0.0, 2 / 3])


def test_grid_and_table():
    grid = parse_grid(["population=8,16", "sigma=0.01,0.02"])
    assert [point_name(p) for p in points(grid)] == [
        "population=8,sigma=0.01",
        "population=8,sigma=0.02",
        "population=16,sigma=0.01",
        "population=16,sigma=0.02",
    ]
    runs = {
        point_name(p): {"params": p, "status": "done", "final_smoothed": i / 10, "iterations": 3, "heldout": []}
        for i, p in enumerate(points(grid))
    }
    text = format_table({"grid": grid, "runs": runs, "smoothing": 0.99})
    assert "| population \\ sigma | 0.01 | 0.02 |" in text and "| 16 | 0.200 | 0.300 |" in text
    with pytest.raises(ValueError, match="did you mean 'population'"):
        parse_grid(["populaton=8"])
    with pytest.raises(ValueError, match="expected KEY=V1,V2"):
        parse_grid(["sigma"])


def test_a_sweep_runs_resumes_and_skips_what_is_done(tmp_path, capsys):
    out = str(tmp_path / "sw")
    argv = ["sweep", "--out", out, "--grid", "sigma=0.01,0.03", "--workers", "2", *SMALL]
    assert main([*argv, "--set", "iterations=2"]) == 0
    first = json.load(open(os.path.join(out, "sweep.json")))
    for name in ("sigma=0.01", "sigma=0.03"):
        run = first["runs"][name]
        assert run["status"] == "done" and run["iterations"] == 2
        assert run["smoothed"] == smooth(run["train_reward"])
    assert first["runs"]["sigma=0.01"]["train_reward"] != first["runs"]["sigma=0.03"]["train_reward"]
    capsys.readouterr()
    assert main([*argv, "--set", "iterations=3"]) == 0  # longer: both runs continue (--resume)
    err = capsys.readouterr().err
    assert "sigma=0.01: resumed" in err and "sigma=0.03: resumed" in err
    second = json.load(open(os.path.join(out, "sweep.json")))
    for name in ("sigma=0.01", "sigma=0.03"):
        assert second["runs"][name]["iterations"] == 3
        assert second["runs"][name]["train_reward"][:2] == first["runs"][name]["train_reward"]
        its = [r["iteration"] for r in read_log(os.path.join(out, "runs", name, LOG)) if r["kind"] == "iter"]
        assert its == [1, 2, 3]
    assert main([*argv, "--set", "iterations=3"]) == 0
    err = capsys.readouterr().err
    assert "sigma=0.01: done already" in err and "started" not in err and "resumed" not in err
    assert os.path.exists(os.path.join(out, "sweep.md"))


def test_a_failing_run_is_reported_and_bad_input_is_one_line(tmp_path, capsys):
    out = str(tmp_path / "sw")
    missing = str(tmp_path / "no-model")
    assert main(["sweep", "--out", out, "--grid", f"model={missing}", *SMALL, "--set", "iterations=1"]) == 1
    err = capsys.readouterr().err
    assert "failed (exit 2)" in err and "1 run(s) failed" in err
    assert (
        "model directory not found" in open(os.path.join(out, "logs", point_name({"model": missing}) + ".log")).read()
    )
    assert main(["sweep", "--out", out, "--grid", "population=3"]) == 2  # odd with antithetic: before any run
    assert capsys.readouterr().err.strip().startswith("espert sweep: error: ")


def test_a_sweep_on_ray_gives_the_runs_of_the_process_sweep(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    argv = ["--grid", "sigma=0.02", *SMALL, "--set", "iterations=1"]
    try:
        ray.init(
            address="local", num_cpus=1, include_dashboard=False, log_to_driver=False
        )  # not another test's cluster
        assert main(["sweep", "--out", str(tmp_path / "ray"), "--ray", *argv]) == 0
    finally:
        ray.shutdown()
    assert "sigma=0.02: started (Ray task)" in capsys.readouterr().err
    assert main(["sweep", "--out", str(tmp_path / "proc"), *argv]) == 0
    on_ray, local = (json.load(open(tmp_path / d / "sweep.json"))["runs"]["sigma=0.02"] for d in ("ray", "proc"))
    assert on_ray["status"] == local["status"] == "done"
    assert on_ray["train_reward"] == local["train_reward"]  # the same run, wherever it ran
