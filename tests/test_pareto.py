"""The pass@1-pass@K Pareto front of a report (the second seed paper's Figure 3), on known points."""

import pytest

from espert.eval.metrics import pareto_front
from espert.eval.report import build_report, format_summary
from espert.eval.samples import make_records
from espert.tasks import load_task


def test_front_on_known_points():
    pts = {"base": (0.2, 0.6), "grpo": (0.5, 0.4), "es": (0.3, 0.7), "es_grpo": (0.5, 0.7), "worse": (0.1, 0.5)}
    got = pareto_front(pts)
    assert got["es_grpo"] == [] and got["worse"] == ["base", "es", "es_grpo"]
    assert got["base"] == ["es", "es_grpo"] and got["grpo"] == ["es_grpo"] and got["es"] == ["es_grpo"]
    assert pareto_front({"a": (0.5, 0.5), "b": (0.5, 0.5)}) == {"a": [], "b": []}  # ties stay on the front
    assert pareto_front({"a": (0.5, 0.5), "b": (0.5, 0.6)}) == {"a": ["b"], "b": []}  # better on one only


def test_report_has_the_front_and_says_it(tmp_path):
    task = load_task("copy", "test", n=4)
    right = [[a] * 4 for a in task.answers]
    # sharp: right on 2 problems always, wrong on the rest; broad: right once on every problem
    sharp = [[a] * 4 if i < 2 else ["x"] * 4 for i, a in enumerate(task.answers)]
    broad = [[a, "x", "x", "x"] for a in task.answers]
    groups = {lab: make_records(lab, task, c) for lab, c in (("base", broad), ("sharp", sharp), ("best", right))}
    rep = build_report(groups, base="base")
    par = rep["pareto"]
    assert par["k"] == 4
    assert par["points"]["base"]["pass_at_1"] == pytest.approx(0.25) and par["points"]["base"]["pass_at_4"] == 1.0
    assert par["points"]["sharp"]["pass_at_1"] == 0.5 and par["points"]["sharp"]["pass_at_4"] == 0.5
    assert par["front"] == ["best"]
    assert par["points"]["sharp"]["dominated_by"] == ["best"]
    assert "pass@1-pass@4 Pareto front: best; dominated: base (by best); sharp (by best)" in format_summary(rep)
    rep2 = build_report({k: groups[k] for k in ("base", "sharp")}, base="base")
    assert rep2["pareto"]["front"] == ["base", "sharp"]
    assert "no model is dominated" in format_summary(rep2)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from espert.eval.plots import write_plots

    task = load_task("copy", "test", n=2)
    groups = {lab: make_records(lab, task, [[a, c] for a in task.answers]) for lab, c in (("base", "x"), ("es", "y"))}
    paths = write_plots(build_report(groups), str(tmp_path))
    assert str(tmp_path / "pareto.png") in paths and (tmp_path / "pareto.png").stat().st_size > 1000
