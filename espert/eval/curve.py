"""The training curve of a run directory as a picture: ``RUN/eval/training.png``.

Held-out reward (the center θ_t on the held-out problems, every ``eval_every`` iterations) and the
member reward (the population's mean, ±1 standard deviation and min-max per iteration) against the
iteration, with the checkpoints and the resumes of the run marked.  ``espert train`` writes it when a
run ends; ``espert analyze run RUN`` (or ``espert analyze RUN``) writes it for any run, also one that
is still training.
"""

from __future__ import annotations

import os

#: where a run's training curve goes, inside the run directory
TRAINING_PNG = os.path.join("eval", "training.png")
#: the members' line in the legend: what they are and what they are scored on (not the held-out prompts)
MEMBERS_MEAN = "members (perturbed θ+σε, training prompts): mean"


def training_curve(run_dir: str) -> dict:
    """The curve's data from ``RUN/log.jsonl`` and ``RUN/config.yaml``: ``iterations`` [t],
    ``reward_mean`` / ``reward_std`` / ``reward_min`` / ``reward_max`` (the members' rewards per
    iteration, floats or None), ``heldout`` [(t, mean)], ``checkpoints`` [t] and ``resumes`` [t] (the
    iteration a resumed process continued from), ``task`` and ``population``."""
    from espert.runs import CONFIG, LOG, iteration_records, read_log, read_run_config

    path = os.path.join(run_dir, LOG)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no run log at {path}")
    # a log alone (copied out of its run) still draws; only the title's task and population are missing
    cfg = read_run_config(run_dir)["config"] if os.path.exists(os.path.join(run_dir, CONFIG)) else {}
    records = read_log(path)
    its = iteration_records(records, path)
    reward = {k: [r["reward"].get(k) for r in its] for k in ("mean", "std", "min", "max")}
    return {
        "iterations": [r["iteration"] for r in its],
        **{f"reward_{k}": v for k, v in reward.items()},
        "heldout": [
            (r["iteration"], r["mean"]) for r in records if r.get("kind") == "eval" and r.get("mean") is not None
        ],
        "checkpoints": sorted({r["iteration"] for r in records if r.get("kind") == "checkpoint"}),
        "resumes": [r["iteration"] for r in records if r.get("kind") == "resume"],
        "task": cfg.get("task"),
        "population": cfg.get("population"),
    }


def _band(ts: list, lows: list, highs: list) -> tuple[list, list, list]:
    """``(t, low, high)`` of the iterations where both ends are numbers."""
    rows = [(t, lo, hi) for t, lo, hi in zip(ts, lows, highs) if lo is not None and hi is not None]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _draw_members(ax, curve: dict) -> None:
    """The members' rewards per iteration: min-max and ±1 std bands around their mean."""
    its = curve["iterations"]
    t_mm, lo, hi = _band(its, curve["reward_min"], curve["reward_max"])
    ax.fill_between(t_mm, lo, hi, color="tab:blue", alpha=0.10, lw=0, label="members: min-max")
    t_sd, mean, std = _band(its, curve["reward_mean"], curve["reward_std"])
    lo, hi = [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
    ax.fill_between(t_sd, lo, hi, color="tab:blue", alpha=0.25, lw=0, label="members: mean ± std")
    means = [(t, m) for t, m in zip(its, curve["reward_mean"]) if m is not None]
    ax.plot([t for t, _ in means], [m for _, m in means], color="tab:blue", lw=1.2, label=MEMBERS_MEAN)


def plot_training(curve: dict, path: str) -> str:
    """Write the training curve (:func:`training_curve`'s data) as a PNG at ``path``; returns ``path``."""
    from matplotlib.ticker import MaxNLocator

    from .plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 5.0), dpi=120)
    # the members are perturbed copies θ+σε scored on the iteration's training prompts, the held-out reward is
    # the center θ on other prompts: the legend says so, or a reader takes the gap between them for a fault
    _draw_members(ax, curve)
    held = curve["heldout"]
    label = "center θ, held-out prompts"
    ax.plot([t for t, _ in held], [m for _, m in held], "o-", color="tab:orange", lw=2, ms=5, label=label)
    for i, t in enumerate(curve["resumes"]):
        ax.axvline(t, color="tab:red", ls="--", lw=1, label="resumed" if i == 0 else None)
    for i, t in enumerate(curve["checkpoints"]):  # upright and inside the axes (markers on the axis were cut)
        ax.axvline(t, color="tab:gray", ls=":", lw=1.2, label="checkpoint" if i == 0 else None)
    values = [v for k in ("reward_min", "reward_max") for v in curve[k] if v is not None] + [m for _, m in held]
    if values and 0.0 <= min(values) and max(values) <= 1.0:
        ax.set_ylim(-0.02, 1.02)  # a reward in [0, 1] on its whole scale (a small change looks small), 0 whole
    last = max(curve["iterations"] + [t for t, _ in held] + [1])
    ax.set_xlim(-0.02 * last, 1.02 * last)  # the first and last held-out points whole
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.grid(True, alpha=0.3)
    rank = {label: 0, MEMBERS_MEAN: 1, "members: mean ± std": 2, "members: min-max": 3}  # then the marks
    handles, labels = zip(*sorted(zip(*ax.get_legend_handles_labels()), key=lambda hl: rank.get(hl[1], 4)))
    # below the curves, never on them, and the axes keep the figure's width
    ax.legend(handles, labels, fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False)
    pop = f", population {curve['population']}" if curve.get("population") else ""
    ax.set_title(f"training curve: task {curve['task']}, {len(curve['iterations'])} iterations{pop}", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return save_figure(fig, path)


def write_training_png(run_dir: str, out_dir: str | None = None) -> str:
    """``training.png`` of the run in ``run_dir`` into ``out_dir`` (default ``RUN/eval``); returns its path.
    Written whole or not at all, without the run's writer lock: a run still training can be plotted."""
    path = os.path.join(out_dir, "training.png") if out_dir else os.path.join(run_dir, TRAINING_PNG)
    return plot_training(training_curve(run_dir), path)
