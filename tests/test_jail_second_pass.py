"""The code jail's second pass: what an independent attack found it did not hold (findings of issue 50).

- **No state between checks** (finding 1): as root every jail of one espert process joined one user
  namespace, so every check saw the same user keyring, and a completion with no solution in it learnt the
  answers over repeated scorings.  Each check now has a user namespace of its own: two checks of one process
  report different ones.
- **A jail that starts clean** (finding 2): bwrap was started with espert's environment (``--clearenv`` clears
  only the program's), and not as root the jail's process 1 runs as the candidate's uid, so ``/proc/1/environ``
  showed every variable.  Now bwrap itself starts with the jail's minimal environment: the candidate finds
  no secret of espert's environment in ``/proc/1/environ`` or its own, as root and as a non-root user.
- **No foreign calls** (finding 4): the interpreter's whole prefix was mounted, site-packages included, so
  ``import cffi`` (on ``sys.path`` by hand) made foreign calls past the ``_ctypes`` mask.  Now the jail sees
  the standard library and lib-dynload only.

As root, the last test runs the hostile suites again as uid 65534 (tests/fixtures/as_nobody.sh: ``setpriv`` in
a private mount namespace where the interpreter's prefix, under /root with mode 0700 here, is reachable): a test
device, as a user's own account would be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from espert import jail
from espert.jail.sandbox import Check, Limits, run_check

pytestmark = pytest.mark.skipif(not jail.status().available, reason=f"no jail here: {jail.status().reason}")

SECRET = "espert-jail-secret-" + uuid.uuid4().hex[:8]
LIMITS = Limits(timeout_s=5.0, memory_mb=512)

#: The candidate's probes; each defines f() returning what it found (the tests print it, so it reaches output).
NAMESPACE = "import os\ndef f():\n    return os.readlink('/proc/self/ns/user')\n"
ENVIRON = textwrap.dedent("""
    def f():
        found = []
        for p in ('/proc/1/environ', '/proc/self/environ', '/proc/2/environ'):
            try:
                with open(p, 'rb') as fh:
                    found.append(fh.read().decode(errors='replace'))
            except OSError as e:
                found.append(type(e).__name__)
        return '|'.join(found)
""")
FOREIGN = textwrap.dedent("""
    import sys, sysconfig, os
    for p in [sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], '/usr/lib/python3/dist-packages']:
        sys.path.append(p)
    try:
        import cffi
        cffi.FFI().dlopen(None)
        reached = 'foreign call made'
    except BaseException as e:
        reached = 'refused: ' + type(e).__name__
    def f():
        return reached
