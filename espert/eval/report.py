"""Build the evaluation report (a JSON-serializable dict) and its terminal summary."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..tasks.rewards import answer_classes
from .metrics import (
    ACC_BIN_LABELS,
    MAJ_METHODS,
    SOLVE_RULES,
    accuracy_histogram,
    answer_entropy,
    k_values,
    maj_at_k,
    mean_or_none,
    pareto_front,
    pass_at_k,
    solved,
)

REPORT_VERSION = 1


def _correct_flags(rewards: Sequence[float], threshold: float) -> list[bool]:
    return [r >= threshold - 1e-12 for r in rewards]


Equivalence = Optional[Callable[[str, str], bool]]


def model_metrics(
    records: list[dict], threshold: float = 1.0, maj_method: str = "subsets", equivalent: Equivalence = None
) -> dict:
    """All single-model metrics for one model's records (sorted by problem index).

    pass@k and maj@k are reported for k in :func:`k_values` of the smallest per-problem
    sample count (so every problem supports every k).  maj@k and the answer entropy count
    answers by equivalence class (``equivalent``, the task's own; None: identical strings).
    ``accuracy`` (correct samples / all samples) equals pass@1 (the mean over problems of c/n)
    only when every problem has the same n.
    """
    if not records:
        raise ValueError("no problems to evaluate")
    ns = [len(r["completions"]) for r in records]
    if min(ns) < 1:
        raise ValueError("every problem needs at least one sample")
    if maj_method not in MAJ_METHODS:
        raise ValueError(f"unknown maj@k method {maj_method!r}; use one of {', '.join(MAJ_METHODS)}")
    ks = k_values(min(ns))
    per = _per_problem(records, threshold, maj_method, equivalent, ks)
    pass_sums, maj_sums = per.pop("pass"), per.pop("maj")
    P = len(records)
    hist = accuracy_histogram(zip(per["n_correct"], per["n"]))
    rewards = [x for r in records for x in r["rewards"]]
    return {
        "n_problems": P,
        "n_samples_per_problem": ns[0] if min(ns) == max(ns) else {"min": min(ns), "max": max(ns)},
        "n_samples": sum(ns),
        "mean_reward": sum(rewards) / len(rewards),
        "accuracy": sum(per["n_correct"]) / sum(ns),  # = pass@1 only at equal n per problem
        "maj_method": maj_method,
        "pass_at_k": {str(k): pass_sums[i] / P for i, k in enumerate(ks)},
        "maj_at_k": {str(k): maj_sums[i] / P for i, k in enumerate(ks)},
        "accuracy_histogram": {"bins": list(ACC_BIN_LABELS), "counts": hist},
        "unsolved": hist[0],
        "all_correct": hist[-1],
        "abstain_rate": sum(a is None for r in records for a in r["extracted"]) / sum(ns),
        "answer_entropy_mean": mean_or_none(per["entropy"]),
        "n_all_abstain": sum(1 for h in per["entropy"] if h is None),
        "per_problem": {"index": [r["index"] for r in records], **per},
    }


def _per_problem(records: list[dict], threshold: float, maj_method: str, equivalent: Equivalence, ks) -> dict:
    """Per problem: samples n, correct c, maj@n, answer entropy; and the sums over problems of pass@k and
    maj@k for each k in ``ks`` (``"pass"``, ``"maj"``: one list each, in the order of ``ks``)."""
    out = {"n": [], "n_correct": [], "maj_at_n": [], "entropy": []}
    pass_sums, maj_sums = [0.0] * len(ks), [0.0] * len(ks)
    for r in records:
        ok = _correct_flags(r["rewards"], threshold)
        n, c = len(ok), sum(ok)
        votes = answer_classes(r["extracted"], equivalent)
        out["n"].append(n)
        out["n_correct"].append(c)
        out["maj_at_n"].append(maj_at_k(votes, ok, n, maj_method))
        out["entropy"].append(answer_entropy(votes))
        for i, k in enumerate(ks):
            pass_sums[i] += pass_at_k(n, c, k)
            maj_sums[i] += maj_at_k(votes, ok, k, maj_method)
    return {**out, "pass": pass_sums, "maj": maj_sums}


def _check_aligned(base: str, base_recs: list[dict], label: str, recs: list[dict]) -> None:
    bi = [r["index"] for r in base_recs]
    ti = [r["index"] for r in recs]
    if bi != ti:
        missing = sorted(set(bi) ^ set(ti))[:5]
        raise ValueError(
            f"models {base!r} and {label!r} were evaluated on different problems "
            f"(e.g. indices {missing} are in only one of them)"
        )
    for a, b in zip(base_recs, recs):
        if a["prompt"] != b["prompt"] or a["answer"] != b["answer"]:
            raise ValueError(f"models {base!r} and {label!r} have different prompt/answer for problem {a['index']}")


def compare(
    base: str,
    base_recs: list[dict],
    label: str,
    recs: list[dict],
    threshold: float,
    solve_rule: str = "any",
    equivalent: Equivalence = None,
) -> dict:
    """Progressions/regressions of ``label`` against ``base`` plus entropy on those subsets.

    A *progression* is a problem the base model does not solve and the tuned model solves;
    a *regression* is the reverse; "solves" follows ``solve_rule`` (see
    :func:`espert.eval.metrics.solved`).
    """
    if solve_rule not in SOLVE_RULES:
        raise ValueError(f"unknown solve rule {solve_rule!r}; use one of {', '.join(SOLVE_RULES)}")
    _check_aligned(base, base_recs, label, recs)
    prog, regr, both, neither, hb, ht = [], [], [], [], [], []  # hb, ht: each problem's answer entropy
    for b, t in zip(base_recs, recs):
        okb = _correct_flags(b["rewards"], threshold)
        okt = _correct_flags(t["rewards"], threshold)
        vb, vt = answer_classes(b["extracted"], equivalent), answer_classes(t["extracted"], equivalent)
        sb = solved(sum(okb), len(okb), vb, okb, solve_rule)
        st = solved(sum(okt), len(okt), vt, okt, solve_rule)
        (prog if st and not sb else regr if sb and not st else both if sb else neither).append(b["index"])
        hb.append(answer_entropy(vb))
        ht.append(answer_entropy(vt))
    pos = {r["index"]: i for i, r in enumerate(base_recs)}

    def ent(subset: list[int]) -> dict:
        return {
            "n": len(subset),
            "base": mean_or_none([hb[pos[i]] for i in subset]),
            "tuned": mean_or_none([ht[pos[i]] for i in subset]),
        }

    return {
        "base": base,
        "solve_rule": solve_rule,
        "progressions": len(prog),
        "regressions": len(regr),
        "net": len(prog) - len(regr),
        "both_solved": len(both),
        "neither_solved": len(neither),
        "progression_indices": prog,
        "regression_indices": regr,
        "answer_entropy": {
            "all": ent([r["index"] for r in base_recs]),
            "progressions": ent(prog),
            "regressions": ent(regr),
        },
    }


def build_report(
    groups: dict[str, list[dict]],
    base: Optional[str] = None,
    threshold: float = 1.0,
    solve_rule: str = "any",
    maj_method: str = "subsets",
    equivalent: Equivalence | str = "task",
) -> dict:
    """The full report for several models (``groups``: label -> records sorted by index).

    ``base`` (default: the first model) is the reference for progressions/regressions.
    ``maj_method``: ``"subsets"`` (exact average over all k-subsets) or ``"first"`` (first k samples).
    ``equivalent``: answer equivalence for voting and entropy; ``"task"`` (default) takes the
    records' task's own (:func:`espert.tasks.rewards.answer_equivalence`), None compares strings.
    """
    if not groups:
        raise ValueError("no models to report on")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"success threshold must be in (0, 1], got {threshold}")
    labels = list(groups)
    if base is None:
        base = labels[0]
    if base not in groups:
        raise ValueError(f"base model {base!r} not among the evaluated models: {', '.join(labels)}")
    tasks = sorted({str(r.get("task")) for recs in groups.values() for r in recs})
    if equivalent == "task":
        from ..tasks.rewards import answer_equivalence

        equivalent = answer_equivalence(tasks[0]) if len(tasks) == 1 else None
    report = {
        "version": REPORT_VERSION,
        "task": tasks[0] if len(tasks) == 1 else tasks,
        "success_threshold": threshold,
        "base": base,
        "solve_rule": solve_rule,
        "maj_method": maj_method,
        "sampling": {lab: groups[lab][0].get("meta", {}) for lab in labels},
        "models": {lab: model_metrics(groups[lab], threshold, maj_method, equivalent) for lab in labels},
        "comparisons": {
            lab: compare(base, groups[base], lab, groups[lab], threshold, solve_rule, equivalent)
            for lab in labels
            if lab != base
        },
    }
    report["pareto"] = pareto(report["models"])
    return report


def pareto(models: dict[str, dict]) -> dict:
    """pass@1 against pass@K (K: the largest k every model has) for every model of a report, and
    which of them dominate which (:func:`~espert.eval.metrics.pareto_front`): the seed papers' view of
    sharpening (pass@1 up) against coverage (pass@K kept)."""
    ks = set.intersection(*(set(m["pass_at_k"]) for m in models.values()))
    k = max(ks, key=int) if ks else "1"
    points = {lab: (m["pass_at_k"].get("1") or 0.0, m["pass_at_k"].get(k) or 0.0) for lab, m in models.items()}
    dominated = pareto_front(points)
    return {
        "k": int(k),
        "points": {
            lab: {"pass_at_1": x, f"pass_at_{k}": y, "dominated_by": dominated[lab]} for lab, (x, y) in points.items()
        },
        "front": sorted((lab for lab in points if not dominated[lab]), key=lambda lab: points[lab][0]),
    }


def _fmt(x: Optional[float], nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def format_summary(report: dict) -> str:
    """A short human-readable summary of a report (what ``espert eval`` prints)."""
    models = report["models"]
    any_m = next(iter(models.values()))
    ks = list(any_m["pass_at_k"])
    lines = [
        f"task {report['task']}: {any_m['n_problems']} problems, n={any_m['n_samples_per_problem']} samples/problem, "
        f"correct = reward >= {report['success_threshold']:g}"
    ]
    pk = ks if len(ks) <= 4 else [ks[0], ks[len(ks) // 2], ks[-1]]
    head = ["model", "reward"] + [f"pass@{k}" for k in pk] + [f"maj@{ks[-1]}", "unsolved", "all-correct", "H(bits)"]
    rows = [
        [lab, _fmt(m["mean_reward"]), *(_fmt(m["pass_at_k"].get(k)) for k in pk)]
        + [_fmt(m["maj_at_k"][ks[-1]]) if ks[-1] in m["maj_at_k"] else "-", str(m["unsolved"]), str(m["all_correct"])]
        + [_fmt(m["answer_entropy_mean"], 2)]
        for lab, m in models.items()
    ]
    lines += _table(head, rows, left=1)
    par = report.get("pareto")
    if par and len(models) > 1:
        off = [f"{lab} (by {', '.join(p['dominated_by'])})" for lab, p in par["points"].items() if p["dominated_by"]]
        lines.append(
            f"pass@1-pass@{par['k']} Pareto front: {', '.join(par['front'])}"
            + (f"; dominated: {'; '.join(off)}" if off else "; no model is dominated")
        )
    for lab, cmp_ in report["comparisons"].items():
        e = cmp_["answer_entropy"]
        lines.append(
            f"{lab} vs {cmp_['base']} (solve rule '{cmp_['solve_rule']}'): {_count(cmp_['progressions'], 'progression')}, "
            f"{_count(cmp_['regressions'], 'regression')} (net {cmp_['net']:+d})"
        )
        lines.append(
            f"  answer entropy (bits) {cmp_['base']} -> {lab}: all {_fmt(e['all']['base'], 2)} -> "
            f"{_fmt(e['all']['tuned'], 2)}, progressions {_fmt(e['progressions']['base'], 2)} -> "
            f"{_fmt(e['progressions']['tuned'], 2)}, regressions {_fmt(e['regressions']['base'], 2)} -> "
            f"{_fmt(e['regressions']['tuned'], 2)}"
        )
    return "\n".join(lines)


def _count(n: int, what: str) -> str:
    """``1 regression``, ``0 regressions``: a count, never a signed number."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def forgetting(reports: dict[str, dict], base: str) -> tuple[dict, str]:
    """The forgetting table of several tasks' reports (task -> :func:`build_report`): pass@1, pass@K and
    maj@K of every model on every task (K: the largest k of that task's report), and each model's
    change against ``base``: what post-training kept or lost on tasks it was not trained on (the
    second seed paper's Tables 2 and 5).  Returns (the ``forgetting.json`` document, the table as text)."""
    doc: dict = {"base": base, "tasks": {}}
    head = ["task", "model", "pass@1", "pass@K", "maj@K", "d pass@1", "d pass@K", "d maj@K"]
    rows = []
    for spec, rep in reports.items():
        models = rep["models"]
        if base not in models:
            raise ValueError(f"base model {base!r} not among the evaluated models: {', '.join(models)}")
        k = max((int(x) for x in models[base]["pass_at_k"]), default=1)
        task = {"k": k, "models": {}}
        ref = models[base]
        keys = ("pass_at_1", f"pass_at_{k}", f"maj_at_{k}")  # at K = 1 the first two are one key: rows keep three
        ref_vals = (ref["pass_at_k"].get("1"), ref["pass_at_k"].get(str(k)), ref["maj_at_k"].get(str(k)))
        for lab, m in models.items():
            vals = (m["pass_at_k"].get("1"), m["pass_at_k"].get(str(k)), m["maj_at_k"].get(str(k)))
            delta = [None if v is None or r is None else v - r for v, r in zip(vals, ref_vals)]
            task["models"][lab] = {**dict(zip(keys, vals)), "change": dict(zip(keys, delta))}
            signed = [("" if lab == base else f"{d:+.3f}") if d is not None else "n/a" for d in delta]
            rows.append([f"{spec} (K={k})", lab] + [_fmt(v) for v in vals] + signed)
        doc["tasks"][spec] = task
    return doc, "\n".join([f"forgetting: every model on every task, change against {base!r}", *_table(head, rows, 2)])


def _table(head: list[str], rows: list[list[str]], left: int) -> list[str]:
    """``head`` and ``rows`` as lines of columns two spaces apart: the first ``left`` left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    return [
        "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [head, *rows]
    ]
