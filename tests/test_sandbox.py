"""The sandbox of the code rewards: the jail's isolation, the checker's verdict, the limits, the refusal.

The attacks of the issue, as HumanEval completions, are in tests/test_sandbox_hostile.py; here the parts
one at a time.  Time: ~40-60 s on 2 shared cores (each check starts two jailed interpreters).
"""

import dataclasses
import glob
import math
import os
import tempfile
import time

import pytest

from espert import jail
from espert.jail import jailed, sandbox
from espert.jail.sandbox import Check, JailUnavailable, Limits, run_check, run_checks, run_program, run_programs

LIMITS = Limits(timeout_s=3.0, memory_mb=256, output_bytes=4096)
SECRET = "espert-test-secret-4f1c"
JAILED = jail.status().available
needs_jail = pytest.mark.skipif(not JAILED, reason=f"no jail here: {jail.status().reason}")

# name -> (program, status, timeout seconds, what the error must say); each must end within its timeout
# plus 1.5 s.  Each is a whole program run as the
# candidate: it "passes" when its code ran without raising.  DENIED: the Python-level guard's message (the
# second layer: it speaks first); under it the jail would refuse the same (see test_the_jail_*).
DENIED = "PermissionError: sandbox:"
HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "timeout", 3.0, ""),
    "sleep": ("import time\ntime.sleep(60)\n", "timeout", 3.0, ""),
    "closed descriptors, then a loop": ("import os\nos.closerange(0, 256)\nwhile True:\n    pass\n", "", 3.0, ""),
    "fork bomb": ("import os\nfor _ in range(3):\n    os.fork()\n", "failed", 3.0, DENIED),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])\n", "failed", 3.0, DENIED),
    "multiprocessing": (
        "import multiprocessing as m\np = m.Process(target=print)\np.start()\np.join()\nassert p.exitcode == 0\n",
        "failed",
        3.0,
        "PermissionError",
    ),
    "os.system": ("import os\nassert os.system('true') == 0\n", "failed", 3.0, DENIED),
    "ctypes": ("import ctypes\n", "failed", 3.0, "import of ctypes halted"),
    "memory hog": ("a = []\nwhile True:\n    a.append(bytearray(1 << 24))\n", "failed", 8.0, "MemoryError"),
    "sys.exit(0)": ("import sys\nsys.exit(0)\n", "failed", 3.0, "SystemExit"),
    "os._exit(0)": ("import os\nos._exit(0)\n", "failed", 3.0, "the candidate's process ended"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt\n", "failed", 3.0, "KeyboardInterrupt"),
    "patched exit": ("import os\nos._exit = lambda c: None\nraise ValueError('no')\n", "failed", 3.0, "ValueError"),
    "huge print": ("print('x' * 10**7)\n", "output_limit", 8.0, ""),
    "print loop": ("while True:\n    print('y' * 100)\n", "output_limit", 8.0, ""),
    "socket": ("import socket\nsocket.socket().close()\n", "failed", 3.0, DENIED),
    "raw socket": ("import _socket\n_socket.socket().close()\n", "failed", 3.0, DENIED),
    "name lookup": ("import socket\nsocket.getaddrinfo('localhost', 80)\n", "failed", 3.0, DENIED),
    "environment secret": (f"import os\nassert {SECRET!r} in repr(dict(os.environ))\n", "failed", 3.0, "Assertion"),
    "parent's environ": (
        "import os\nassert b'PATH=' in open('/proc/%d/environ' % os.getppid(), 'rb').read()\n",
        "failed",
        3.0,
        DENIED,
    ),
    "setrlimit": ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n", "failed", 3.0, DENIED),
}


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("ESPERT_FAKE_TOKEN", SECRET)


def test_a_check_passes_when_its_tests_pass():
    cand = "def double(x):\n    print('doubling', x)\n    return x * 2\n"
    ok = run_check(Check(cand, "assert double(3) == 6\nassert double('ab') == 'abab'\n", ("double",)), LIMITS)
    assert ok.passed and ok.status == "passed" and ok.error == "" and ok.output == "doubling 3\ndoubling ab\n"
    bad = run_check(Check(cand, "assert double(3) == 6\nassert double(2) == 5\n", ("double",)), LIMITS)
    assert not bad.passed and bad.status == "failed"
    assert bad.error == "AssertionError (tests.py line 2: assert double(2) == 5)"
    syntax = run_check(Check("def f(:\n", "assert f()\n", ("f",)), LIMITS)
    assert not syntax.passed and syntax.error.startswith("SyntaxError")
    missing = run_check(Check("x = 1\n", "assert double(1) == 2\n", ("double",)), LIMITS)
    assert "NameError: name 'double' is not defined" in missing.error
    with pytest.raises(ValueError, match="the tests of a code check do not compile"):
        run_check(Check(cand, "assert (\n", ("double",)), LIMITS)
    assert run_program("import socket, ssl, asyncio, urllib.request, json, math\n", LIMITS).passed


