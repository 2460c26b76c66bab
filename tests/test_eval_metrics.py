"""Tests for espert.eval metrics and the report on a fixed, hand-checked sample file."""

import itertools
import json
import math
import os

import pytest

from espert.eval.metrics import (
    ACC_BIN_LABELS,
    accuracy_bin,
    accuracy_histogram,
    answer_entropy,
    k_values,
    maj_at_k,
    pass_at_k,
    solved,
)
from espert.eval.report import build_report, format_summary
from espert.eval.runner import load_sample_files
from espert.eval.samples import group_by_model, load_samples, save_samples

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


# ------------------------------------------------------------------ pass@k


def brute_force_pass_at_k(flags, k):
    subsets = list(itertools.combinations(range(len(flags)), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        flags = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(flags, k), abs=1e-12), (n, c, k)


def test_pass_at_k_stable_large_n():
    # C(1024, 512) overflows floats; the product form stays finite and exact enough
    v = pass_at_k(1024, 3, 512)
    exact = 1 - math.comb(1021, 512) / math.comb(1024, 512)
    assert v == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(1024, 0, 1024) == 0.0 and pass_at_k(1024, 1, 1024) == 1.0


@pytest.mark.parametrize("n,c,k", [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1), (0, 0, 1), (4, 1.5, 1)])
def test_pass_at_k_rejects_bad_input(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(10) == [1, 2, 4, 8, 10]
    with pytest.raises(ValueError):
        k_values(0)


# ------------------------------------------------------------------ maj@k


def test_maj_plurality_and_abstentions():
    # plurality winner among non-abstaining votes
    assert maj_at_k(["7", None, None, "7", "8"], [True, False, False, True, False], 5) == 1.0
    # abstentions do not vote: a single correct vote beats three abstentions
    assert maj_at_k([None, None, None, "7"], [False, False, False, True], 4) == 1.0
    # all abstain -> wrong
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    # method="first": only the first k samples vote
    assert maj_at_k(["8", "7", "7"], [False, True, True], 1, method="first") == 0.0
    assert maj_at_k(["8", "7", "7"], [False, True, True], 3, method="first") == 1.0
    # default: the average over all k-subsets (2 of the 3 single samples say "7")
    assert maj_at_k(["8", "7", "7"], [False, True, True], 1) == pytest.approx(2 / 3)


def test_maj_ties_get_fractional_credit():
    assert maj_at_k(["5", "6"], [True, False], 2) == 0.5
    assert maj_at_k(["5", "6", "5", "6"], [True, False, True, False], 4) == 0.5
    assert maj_at_k(["1", "2", "3", "4"], [False, False, True, False], 4) == 0.25
    assert maj_at_k(["1", "2"], [True, True], 2) == 1.0  # both tied answers correct
    # a tie is decided among the top answers only
    assert maj_at_k(["1", "1", "2", "2", "3"], [False, False, True, True, False], 5) == 0.5


def test_maj_answer_correct_only_if_all_its_votes_are():
    assert maj_at_k(["5", "5"], [True, False], 2) == 0.0


def test_maj_rejects_bad_input():
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True, False], 1)
    with pytest.raises(ValueError):
        maj_at_k(["1", "2"], [True, False], 3)
    with pytest.raises(ValueError, match="unknown maj@k method"):
        maj_at_k(["1", "2"], [True, False], 1, method="random")


def brute_force_maj_at_k(ext, ok, k):
    """Vote of every k-subset, averaged; an answer is correct iff all of its n samples are."""
    cls_ok = {a: all(o for b, o in zip(ext, ok) if b == a) for a in set(ext) - {None}}
    subsets = list(itertools.combinations(range(len(ext)), k))
    return sum(
        maj_at_k([ext[i] for i in s], [cls_ok.get(ext[i], False) for i in s], k, method="first") for s in subsets
    ) / len(subsets)