""")


def _probe(candidate: str) -> str:
    r = run_check(Check(candidate=candidate, tests="print('FOUND', f())", calls=("f",)), LIMITS)
    assert r.status == "passed", (r.status, r.error, r.output)
    return next(line for line in r.output.splitlines() if line.startswith("FOUND"))[len("FOUND ") :]


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the jails shared one user namespace")
def test_each_check_has_a_user_namespace_of_its_own():
    assert _probe(NAMESPACE) != _probe(NAMESPACE)


def test_no_secret_of_esperts_environment_reaches_the_jail(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    found = _probe(ENVIRON)
    assert SECRET not in found and "HF_TOKEN" not in found, found


def test_no_foreign_function_interface_in_the_jail():
    found = _probe(FOREIGN)
    assert found.startswith("refused"), found


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"), reason="run as root to drop"
)
def test_the_hostile_suites_pass_as_a_non_root_user():
    """The earlier hostile suite, the sandbox's tests and this module's, as uid 65534 (tests/fixtures/as_nobody.sh:
    setpriv in a private mount namespace where the interpreter's prefix is reachable)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suites = ["tests/test_sandbox.py", "tests/test_sandbox_hostile.py", "tests/test_jail_second_pass.py"]
    p = subprocess.run(
        [os.path.join(repo, "tests", "fixtures", "as_nobody.sh"), sys.executable, "-m", "pytest", "-q",
         "-p", "no:cacheprovider", "-o", "addopts=", *suites],
        cwd=repo, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    tail = p.stdout[-4000:] + p.stderr[-2000:]
    assert p.returncode == 0 and " passed" in tail and " failed" not in tail, tail


# ---- MBPP checked against trusted names (finding 3) -------------------------------------------------------

SPHERE = {
    "task_id": 82,
    "text": "Write a function to find the volume of a sphere.",
    "test_list": ["assert math.isclose(volume_sphere(10), 4188.790204786391, rel_tol=0.001)"],
    "test_setup_code": "",
    "test_imports": ["import math"],
}
FORGED_MATH = "```python\nclass math:\n    isclose = staticmethod(lambda *a, **k: True)\n\ndef volume_sphere(r):\n    return 0\n```"
RIGHT = "```python\nimport math\n\ndef volume_sphere(r):\n    return 4 / 3 * math.pi * r ** 3\n```"


def _mbpp(tmp_path, rows):
    from espert.tasks import load_task

    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_task("mbpp", path=str(path))


@pytest.mark.parametrize("imports", [True, False], ids=["test_imports", "stdlib module without test_imports"])
def test_mbpp_modules_come_from_the_checker_not_the_candidate(tmp_path, imports):
    row = dict(SPHERE) if imports else {k: v for k, v in SPHERE.items() if k != "test_imports"}
    task = _mbpp(tmp_path, [row])
    assert task.score([FORGED_MATH], task.answers) == [0.0]
    assert task.score([RIGHT], task.answers) == [1.0]


def test_mbpp_row_whose_tests_read_an_untrusted_name_is_refused_at_load(tmp_path):
    row = dict(SPHERE, task_id=7, test_list=["assert volume_sphere(10) == EXPECTED"])
    with pytest.raises(ValueError) as e:
        _mbpp(tmp_path, [row])
    msg = str(e.value)
    assert "\n" not in msg and "EXPECTED" in msg and "7" in msg


# ---- a reward independent of the rest of its batch (finding 5) --------------------------------------------

SLEEPER = "def f():\n    import time\n    time.sleep(60)\n"


def test_a_correct_completion_scores_1_whatever_its_batch_holds(monkeypatch):
    """Each check has its own budget: a correct completion after checks that use up theirs still runs.  Measured
    before: with the batch's budget scaled down (900 s for 8 workers' worth of 10 s checks, here 2.5 s), the
    correct completion after 6 sleeping ones was 'skipped' and scored 0.0."""
    from espert.jail.sandbox import Check, Limits
    from espert.tasks import code

    monkeypatch.setattr(code, "CODE_LIMITS", Limits(timeout_s=1.0, memory_mb=512))
    monkeypatch.setattr(code, "CODE_BATCH_TIMEOUT_S", 2.5, raising=False)  # the former batch budget, scaled
    checks = [Check(SLEEPER, "assert f() == 1", ("f",))] * 6 + [
        Check("def f():\n    return 1\n", "assert f() == 1", ("f",))
    ]
    assert code.run_code_checks(checks) == [0.0] * 6 + [1.0]


# ---- a reward independent of the machine's load (finding 6) -----------------------------------------------

BURN = "import time\ndef f():\n    t = time.process_time()\n    while time.process_time() - t < 0.6:\n        pass\n    return 1\n"


def test_the_budget_is_cpu_time_not_the_machines_load():
    """A solution that needs 0.6 s of CPU passes a 1 s budget next to two CPU hogs per core (its wall time is then
    well past 1 s).  Measured before, scaled from the issue: 7.5 s of CPU passed a 10 s
    budget alone (9.9 s) and timed out next to 2 hogs; the budget was wall time."""
    # each hog in a session of its own: with the kernel's autogroups a session is a scheduling group, and a
    # jail (bwrap --new-session) is one too, so hogs in the test's session would take one share between them
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(2 * (os.cpu_count() or 1))
    ]
    try:
        time.sleep(0.5)  # the hogs are running
        r = run_check(Check(BURN, "assert f() == 1", ("f",)), Limits(timeout_s=1.0, memory_mb=512))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert r.passed, (r.status, r.error, r.seconds)


def test_a_busy_loop_is_a_timeout_by_its_cpu_time_and_a_sleeper_by_the_wall_clock_cap():
    busy = run_check(Check("def f():\n    while True:\n        pass\n", "f()", ("f",)), Limits(timeout_s=1.0))
    assert busy.status == "timeout" and busy.seconds < 3.5, (busy.status, busy.error, busy.seconds)
    sleeper = run_check(Check(SLEEPER, "f()", ("f",)), Limits(timeout_s=1.0))
    assert sleeper.status == "timeout" and 2.5 < sleeper.seconds < 4.5, (sleeper.status, sleeper.seconds)


def test_the_samples_file_tells_a_timeout_from_a_failure(monkeypatch, tmp_path):
    """``espert eval``'s samples hold each code check's status beside its reward: ``passed``, ``failed`` (a wrong
    answer) and ``timeout`` (a loop) all score 0 or 1 as before, and the file says which.  Before, it held the
    rewards alone, so a timeout read as a wrong answer."""
    from espert.eval.samples import load_samples, make_records, save_samples
    from espert.tasks import code, load_task

    monkeypatch.setattr(code, "CODE_LIMITS", Limits(timeout_s=1.0, memory_mb=512))
    task = load_task("humaneval", n=1)
    prompt = json.loads(task.answers[0])["prompt"]
    solution = next(r["canonical_solution"] for r in code.humaneval_rows() if r["prompt"] == prompt)
    loop = "    while True:\n        pass\n"
    recs = make_records("m", task, [[solution, "    return True\n", loop]])
    save_samples(str(tmp_path / "s.jsonl"), recs)
    (back,) = load_samples(str(tmp_path / "s.jsonl"))
    assert back["rewards"] == [1.0, 0.0, 0.0] and back["statuses"] == ["passed", "failed", "timeout"], back


# ---- a memory bound for all checks together (finding 7) -----------------------------------------------------

#: Holds ``n`` memfds of 16 MiB each, written through (memfd pages count in no process's address space).
MEMFDS = "import os\nfds = []\nfor i in range({n}):\n    fd = os.memfd_create('m')\n    os.write(fd, b'x' * (16 << 20))\n    fds.append(fd)\n"


def test_a_checks_memfds_count_against_its_memory_bound():
    """A candidate's memory as a whole, memfds included, is bounded by ``memory_mb`` where the machine has a memory
    cgroup (``jail.memory_bound()`` says which bound holds).  Before, RLIMIT_AS bounded each process's address space
    only: 24 memfds of 16 MiB (384 MiB) passed under a 256 MiB limit, and one check held 1.2-1.45 GiB."""
    from espert.jail.sandbox import run_program

    bound = jail.memory_bound()
    limits = Limits(timeout_s=5.0, memory_mb=256, open_files=64)
    small, big = (run_program(MEMFDS.format(n=n), limits) for n in (4, 24))
    assert small.passed, (small.status, small.error)
    if bound.startswith("cgroup"):
        assert not big.passed, (big.status, big.error)
    else:  # no memory cgroup here: the stated bound, per process, is what holds
        assert "open_files × file_bytes" in bound and big.passed


def test_the_candidate_sees_every_call_whatever_its_earlier_answers():
    """The checker runs the whole test before it decides: a failed ``assert`` is recorded and the test goes on, so
    the candidate receives the same calls whether its earlier answers passed or not, and cannot learn which
    assertion passed from the next call arriving.  Before, the check ended at the first failed assertion: a
    candidate answering the first call wrong saw 1 call of 3."""
    counter = "import sys\nn = 0\ndef f(x):\n    global n\n    n += 1\n    print('call', n, file=sys.stderr, flush=True)\n    return -1 if n == 1 else x\n"
    tests = "assert f(1) == 1\nassert f(2) == 2\nassert f(3) == 3\n"
    r = run_check(Check(counter, tests, ("f",)), Limits(timeout_s=5.0))
    assert not r.passed and r.status == "failed" and "line 1" in r.error, (r.status, r.error)
    assert r.output.count("call ") == 3, r.output