def test_trusted_code_is_the_checkers_own():
    """A helper of the trusted code (HumanEval's ``poly``) is the checker's: the candidate's redefinition
    changes its own copy only."""
    trusted = "def poly(x):\n    return x * x - 4\n\n\ndef root():\n    '''stub'''\n"
    cand = trusted + "def poly(x):\n    return 0\n\n\ndef root():\n    return 7\n"
    c = Check(cand, "assert poly(root()) == 0\n", ("root",), trusted=trusted)
    r = run_check(c, LIMITS)
    assert not r.passed and "assert poly(root()) == 0" in r.error
    good = Check(trusted + "def root():\n    return 2\n", c.tests, ("root",), trusted=trusted)
    assert run_check(good, LIMITS).passed


def test_values_travel_as_data():
    """Built-in values round-trip exactly; the candidate's own objects stay references that equal only
    themselves; in-place changes to list/dict/set arguments come back; its exceptions are re-raised as the
    built-in of the same name."""
    cand = (
        "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
        "    def total(self):\n        return self.a + self.b\n"
        "class Eq:\n    def __eq__(self, other):\n        return True\n"
        "def same(x):\n    return x\n"
        "def eq():\n    return Eq()\n"
        "def fill(xs, d):\n    xs.append(len(xs))\n    d['n'] = len(d)\n"
        "def bad(x):\n    raise ValueError('no ' + str(x))\n"
        "LIMIT = 7\n"
    )
    values = [
        None, True, 0, -(10**30), 1.5, float("inf"), -0.0, "é\n", [1, [2, (3, 4)]], (1, "a"), {1: "a", (2, 3): [4]},
        {1, 2}, frozenset({3}), b"\x00\xff", bytearray(b"ab"), 1 + 2j, {"k": {"s": {1.0}}},
    ]  # fmt: skip
    tests = (
        f"vals = {values!r}\n"
        "for v in vals:\n    r = same(v)\n    assert r == v and type(r) is type(v), (r, v)\n"
        "assert math.isnan(same(float('nan')))\n"
        "assert eq() != 1 and eq() != eq() and eq() is not None\n"
        "p = Pair(2, 3)\nassert p.a == 2 and p.total() == 5 and same(p) == p and same(p) != Pair(2, 3)\n"
        "xs, d = [5], {}\nfill(xs, d)\nassert xs == [5, 1] and d == {'n': 0}\n"
        "try:\n    bad(4)\n    raise AssertionError('no raise')\nexcept ValueError as e:\n    assert str(e) == 'no 4'\n"
        "assert LIMIT == 7\n"
    )
    r = run_check(
        Check(cand, tests, ("Pair", "same", "eq", "fill", "bad", "LIMIT"), trusted="import math\ninf = math.inf\n"),
        LIMITS,
    )
    assert r.passed, (r.error, r.output)


def test_the_codec_builds_only_builtins():
    class Sneaky(float):
        def __eq__(self, other):
            return True

    refs = {}
    data = jailed.encode([Sneaky(2.0), {"a": (1, b"x")}, object()], refs)
    back = jailed.decode(data, lambda ref: ("ref", ref["r"]))
    assert type(back[0]) is float and back[0] == 2.0 and back[1] == {"a": (1, b"x")} and back[2][0] == "ref"
    for bad in ({"zz": 1}, {"t": [1], "u": 2, "v": 3}, {"d": [[[1], 2]]}):
        with pytest.raises(TypeError):
            jailed.decode(bad, lambda ref: None)
    with pytest.raises(TypeError, match="cannot be sent"):
        jailed.encode(lambda: 0)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_fail_within_their_limit(name, secret_env):
    program, status, timeout, says = HOSTILE[name]
    t0 = time.monotonic()
    r = run_program(program, dataclasses.replace(LIMITS, timeout_s=timeout))
    # The budget is CPU time, so a loop's wall time grows with the machine's load (CI saw 5.6 s for a 3 s loop);
    # what bounds every program is the wall-clock cap, 2·timeout + 1, plus the jail's start and teardown.
    took, most = time.monotonic() - t0, 2 * timeout + 1 + 1.5
    assert not r.passed and r.status == (status or r.status), (r.status, r.error, r.output[-300:])
    assert says in r.error, (r.error, r.output[-300:])
    assert took < most, f"{name}: {took:.2f}s"


