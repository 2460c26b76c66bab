"""Generated tasks: countdown (solvable by construction, two rewards) and arithmetic (a difficulty knob)."""

import os

import pytest

from espert import runs
from espert.cli import main
from espert.tasks import countdown_check, load_task, reward_task, task_fingerprint
from espert.tasks.generated import generate_arithmetic, generate_countdown, make_arithmetic_task
from espert.tasks.rewards import countdown_format_score

#: sha256 of the default train/test problems (n=64).  A change to a generator changes these, and a
#: run on the old problems then refuses to resume: change them only on purpose.
FINGERPRINTS = {
    "countdown": "904085a1b521ff2eb2d7d1a997ed880a8222ffaaf770c3955dff27e581f147dd",
    "arithmetic": "fe5c91b519b6c91ad50e0c4f44c0ef1db50ea5626e8d10e36a6743172ec99122",
}


def test_countdown_is_generated_offline_and_solvable_by_construction():
    probs = generate_countdown(300, seed=5, heldout=False)
    assert probs == generate_countdown(300, seed=5, heldout=False)  # deterministic in the seed
    assert probs != generate_countdown(300, seed=6, heldout=False)
    for nums, target, solution in probs:
        assert 3 <= len(nums) <= 4 and all(1 <= x <= 99 for x in nums) and 1 <= target <= 999
        assert countdown_check(solution.replace(" ", ""), target, nums), (nums, target, solution)
    assert len({(tuple(sorted(n)), t) for n, t, _ in probs}) == 300
    train, test = load_task("countdown", "train"), load_task("countdown", "test")
    assert (len(train), len(test)) == (1024, 256) and set(train.prompts).isdisjoint(test.prompts)
    assert train.meta["source"] == "generated" and "<answer>" in train.prompts[0]


def test_countdown_rewards_zero_one_and_es_at_scale_format_credit():
    t = load_task("countdown", "test", n=4)
    f = load_task("countdown_format", "test", n=4)
    assert f.prompts == t.prompts and f.answers == t.answers
    (nums, target, sol), *_ = generate_countdown(1, seed=1, heldout=True)
    assert t.prompts[0].startswith(f"Using the numbers {nums}, create an equation that equals {target}.")
    good_full = f" reasoning </think>\n<answer>{sol}</answer>"
    good_loose = f"I think <answer>{sol}</answer> done"
    wrong_full = " reasoning </think>\n<answer>1 + 2</answer>"
    think_only = " hmm </think> no answer"
    nothing = "no tags"
    cs = [good_full, good_loose, wrong_full, think_only, nothing]
    ans = [t.answers[0]] * len(cs)
    assert t.score(cs, ans) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # ES-at-Scale: 0.1 * format + answer, format 1.0 (exact layout), else 0.1 (think) + 0.5 (answer); / 1.1
    assert [countdown_format_score(c) for c in cs] == [1.0, 0.5, 1.0, 0.1, 0.0]  # no </think>: 0.5
    expected = [1.1, 1.05, 0.1, 0.01, 0.0]
    assert f.score(cs, ans) == pytest.approx([e / 1.1 for e in expected])
    assert [f.is_correct(r) for r in f.score(cs, ans)] == [True, True, False, False, False]
    assert reward_task("countdown-format").success_threshold == pytest.approx(1 / 1.1)


def test_arithmetic_difficulty_knob_and_reward():
    easy = generate_arithmetic(50, seed=0, heldout=False)
    assert all(e.count("+") == 1 and v == eval(e) for e, v in easy)  # noqa: S307 - our own expressions
    assert all(10 <= int(x) <= 99 for e, _ in easy for x in e.split(" + "))
    hard = generate_arithmetic(50, seed=0, heldout=False, digits=3, ops="+-*", terms=3)
    assert all(v == eval(e) and len(e.split()) == 5 for e, v in hard)  # noqa: S307
    assert {o for e, _ in hard for o in e.split()[1::2]} == {"+", "-", "*"}
    with pytest.raises(ValueError, match="cannot draw"):
        generate_arithmetic(200, seed=0, heldout=True, digits=1)  # only ~20 held-out one-digit sums exist
    with pytest.raises(ValueError, match="ops from"):
        make_arithmetic_task(ops="/")
    t = load_task("arithmetic", "test", n=3)
    assert t.prompts[0].endswith(" =") and t.answers[0] == str(eval(t.prompts[0][:-2]))  # noqa: S307
    a = t.answers[0]
    cs = [f" {a}", f" {a}\n12 + 3 = 15", f"{t.prompts[0]} {a}", f"The answer is {a}.", f" {int(a) + 1}", "", "x"]
    assert t.score(cs, [a] * len(cs)) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert t.extract(" 1,234") == "1234" and t.extract(" -7") == "-7"


@pytest.mark.parametrize("name", sorted(FINGERPRINTS))
def test_generated_tasks_are_deterministic_with_stable_fingerprints(name):
    train, test = load_task(name, "train", n=64), load_task(name, "test", n=64)
    again = load_task(name, "train", n=64), load_task(name, "test", n=64)
    assert task_fingerprint(train, test) == task_fingerprint(*again) == FINGERPRINTS[name]
    assert set(train.prompts).isdisjoint(test.prompts)
    assert load_task(name, "train", n=64, seed=3).prompts != train.prompts