def test_maj_subsets_matches_enumeration():
    import random

    rng = random.Random(0)
    for _ in range(150):
        n, J = rng.randint(1, 9), rng.randint(1, 5)
        ext = [rng.choice([None] + [str(j) for j in range(J)]) for _ in range(n)]
        good = {str(j) for j in rng.sample(range(J), rng.randint(0, J))}
        ok = [e in good for e in ext]
        for k in range(1, n + 1):
            assert maj_at_k(ext, ok, k) == pytest.approx(brute_force_maj_at_k(ext, ok, k), abs=1e-12), (ext, ok, k)


def test_maj_subsets_has_less_order_dependence_than_first_k():
    # the same multiset of answers in two orders: first-k changes, the subset average does not
    a = ["7", "7", "5", "5", "5"]
    ok_a = [x == "5" for x in a]
    b = a[::-1]
    ok_b = ok_a[::-1]
    assert maj_at_k(a, ok_a, 2, method="first") == 0.0 and maj_at_k(b, ok_b, 2, method="first") == 1.0
    assert maj_at_k(a, ok_a, 2) == maj_at_k(b, ok_b, 2) == pytest.approx(brute_force_maj_at_k(a, ok_a, 2))


def test_maj_votes_over_equivalence_classes():
    from espert.tasks.rewards import answer_classes, answer_equivalence

    # three correct samples in three spellings against two wrong "7": strings lose, classes win
    ext = ["\\frac{1}{2}", "0.5", "1/2", "7", "7"]
    ok = [True, True, True, False, False]
    assert maj_at_k(ext, ok, 5) == 0.0
    classes = answer_classes(ext, answer_equivalence("math500"))
    assert classes == [0, 0, 0, 1, 1]
    assert maj_at_k(classes, ok, 5) == 1.0
    assert answer_classes(["0.5", "1/2", "0.50", "2"], answer_equivalence("gsm8k")) == [0, 0, 0, 1]
    assert answer_equivalence("copy") is None and answer_equivalence("not-a-task") is None