def test_the_child_sees_none_of_the_parents_environment(secret_env):
    r = run_program(f"import os\nprint(sorted(os.environ))\nassert {SECRET!r} not in repr(dict(os.environ))\n", LIMITS)
    assert r.passed, r.error
    assert "ESPERT_FAKE_TOKEN" not in r.output and SECRET not in r.output
    assert "HOME" in r.output and "PYTHONHASHSEED" in r.output


#: Run in the jail under the Python-level guards' reach: what the kernel says, seen from inside.
INSIDE = r"""
import _io, os, errno
status = dict(line.split(":\t", 1) for line in _io.open("/proc/self/status").read().splitlines() if ":\t" in line)
print("uid:", os.getuid(), os.getgid(), os.getgroups(), status["CapEff"].strip(), status["NoNewPrivs"].strip())
print("pids:", sorted(p for p in os.listdir("/proc") if p.isdigit()))
print("root:", sorted(os.listdir("/")))
print("dev:", sorted(os.listdir("/dev")))
print("net:", [ln.split(":")[0].strip() for ln in _io.open("/proc/self/net/dev").read().splitlines()[2:]])
print("host:", os.uname().nodename)
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
print("write /usr:", attempt(lambda: _io.open("/usr/espert-jail-test", "w")))
print("write /:", attempt(lambda: _io.open("/espert-jail-test", "w")))
print("write /tmp:", attempt(lambda: _io.open("/tmp/small", "w").write("x")))
def fill():
    with _io.open("/tmp/big", "wb") as f:
        for _ in range(64):
            f.write(bytes(1 << 20))
print("fill /tmp:", attempt(fill))
print("cwd:", os.getcwd())
"""


@needs_jail
def test_the_jail_from_inside():
    """uid 65534 with no capability and no_new_privs; only its own processes; only the bound directories; no
    /dev/shm; a loopback only; its own hostname; a read-only root; /tmp writable up to tmp_bytes."""
    r = run_program(INSIDE, Limits(timeout_s=5.0, tmp_bytes=8 << 20, file_bytes=32 << 20))
    assert r.passed, (r.error, r.output)
    said = dict(line.split(": ", 1) for line in r.output.strip().splitlines())
    assert said["uid"] == "65534 65534 [] 0000000000000000 1"
    assert said["pids"] in ("['1', '2']", "['1', '2', '3']")  # bwrap's init and this process
    allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "tmp"}
    assert set(eval(said["root"])) <= allowed | {d.split("/")[1] for d in jail._python_dirs()}
    assert "shm" not in said["dev"] and eval(said["dev"]) == sorted(jail.DEVICES)
    assert said["net"] == "['lo']" and said["host"] == "jail"
    assert said["write /usr"] in ("EROFS", "EACCES") and said["write /"] in ("EROFS", "EACCES")
    assert said["write /tmp"] == "ok" and said["fill /tmp"] == "ENOSPC" and said["cwd"] == "/tmp"


@needs_jail
def test_the_whole_pid_namespace_dies_with_the_check():
    """Allowed to start processes, a candidate leaves a setsid daemon and a busy child behind; once the check
    returns (at its end, and at its deadline) no process of its PID namespace is left on the host."""
    program = (  # a fresh posix module: past the Python-level guard, so the kernel's limits are what is tested
        "import importlib.util as u, os, time\ns = u.find_spec('posix')\npx = u.module_from_spec(s)\n"
        "s.loader.exec_module(px)\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n"
        "for _ in range(2):\n    if px.fork() == 0:\n        px.setsid()\n        time.sleep(60)\n"
        "LOOP\n"
    )
    limits = Limits(timeout_s=3.0, procs=8)
    for loop, status in (("", "passed"), ("while True:\n    pass", "timeout")):
        r = run_check(Check(program.replace("LOOP", loop), ""), limits)
        assert r.status == status, (r.status, r.error, r.output)
        ns = r.output.split()[0]
        assert ns.startswith("pid:[")
        left = [p for p in os.listdir("/proc") if p.isdigit() and _pidns(p) == ns and _state(p) != "Z"]
        assert left == [], f"{status}: processes of the jail left: {left}"