@pytest.mark.extended  # ESPERT_SLOW=1: by default README's `espert train --model smollm2-135m-instruct --task
# arithmetic ...` trains on this task (tests/test_documented_commands.py), and the tiny runs cover the CLI path
def test_espert_train_on_arithmetic(tmp_path, capsys):
    d = str(tmp_path / "run")
    flags = ["--pretrain-steps", "0", "--iterations", "2", "--population", "2", "--prompts-per-iteration", "3"]
    flags += ["--train-size", "16", "--eval-size", "3", "--max-new-tokens", "3", "--no-progress"]
    assert main(["train", "--run-dir", d, "--task", "arithmetic", *flags]) == 0
    assert "held-out mean reward: it 0:" in capsys.readouterr().err
    rec = next(r for r in runs.read_log(os.path.join(d, runs.LOG)) if r.get("kind") == "task")
    assert rec["spec"] == "arithmetic" and rec["source"] == "builtin" and (rec["n_train"], rec["n_eval"]) == (16, 3)
    expected = task_fingerprint(load_task("arithmetic", "train", n=16), load_task("arithmetic", "test", n=3))
    assert rec["fingerprint"] == expected
    assert main(["train", "--run-dir", d, "--resume", "--iterations", "3", "--no-progress"]) == 0


# ---- the task ladder: NAME@LEVEL, and espert calibrate ----------------------------------------------------


def test_levels_turn_the_generators_knobs():
    """``arithmetic@L`` and ``countdown@L``: the digits and operation mix, the size of the Countdown pool;
    ``arithmetic`` is ``arithmetic@1`` and ``countdown`` is ``countdown@4``, problem for problem."""
    from espert.tasks.generated import ARITHMETIC_LEVELS, COUNTDOWN_LEVELS

    assert load_task("arithmetic@1", "test", n=32).prompts == load_task("arithmetic", "test", n=32).prompts
    assert load_task("countdown@4", "train", n=32).prompts == load_task("countdown", "train", n=32).prompts
    for level in range(1, len(ARITHMETIC_LEVELS) + 1):
        t = load_task(f"arithmetic@{level}", "test", n=64)
        knobs = ARITHMETIC_LEVELS[level - 1]
        assert t.name == "arithmetic" and t.meta["level"] == level and t.meta["ops"] == knobs["ops"]
        ops_seen = {tok for p in t.prompts for tok in p.split() if tok in "+-*"}
        assert ops_seen == set(knobs["ops"]), (level, ops_seen)
        assert all(len(p.split()) == 2 * knobs["terms"] for p in t.prompts)  # terms, operators and "="
    assert len(COUNTDOWN_LEVELS) >= 5
    for level in range(1, len(COUNTDOWN_LEVELS) + 1):
        t = load_task(f"countdown@{level}", "train", n=64)
        knobs = COUNTDOWN_LEVELS[level - 1]
        probs = generate_countdown(64, 0, False, **knobs)
        assert t.meta["level"] == level and len(t) == 64
        assert all(knobs["min_numbers"] <= len(n) <= knobs["max_numbers"] for n, _, _ in probs)
        assert all(max(n) <= knobs["max_number"] for n, _, _ in probs)
    assert len(load_task("countdown_format@2", "test", n=8)) == 8


@pytest.mark.parametrize(
    "spec, message",
    [
        ("arithmetic@0", "arithmetic has levels 1 to"),
        ("arithmetic@99", "arithmetic has levels 1 to"),
        ("arithmetic@x", "level must be a whole number"),
        ("gsm8k@2", "gsm8k has no difficulty levels"),
    ],
)
def test_bad_levels_are_refused_in_one_line(spec, message, tmp_path, capsys):
    with pytest.raises(ValueError, match=message):
        load_task(spec, "test", n=4)
    assert main(["train", "--task", spec, "--run-dir", str(tmp_path / "r"), "--iterations", "1"]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]  # after "run directory: ..."
    assert line.startswith("espert train: error:") and message in line
    assert not os.path.exists(tmp_path / "r")


def test_calibrate_picks_the_first_level_in_range():
    from espert.eval.calibrate import pick_level

    assert pick_level({1: 1.0, 2: 0.8, 3: 0.5, 4: 0.2}) == 3
    assert pick_level({1: 0.05, 2: 0.3}) == 2  # too hard first, then in range: the first in range
    assert pick_level({1: 0.9, 2: 0.75}) is None
    assert pick_level({1: 0.7, 2: 0.1}) == 1  # the bounds are inside
    assert pick_level({1: 0.5}, low=0.6, high=0.9) is None


def test_calibrate_reports_the_base_reward_per_level(tiny_dir, tmp_path, capsys):
    """``espert calibrate`` on the tiny model: one row per level (problems, reward, seconds), the pick (none: the
    tiny copy model solves no sum), and a JSON report; a task without levels is one line, exit 2."""
    import json

    out = tmp_path / "cal.json"
    code = main(
        ["calibrate", "--model", tiny_dir, "--task", "arithmetic", "--levels", "1,3", "--limit", "4"]
        + ["--max-new-tokens", "4", "--json", str(out)]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "arithmetic@1" in text and "arithmetic@3" in text and "no level" in text
    doc = json.loads(out.read_text())
    assert [r["level"] for r in doc["levels"]] == [1, 3] and doc["pick"] is None
    assert all(r["problems"] == 4 and 0.0 <= r["reward"] <= 1.0 for r in doc["levels"])
    assert main(["calibrate", "--model", tiny_dir, "--task", "gsm8k"]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert line.startswith("espert calibrate: error:") and "gsm8k has no difficulty levels" in line
