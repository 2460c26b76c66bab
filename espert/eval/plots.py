"""PNG plots of an evaluation report (matplotlib, headless Agg backend)."""

from __future__ import annotations

import os

from .metrics import ACC_BIN_LABELS


def pyplot():
    """matplotlib.pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> str:
    """Lay out, write the PNG, and free the figure; returns ``path``."""
    from espert.files import atomic_write

    fig.tight_layout()
    fmt = os.path.splitext(path)[1][1:] or "png"
    try:  # whole or not at all, like every file espert writes
        atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt))
    finally:
        pyplot().close(fig)
    return path


def plot_pass_at_k(report: dict, path: str) -> str:
    """pass@k (solid) and maj@k (dashed) vs k for all models on one axes, log2 x axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    all_k = set()
    for i, (lab, m) in enumerate(report["models"].items()):
        ks = [int(k) for k in m["pass_at_k"]]
        all_k.update(ks)
        col = colors[i % len(colors)]
        ax.plot(ks, [m["pass_at_k"][str(k)] for k in ks], marker="o", color=col, label=f"{lab} pass@k")
        maj = [m["maj_at_k"][str(k)] for k in ks]
        ax.plot(ks, maj, marker="s", ms=4, ls="--", color=col, alpha=0.7, label=f"{lab} maj@k")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(all_k))
    ax.set_xticklabels([str(k) for k in sorted(all_k)])
    ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("score")
    ax.set_title(f"pass@k and maj@k — task {report['task']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save_figure(fig, path)


def plot_accuracy_histograms(report: dict, path: str) -> str:
    """Per-problem fraction-correct histograms, one panel per model, side by side (shared y)."""
    plt = pyplot()
    models = report["models"]
    n = len(models)
    fig, axes = plt.subplots(1, n, figsize=(max(5.0, 4.6 * n), 4.0), dpi=120, sharey=True, squeeze=False)
    x = list(range(len(ACC_BIN_LABELS)))
    ymax = max(max(m["accuracy_histogram"]["counts"]) for m in models.values())
    for ax, (lab, m) in zip(axes[0], models.items()):
        counts = m["accuracy_histogram"]["counts"]
        colors = ["#c0392b"] + ["#7f8c8d"] * (len(x) - 2) + ["#27ae60"]
        bars = ax.bar(x, counts, color=colors, edgecolor="black", linewidth=0.5)
        for b, c in zip(bars, counts):
            if c:
                ax.text(b.get_x() + b.get_width() / 2, c, str(c), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x)
        ax.set_xticklabels(ACC_BIN_LABELS, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{lab}  (unsolved {m['unsolved']}/{m['n_problems']})", fontsize=10)
        ax.set_xlabel("fraction of samples correct")
        ax.set_ylim(0, ymax * 1.15 + 0.5)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("problems")
    fig.suptitle(f"Per-problem accuracy — task {report['task']}", fontsize=11)
    return save_figure(fig, path)


def plot_progressions(report: dict, path: str) -> str:
    """Progression (green, up) and regression (red, down) counts per tuned model vs the base."""
    plt = pyplot()
    comps = report["comparisons"]
    labels = list(comps)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(labels) + 2.5), 4.0), dpi=120)
    if not labels:
        ax.text(0.5, 0.5, "only one model: no comparison", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        x = list(range(len(labels)))
        prog = [comps[lab]["progressions"] for lab in labels]
        regr = [comps[lab]["regressions"] for lab in labels]
        b1 = ax.bar([i - 0.2 for i in x], prog, width=0.4, color="#27ae60", label="progressions")
        b2 = ax.bar([i + 0.2 for i in x], regr, width=0.4, color="#c0392b", label="regressions")
        for b in (*b1, *b2):
            h = b.get_height()
            ax.text(b.get_x() + b.get_width() / 2, h, str(int(h)), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{lab}\n(net {comps[lab]['net']:+d})" for lab in labels])
        top = max(prog + regr + [1])
        ax.set_ylim(0, top * 1.2 + 0.5)
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of problems: whole numbers
        ax.set_ylabel("problems")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(
        f"problems gained and lost against {report['base']} (solve rule '{report['solve_rule']}')", fontsize=10
    )
    return save_figure(fig, path)


def plot_pareto(report: dict, path: str) -> str:
    """pass@1 (x) against pass@K (y) for every model: the front drawn as a staircase, dominated
    models faded (the report's ``pareto`` section)."""
    plt = pyplot()
    par = report["pareto"]
    k = par["k"]
    fig, ax = plt.subplots(figsize=(5.2, 4.4), dpi=120)
    for lab, p in par["points"].items():
        x, y = p["pass_at_1"], p[f"pass_at_{k}"]
        faded = bool(p["dominated_by"])
        ax.scatter([x], [y], s=40, alpha=0.3 if faded else 1.0, color="tab:gray" if faded else "tab:blue")
        right = x > 0.75  # a label near the right edge goes to the left of its point, inside the axes
        offset = (-5 if right else 5, -11 if y > 0.93 else 4)
        ha, alpha = "right" if right else "left", 0.5 if faded else 1.0
        ax.annotate(lab, (x, y), textcoords="offset points", xytext=offset, ha=ha, fontsize=8, alpha=alpha)
    front = [(par["points"][lab]["pass_at_1"], par["points"][lab][f"pass_at_{k}"]) for lab in par["front"]]
    if len(front) > 1:
        ax.step([x for x, _ in front], [y for _, y in front], where="post", color="tab:blue", alpha=0.6)
    ax.set_xlim(-0.02, 1.02)  # both axes on their whole scale: a drop of 0.03 looks like one
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("pass@1")
    ax.set_ylabel(f"pass@{k}")
    ax.grid(True, alpha=0.3)
    faded = any(p["dominated_by"] for p in par["points"].values())
    ax.set_title(f"pass@1-pass@{k} Pareto front" + (" (faded: dominated)" if faded else ""), fontsize=10)
    return save_figure(fig, path)


def plot_lines(curves: dict, path: str, xlabel: str, ylabel: str, title: str) -> str:
    """One line with markers per label: ``curves = {label: [(x, y), ...]}``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 3.8), dpi=120)
    for lab, pts in curves.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=lab)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def write_plots(report: dict, out_dir: str) -> list[str]:
    """Write ``pass_at_k.png``, ``accuracy_hist.png``, ``progressions.png`` and ``pareto.png`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    out = [
        plot_pass_at_k(report, os.path.join(out_dir, "pass_at_k.png")),
        plot_accuracy_histograms(report, os.path.join(out_dir, "accuracy_hist.png")),
        plot_progressions(report, os.path.join(out_dir, "progressions.png")),
    ]
    if "pareto" in report and len(report["pareto"]["points"]) > 1:
        out.append(plot_pareto(report, os.path.join(out_dir, "pareto.png")))
    return out