def _pidns(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _state(pid: str) -> str:
    """A process's state letter ("Z": ended, waiting to be reaped: a jail whose program ended by itself leaves
    its init so, for the host's init to reap, when bwrap's launcher ended first)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_no_jail_no_code_unless_allowed(monkeypatch, capsys):
    """Without a jail, code is refused in one line; allowed (--unsafe-code-reward), it runs unjailed, with
    one warning line, and the verdict is still the checker's."""
    monkeypatch.setattr(jail, "_STATUS", jail.JailStatus(False, reason="bwrap not found: install bubblewrap"))
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "_UNSAFE", False)
    monkeypatch.setattr(sandbox, "_WARNED", False)
    with pytest.raises(JailUnavailable) as e:
        run_checks([Check("x = 1\n", "")], LIMITS)
    assert "\n" not in str(e.value) and "no jail can be made here (bwrap not found" in str(e.value)
    assert "--unsafe-code-reward" in str(e.value)
    sandbox.allow_unsafe_code()
    eq = "class E:\n    def __eq__(self, o):\n        return True\ndef f():\n    return E()\n"
    res = run_checks(
        [Check(eq, "assert f() == 1\n", ("f",)), Check("def f():\n    return 1\n", "assert f() == 1\n", ("f",))], LIMITS
    )
    assert [r.passed for r in res] == [False, True]
    err = capsys.readouterr().err
    assert err.count("code rewards run WITHOUT a jail") == 1
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "espert-sandbox-*")))
    run_program("open('a.txt', 'w').write('hi')\n", LIMITS)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "espert-sandbox-*"))) == before


def test_batches_keep_order_are_deterministic_and_bounded():
    progs = [
        "assert True\n",
        "assert False\n",
        "import sys\nsys.exit(0)\n",
        "print(hash('espert'), list({'b', 'a', 'c', 'd'}))\n",  # the same with PYTHONHASHSEED=0
    ] * 2
    first = run_programs(progs, LIMITS, workers=2)
    again = run_programs(progs, LIMITS, workers=2)
    assert [r.passed for r in first] == [True, False, False, True] * 2
    assert [(r.passed, r.output) for r in first] == [(r.passed, r.output) for r in again]
    # three infinite loops, two at a time, within a 2 s total: the batch ends at about 2.5 s (the grace)
    t0 = time.monotonic()
    res = run_programs(["while True: pass\n"] * 3 + ["assert True\n"], LIMITS, workers=2, total_timeout_s=2.0)
    took = time.monotonic() - t0
    assert took < 4.5 and not any(r.passed for r in res)
    assert {r.status for r in res} <= {"timeout", "skipped"} and res[-1].status == "skipped"


def test_cpu_limit_and_file_limit():
    r = run_program("open('big', 'wb').write(b'x' * (1 << 20))\n", Limits(timeout_s=3.0, file_bytes=1 << 16))
    assert not r.passed
    t0 = time.monotonic()
    r = run_program("while True:\n    pass\n", Limits(timeout_s=30.0, cpu_s=1))
    assert not r.passed and time.monotonic() - t0 < 25  # RLIMIT_CPU, long before the wall clock
    assert math.isfinite(r.seconds)


def test_train_refuses_code_rewards_without_a_jail_before_writing(tmp_path, capsys, monkeypatch):
    """``espert train --task humaneval`` where no jail can be made: one line, exit 2, nothing written; with
    ``--unsafe-code-reward`` it runs, saying so once, and the run records the choice."""
    from espert.cli import main
    from espert.runs import read_run_config

    monkeypatch.setattr(jail, "_STATUS", jail.JailStatus(False, reason="bwrap not found: install bubblewrap"))
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "_UNSAFE", False)
    monkeypatch.setattr(sandbox, "_WARNED", False)
    d = str(tmp_path / "run")
    small = ["--run-dir", d, "--task", "humaneval", "--no-progress", "--no-report", "--pretrain-steps", "0"]
    assert main(["train", *small]) == 2
    said = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("[espert] run directory")]
    assert len(said) == 1 and said[0].startswith(
        "espert train: error: code rewards run untrusted code, and no jail can be made here (bwrap not found"
    ), said
    assert not os.path.exists(d)
    assert main(["train", *small, "--unsafe-code-reward", "--iterations", "0", "--eval-size", "0"]) == 0
    assert capsys.readouterr().err.count("code rewards run WITHOUT a jail (--unsafe-code-reward): bwrap not found") == 1
    assert read_run_config(d)["config"]["unsafe_code_reward"] is True


def test_espert_env_says_whether_code_can_be_jailed(monkeypatch):
    from espert import environment

    text = environment.format_environment(environment.describe(with_gpus=False))
    st = jail.status()
    assert (f"jail:    {st.tool} (" if st.available else f"jail:    unavailable: {st.reason}") in text
    monkeypatch.setattr(jail, "_STATUS", jail.JailStatus(False, reason="bwrap not found: install bubblewrap"))
    text = environment.format_environment(environment.describe(with_gpus=False))
    assert "jail:    unavailable: bwrap not found: install bubblewrap; code rewards need --unsafe-code-reward" in text
