"""Tests for espert.tasks: rewards, extractors, the copy task and dataset loaders."""

import json
import math

import pytest

from espert.tasks import (
    Task,
    copy_extract,
    copy_reward,
    countdown_answer,
    countdown_check,
    countdown_evaluate,
    countdown_extract,
    countdown_reward,
    gsm8k_extract,
    gsm8k_reward,
    known_tasks,
    last_boxed,
    load_task,
    make_copy_task,
    make_task,
    math_equal,
    math_extract,
    math_reward,
    reward_task,
)
from espert.tasks.copy_task import is_heldout_string
from espert.tasks.rewards import gsm8k_reward_strict, normalize_latex

# ------------------------------------------------------------------ GSM8K


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("3 + 4 = 7 so #### 7", "#### 7", 1.0),
        ("#### 1,234", "blah #### 1234", 1.0),
        ("#### $18.00", "#### 18", 1.0),
        ("#### 18.", "#### 18", 1.0),
        ("#### -3", "#### -3", 1.0),
        ("#### 0.5", "#### 1/2", 1.0),  # fractions compare exactly
        ("#### 3/4", "#### 0.75", 1.0),
        ("#### 1/3", "#### 0.33", 0.0),
        ("#### 17", "#### 18", 0.0),
        ("#### 18 apples, not 19", "#### 18", 1.0),  # first number after ####
        ("it is 18 and #### 20", "#### 18", 0.0),  # #### wins over earlier numbers
        ("no number here", "#### 18", 0.0),
        ("", "#### 18", 0.0),
        ("The answer is 18.", "#### 18", 1.0),  # last-number fallback (documented)
        ("I got 18, no wait, 19", "#### 18", 0.0),
        ("#### 1,000,000", "#### 1000000", 1.0),
    ],
)
def test_gsm8k_reward(completion, answer, expected):
    assert gsm8k_reward([completion], [answer]) == [expected]


def test_gsm8k_strict_needs_marker():
    assert gsm8k_reward_strict(["The answer is 18."], ["#### 18"]) == [0.0]
    assert gsm8k_reward_strict(["#### 18"], ["#### 18"]) == [1.0]


def test_gsm8k_extract_canonical():
    assert gsm8k_extract("#### $1,000.50") == "1000.5"
    assert gsm8k_extract("#### 18.00") == "18"
    assert gsm8k_extract("nothing") is None
    assert gsm8k_extract("x #### y") is None
    assert gsm8k_extract("5 #### y") == "5"  # nothing after ####: last-number fallback
    assert gsm8k_extract("5 #### y", fallback_last_number=False) is None
    assert gsm8k_extract("#### 2/6") == "1/3"


def test_gsm8k_bad_gold_raises():
    with pytest.raises(ValueError, match="no number"):
        gsm8k_reward(["#### 1"], ["#### none"])


# ------------------------------------------------------------------ MATH