def test_report_votes_over_math_equivalence():
    recs = [
        {
            "model": "m",
            "task": "math500",
            "index": 0,
            "prompt": "p",
            "answer": "\\frac{1}{2}",
            "completions": ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{7}", "\\boxed{7}"],
        }
    ]
    from espert.eval.samples import score_records
    from espert.tasks import reward_task

    score_records(recs, reward_task("math500"))
    assert recs[0]["rewards"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    rep = build_report({"m": recs})
    assert rep["models"]["m"]["maj_at_k"]["5"] == 1.0  # 3 of 5 samples agree up to equivalence
    assert rep["models"]["m"]["maj_at_k"]["4"] == pytest.approx(0.7)  # 3 of 5 subsets tie 2:2
    assert rep["models"]["m"]["answer_entropy_mean"] == pytest.approx(-(0.6 * math.log2(0.6) + 0.4 * math.log2(0.4)))
    strings = build_report({"m": recs}, equivalent=None)
    assert strings["models"]["m"]["maj_at_k"]["5"] == 0.0


# ------------------------------------------------------------------ histogram


@pytest.mark.parametrize(
    "c,n,label",
    [
        (0, 10, "0"),
        (1, 10, "(0,0.1]"),
        (1, 100, "(0,0.1]"),
        (11, 100, "(0.1,0.2]"),
        (3, 10, "(0.2,0.3]"),
        (2, 10, "(0.1,0.2]"),
        (5, 10, "(0.4,0.5]"),
        (9, 10, "(0.8,0.9]"),
        (91, 100, "(0.9,1)"),
        (99, 100, "(0.9,1)"),
        (10, 10, "1"),
        (1, 1, "1"),
        (0, 1, "0"),
        (1, 3, "(0.3,0.4]"),
        (2, 3, "(0.6,0.7]"),
    ],
)
def test_accuracy_bin_edges(c, n, label):
    assert ACC_BIN_LABELS[accuracy_bin(c, n)] == label


def test_accuracy_histogram_counts():
    h = accuracy_histogram([(0, 4), (0, 4), (4, 4), (1, 4), (3, 10)])
    assert len(h) == 12 and sum(h) == 5
    assert h[0] == 2 and h[11] == 1 and h[3] == 2
    with pytest.raises(ValueError):
        accuracy_bin(5, 4)


# ------------------------------------------------------------------ entropy


def test_entropy_known_distributions():
    assert answer_entropy(["a", "b", "c", "d"]) == pytest.approx(2.0)
    assert answer_entropy(["a"] * 5) == 0.0
    assert answer_entropy(["a", "b"]) == pytest.approx(1.0)
    assert answer_entropy(["a", "a", "a", "b"]) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    # abstentions are excluded from the distribution
    assert answer_entropy(["a", None, "b", None]) == pytest.approx(1.0)
    assert answer_entropy([None, None]) is None


def test_solve_rules():
    ext, ok = ["1", "2", "2"], [True, False, False]
    assert solved(1, 3, ext, ok, "any")
    assert not solved(1, 3, ext, ok, "majority")
    assert not solved(1, 3, ext, ok, "vote")
    assert not solved(2, 4, ["1"] * 4, [True, True, False, False], "majority")  # exactly half is not a majority
    with pytest.raises(ValueError):
        solved(1, 3, ext, ok, "bogus")


# ------------------------------------------------------------------ report regression test


def _fixture_groups(rescore=True):
    return load_sample_files([os.path.join(FIX, "eval_samples.jsonl")], rescore_rewards=rescore)


@pytest.mark.parametrize("rescore", [False, True])
def test_report_on_fixture_matches_hand_computed_numbers(rescore):
    expected = json.load(open(os.path.join(FIX, "eval_expected_report.json")))
    rep = build_report(_fixture_groups(rescore), base="base", maj_method="first")
    for label, exp in expected["models"].items():
        got = rep["models"][label]
        for key in ("mean_reward", "accuracy", "abstain_rate", "answer_entropy_mean"):
            assert got[key] == pytest.approx(exp[key], abs=1e-12), (label, key)
        for key in ("unsolved", "all_correct", "n_all_abstain"):
            assert got[key] == exp[key], (label, key)
        assert got["accuracy_histogram"]["counts"] == exp["accuracy_histogram"]
        assert got["pass_at_k"] == pytest.approx(exp["pass_at_k"], abs=1e-12)
        assert got["maj_at_k"] == pytest.approx(exp["maj_at_k"], abs=1e-12)
    cmp_ = rep["comparisons"]["tuned"]
    exp = expected["comparison_tuned_vs_base_rule_any"]
    for key in (
        "progressions",
        "regressions",
        "net",
        "both_solved",
        "neither_solved",
        "progression_indices",
        "regression_indices",
    ):
        assert cmp_[key] == exp[key], key
    for subset, vals in exp["answer_entropy"].items():
        assert cmp_["answer_entropy"][subset]["n"] == vals["n"]
        assert cmp_["answer_entropy"][subset]["base"] == pytest.approx(vals["base"], abs=1e-12)
        assert cmp_["answer_entropy"][subset]["tuned"] == pytest.approx(vals["tuned"], abs=1e-12)
    text = format_summary(rep)
    assert "2 progressions, 1 regression (net +1)" in text  # counts, not signed numbers ("-0 regressions")
    rep["comparisons"]["tuned"].update(regressions=0, net=2)
    assert "2 progressions, 0 regressions (net +2)" in format_summary(rep)


def test_report_maj_default_is_the_subset_average():
    groups = _fixture_groups()
    rep = build_report(groups, base="base")
    for label, recs in groups.items():
        want = {}
        for k in rep["models"][label]["maj_at_k"]:
            want[k] = sum(
                brute_force_maj_at_k(r["extracted"], [x >= 1.0 for x in r["rewards"]], int(k)) for r in recs
            ) / len(recs)
        assert rep["models"][label]["maj_at_k"] == pytest.approx(want, abs=1e-12)
        assert rep["models"][label]["maj_method"] == "subsets"


def test_accuracy_equals_pass1_only_at_equal_n():
    recs = [
        {
            "model": "m",
            "task": "copy",
            "index": 0,
            "prompt": "ab>",
            "answer": "ab",
            "completions": ["ab"],
            "rewards": [1.0],
            "extracted": ["ab"],
        },
        {
            "model": "m",
            "task": "copy",
            "index": 1,
            "prompt": "ba>",
            "answer": "ba",
            "completions": ["x", "y", "z"],
            "rewards": [0.0, 0.0, 0.0],
            "extracted": ["x", "y", "z"],
        },
    ]
    m = build_report({"m": recs})["models"]["m"]
    assert m["accuracy"] == 0.25 and m["pass_at_k"]["1"] == 0.5  # micro vs macro average
    recs[1].update(completions=["x"], rewards=[0.0], extracted=["x"])
    m = build_report({"m": recs})["models"]["m"]
    assert m["accuracy"] == m["pass_at_k"]["1"] == 0.5


def test_rescoring_recomputes_rewards(tmp_path):
    recs = load_samples(os.path.join(FIX, "eval_samples.jsonl"))
    for r in recs:  # corrupt stored rewards: re-scoring must fix them, --no-rescore must not
        r["rewards"] = [0.0] * len(r["rewards"])
    p = tmp_path / "corrupt.jsonl"
    save_samples(str(p), recs)
    fixed = build_report(load_sample_files([str(p)]), base="base")
    stale = build_report(load_sample_files([str(p)], rescore_rewards=False), base="base")
    assert fixed["models"]["base"]["mean_reward"] == pytest.approx(0.35)
    assert stale["models"]["base"]["mean_reward"] == 0.0


def test_solve_rule_changes_progressions():
    rep = build_report(_fixture_groups(), base="base", solve_rule="majority")
    # majority (c/n > 0.5): base solves only p4; tuned solves p0 and p4 (p1/p3 are exactly half)
    assert rep["comparisons"]["tuned"]["progression_indices"] == [0]
    assert rep["comparisons"]["tuned"]["regression_indices"] == []
    rep = build_report(_fixture_groups(), base="base", solve_rule="vote")
    # vote (maj@n == 1): base p0,p4; tuned p0,p3,p4
    assert rep["comparisons"]["tuned"]["progression_indices"] == [3]


def test_report_input_errors(tmp_path):
    groups = _fixture_groups()
    with pytest.raises(ValueError, match="base model 'nope'"):
        build_report(groups, base="nope")
    with pytest.raises(ValueError, match="no models"):
        build_report({})
    groups["tuned"] = groups["tuned"][:-1]
    with pytest.raises(ValueError, match="different problems"):
        build_report(groups, base="base")
    bad = tmp_path / "bad.jsonl"
    rec = json.loads(open(os.path.join(FIX, "eval_samples.jsonl")).readline())
    for mutate, msg in [
        (lambda r: r.update(rewards=[float("nan")] * 4), "not a finite"),
        (lambda r: r.update(rewards=[1.0]), "4 completions but 1 rewards"),
        (lambda r: r.update(completions=[], rewards=[], extracted=[]), "non-empty"),
        (lambda r: r.update(rewards=[2.0] * 4), "outside"),
        (lambda r: r.pop("answer"), "missing key 'answer'"),
    ]:
        r = json.loads(json.dumps(rec))
        mutate(r)
        bad.write_text(json.dumps(r) + "\n")
        with pytest.raises(ValueError, match=msg):
            load_samples(str(bad))
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_samples(str(tmp_path / "absent.jsonl"))
    bad.write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="more than once"):
        group_by_model(load_samples(str(bad)))
