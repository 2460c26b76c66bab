"""The plot faults a newcomer saw (issue 43): pareto.png said "(faded: dominated)" with nothing faded,
zoomed its y axis so that a 0.03 drop looked large and clipped a label; progressions.png had ticks at
half counts and the title "vs base 'base'"; sweep.png had no title and fractional iteration ticks;
training.png drew its checkpoints as triangles cut in half by the x axis, and its legend did not say that
the members are perturbed copies scored on training prompts and the held-out reward is the center's.
The figures are read before they are saved.  About 3 s."""

import pytest

pytest.importorskip("matplotlib")

from espert.eval import plots  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    """Each figure a plot function makes, laid out, instead of its PNG."""
    made = []

    def keep(fig, path):
        fig.tight_layout()
        fig.canvas.draw()
        made.append(fig)
        return path

    monkeypatch.setattr(plots, "save_figure", keep)
    return made


def _report(points, base="base"):
    return {
        "base": base,
        "solve_rule": "any",
        "task": "copy",
        "pareto": {
            "k": 16,
            "points": {lab: {"pass_at_1": x, "pass_at_16": y, "dominated_by": d} for lab, (x, y, d) in points.items()},
            "front": [lab for lab, (_, _, d) in points.items() if not d],
        },
        "comparisons": {
            "es": {"base": base, "progressions": 3, "regressions": 1, "net": 2},
            "grpo": {"base": base, "progressions": 2, "regressions": 0, "net": 2},
        },
    }


def _inside(fig, text) -> bool:
    """The text's box lies within the figure."""
    box = text.get_window_extent(fig.canvas.get_renderer())
    w, h = fig.canvas.get_width_height()
    return box.x0 >= 0 and box.y0 >= 0 and box.x1 <= w and box.y1 <= h


def test_pareto_says_faded_only_when_something_is_and_shows_the_whole_scale(figures):
    rep = _report({"base": (0.36, 0.984, []), "es": (0.51, 0.953, []), "grpo": (0.73, 0.97, [])})
    plots.plot_pareto(rep, "p.png")
    ax = figures[-1].axes[0]
    assert "faded" not in ax.get_title()
    lo, hi = ax.get_ylim()
    assert lo <= 0.0 and hi >= 1.0  # a 0.03 drop looks like one
    assert all(_inside(figures[-1], t) for t in ax.texts) and {t.get_text() for t in ax.texts} == {"base", "es", "grpo"}
    rep = _report({"base": (0.3, 0.9, ["es"]), "es": (0.5, 0.95, [])})
    plots.plot_pareto(rep, "p.png")
    assert "faded: dominated" in figures[-1].axes[0].get_title()


def test_progressions_count_in_whole_problems_under_a_plain_title(figures):
    plots.plot_progressions(_report({"base": (0.1, 0.2, [])}), "q.png")
    ax = figures[-1].axes[0]
    assert all(float(t).is_integer() for t in ax.get_yticks())
    assert "vs base 'base'" not in ax.get_title() and "against base" in ax.get_title()


def test_sweep_plot_has_a_title_and_whole_iterations(figures):
    from espert.experiments.sweep import plot_sweep

    doc = {
        "grid": {"sigma": ["0.01", "0.03"]},
        "smoothing": 0.99,
        "runs": {f"sigma={s}": {"params": {"sigma": s}, "smoothed": [0.1, 0.2, 0.3]} for s in ("0.01", "0.03")},
    }
    plot_sweep(doc, "s.png")
    ax = figures[-1].axes[0]
    assert "sigma" in ax.get_title()
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_training_curve_says_what_each_line_is_and_draws_inside_its_axes(figures):
    from espert.eval.curve import plot_training

    curve = {
        "iterations": [1, 2, 3, 4],
        "reward_mean": [0.5, 0.6, 0.7, 0.8],
        "reward_std": [0.1] * 4,
        "reward_min": [0.3, 0.4, 0.5, 0.6],
        "reward_max": [0.7, 0.8, 0.9, 1.0],
        "heldout": [(0, 0.55), (2, 0.75), (4, 0.9)],
        "checkpoints": [2, 4],
        "resumes": [2],
        "task": "copy",
        "population": 8,
    }
    plot_training(curve, "t.png")
    ax = figures[-1].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    held = [lab for lab in labels if "held-out" in lab]
    assert held and all("center" in lab for lab in held), labels  # not the members' reward
    assert any("perturbed" in lab and "training prompts" in lab for lab in labels), labels
    assert all(line.get_clip_on() for line in ax.lines)  # nothing drawn over the axis frame
    at = sorted({float(x) for line in ax.lines if line.get_color() == "tab:gray" for x in line.get_xdata()})
    assert at == [2.0, 4.0], at  # one upright line per checkpoint