def test_last_boxed_nested_and_last():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{\sqrt{2}}}") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{{a}{b}}") == "{a}{b}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed 5 done") == "5"
    assert last_boxed(r"\boxed{unbalanced") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        (r"so \boxed{\frac{1}{2}}", r"\frac12", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{14}{3}}", r"\frac{14}{3}", 1.0),
        (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"\boxed{x^2+1}", r"1+x^2", 1.0),
        (r"\boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{a/b}", 1.0),  # nested braces
        (r"\boxed{3}", r"4", 0.0),
        (r"\boxed{\frac{1}{3}}", r"0.5", 0.0),
        ("the answer is 1/2", r"\frac12", 0.0),  # no box -> 0
        (r"\boxed{}", "1", 0.0),
        (r"\boxed{\frac{1}{2}", r"\frac12", 0.0),  # malformed box
        (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", 1.0),
        (r"solution ... \boxed{5}", r"The answer is $\boxed{5}$.", 1.0),  # gold given as solution
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward([completion], [answer]) == [expected]


def test_math_equal_string_fallback_when_math_verify_raises(monkeypatch):
    import math_verify

    def boom(*a, **k):
        raise RuntimeError("parser exploded")

    monkeypatch.setattr(math_verify, "parse", boom)
    assert math_equal(r"\dfrac{1}{2}", r"\frac{1}{2}")  # equal after normalization
    assert not math_equal(r"\frac{1}{2}", "0.5")  # needs math_verify -> fallback says no


def test_math_extract_normalized():
    assert math_extract(r"\boxed{ \dfrac{1}{2} }") == r"\frac{1}{2}"
    assert math_extract(r"\boxed{x = 5}") == "5"
    assert math_extract("nothing") is None
    assert normalize_latex(r"90^\circ") == "90"


# ------------------------------------------------------------------ Countdown


def cd(target, nums):
    return countdown_answer(target, nums)


@pytest.mark.parametrize(
    "completion,target,nums,expected",
    [
        ("<think>...</think><answer>(1 + 2) * 4</answer>", 12, [1, 2, 4], 1.0),
        ("<answer>4*(1+2) = 12</answer>", 12, [4, 2, 1], 1.0),  # trailing "= value" dropped
        ("<answer>1+2+4</answer>", 12, [1, 2, 4], 0.0),  # wrong value
        ("<answer>(1+2)*4*1</answer>", 12, [1, 2, 4], 0.0),  # extra number
        ("<answer>(2+2)*3</answer>", 12, [2, 3, 4], 0.0),  # number reused, one unused
        ("<answer>3*4</answer>", 12, [2, 3, 4], 0.0),  # not all numbers used
        ("<answer>12</answer>", 12, [12, 1], 0.0),
        ("<answer>6/(3-3)+12</answer>", 12, [6, 3, 3, 12], 0.0),  # division by zero
        ("<answer>7/2*2</answer>", 7, [7, 2, 2], 1.0),  # exact fractions
        ("<answer>1/3*3</answer>", 1, [1, 3, 3], 1.0),  # float would round
        ("<answer>(1+2)**4</answer>", 81, [1, 2, 4], 0.0),  # power not allowed
        ("<answer>-1+2+4</answer>", 5, [1, 2, 4], 0.0),  # unary minus not allowed
        ("<answer>1.0+2+4</answer>", 7, [1, 2, 4], 0.0),  # floats not allowed
        ("<answer>__import__('os')</answer>", 0, [1], 0.0),  # names/calls not allowed
        ("<answer>(1+2</answer>", 3, [1, 2], 0.0),  # syntax error
        ("(1 + 2) * 4", 12, [1, 2, 4], 0.0),  # no answer tag
        ("<answer>1+1</answer> <answer>(1+2)*4</answer>", 12, [1, 2, 4], 1.0),  # last block counts
        ("<answer>4 × (1 + 2)</answer>", 12, [1, 2, 4], 1.0),  # unicode operator
    ],
)
def test_countdown_reward(completion, target, nums, expected):
    assert countdown_reward([completion], [cd(target, nums)]) == [expected]


def test_countdown_evaluate_never_evals():
    with pytest.raises(ValueError):
        countdown_evaluate("open('x')")
    with pytest.raises(ValueError, match="division by zero"):
        countdown_evaluate("1/(2-2)")
    v, used = countdown_evaluate("(10-4)/4")
    assert v == pytest.approx(1.5) and sorted(used) == [4, 4, 10]
    assert not countdown_check("9" * 600, 1, [1])


def test_countdown_gold_formats():
    assert countdown_reward(["<answer>1+2</answer>"], [json.dumps({"target": 3, "nums": [2, 1]})]) == [1.0]
    with pytest.raises(ValueError, match="Countdown reference"):
        countdown_reward(["<answer>1</answer>"], ["24"])
    assert countdown_extract("<answer> 1 + 2 = 3 </answer>") == "1+2"
    assert countdown_extract("nothing") is None


# ------------------------------------------------------------------ copy


def test_copy_reward_partial_credit():
    answers = ["abcd"] * 6
    comps = ["abcd", "abcz", " a b c d\n", "ab", "", "abcdxyz"]
    assert copy_reward(comps, answers) == [1.0, 0.75, 1.0, 0.5, 0.0, 1.0]
    assert copy_extract("ab cdef", "abcd") == "abcd"
    assert copy_extract("  ", "abcd") is None


def test_copy_task_deterministic_and_disjoint():
    a = make_copy_task(200, "train")
    b = make_copy_task(200, "train")
    t = make_copy_task(100, "test")
    assert a.prompts == b.prompts
    assert len(set(a.answers)) == 200
    assert not set(a.answers) & set(t.answers)
    assert all(not is_heldout_string(s) for s in a.answers)
    assert all(is_heldout_string(s) for s in t.answers)
    for p, ans in zip(a.prompts, a.answers):
        assert p == ans + ">" and 4 <= len(ans) <= 6 and set(ans) <= set("abcdef")
    # a different seed gives different (still disjoint) problems
    c = make_copy_task(50, "train", seed=123)
    assert c.prompts != a.prompts[:50]
    assert all(r == 1.0 for r in a.score(a.answers, a.answers))
    with pytest.raises(ValueError):
        make_copy_task(10, "bogus")


# ------------------------------------------------------------------ Task / loaders


def test_task_validates_rewards():
    t = make_task("u", ["p"], ["a"], lambda cs, as_: [float("nan")] * len(cs))
    with pytest.raises(ValueError, match="non-finite"):
        t.score(["x"], ["a"])
    t = make_task("u", ["p"], ["a"], lambda cs, as_: [1.5] * len(cs))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        t.score(["x"], ["a"])
    t = make_task("u", ["p"], ["a"], lambda cs, as_: [1.0])
    with pytest.raises(ValueError, match="1 rewards for 2"):
        t.score(["x", "y"], ["a", "a"])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        t.score(["x", "y"], ["a"])
    with pytest.raises(ValueError, match="prompts but"):
        Task("u", ["p", "q"], ["a"], reward_fn=lambda c, a: [0.0])


def test_user_callables_batched_and_per_item():
    batched = make_task("b", ["p1", "p2"], ["x", "y"], lambda cs, ans: [float(c == a) for c, a in zip(cs, ans)])
    per_item = make_task("i", ["p1", "p2"], ["x", "y"], lambda c, a: float(c.strip() == a), per_item=True)
    assert batched.score(["x", "z"], ["x", "y"]) == [1.0, 0.0]
    assert per_item.score([" x ", "y"], ["x", "y"]) == [1.0, 1.0]
    assert per_item.extract("  y  ") == "y" and per_item.extract("   ") is None


def test_load_task_unknown_and_missing(tmp_path):
    with pytest.raises(ValueError) as e:
        load_task("nope", "test")
    for name in ("gsm8k", "math500", "countdown", "copy"):
        assert name in str(e.value)
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_task("gsm8k", "test", path=str(missing))
    assert set(known_tasks()) >= {"gsm8k", "math500", "countdown", "copy"}


def test_load_jsonl_shapes(tmp_path):
    g = tmp_path / "g.jsonl"
    g.write_text('{"question": "1+1?", "answer": "1+1=2\\n#### 2"}\n\n{"prompt": "P", "answer": "#### 3"}\n')
    t = load_task("gsm8k", "test", path=str(g))
    assert len(t) == 2 and t.prompts[0].startswith("1+1?") and t.prompts[1] == "P"
    assert t.score(["#### 2", "#### 4"], t.answers) == [1.0, 0.0]
    assert len(load_task("gsm8k", "test", n=1, path=str(g))) == 1

    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"problem": "half?", "answer": "\\frac12"}) + "\n")
    t = load_task("math", "test", path=str(m))
    assert t.name == "math500" and "\\boxed{}" in t.prompts[0]
    assert t.score(["\\boxed{0.5}"], t.answers) == [1.0]

    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps({"target": 24, "nums": [4, 6, 1]}) + "\n")
    t = load_task("countdown", "test", path=str(c))
    assert "[4, 6, 1]" in t.prompts[0] and "24" in t.prompts[0]
    assert t.score(["<answer>4*6*1</answer>"], t.answers) == [1.0]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_task("gsm8k", "test", path=str(bad))
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_task("copy", "test", path=str(bad))


def test_reward_task_for_rescoring():
    t = reward_task("copy")
    assert len(t) == 0 and t.score(["abcd"], ["abce"]) == [0.75]
    assert t.extract("abcdef", "abc") == "abc"
    assert math.isclose(reward_task("math").score([r"\boxed{2}"], ["2"])[0], 1.0)
