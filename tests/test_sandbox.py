"""The sandbox of the code rewards: hostile programs score 0 within their limits and leave nothing behind."""

import glob
import os
import tempfile
import time

import pytest

from espert.tasks.sandbox import Limits, network_namespace, run_program, run_programs

LIMITS = Limits(timeout_s=2.0, memory_mb=256, output_bytes=4096)
SECRET = "espert-test-secret-4f1c"

# name -> (program, status, most seconds, what the output must say).  Without its guard each program
# would pass, or fail otherwise than the output says (setrlimit where the kernel refuses a raise), so
# these tests can fail; the fork bomb is bounded (at most 8 processes even with every guard gone).
# DENIED: the guard's PermissionError, not some other failure.
DENIED = "PermissionError: sandbox:"
HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", "timeout", 3.0, ""),
    "sleep": ("import time\ntime.sleep(60)\n", "timeout", 3.0, ""),
    "closed output, then a loop": ("import os\nos.closerange(0, 256)\nwhile True:\n    pass\n", "timeout", 3.0, ""),
    "fork bomb": ("import os\nfor _ in range(3):\n    os.fork()\n", "failed", 1.5, DENIED),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])\n", "failed", 1.5, DENIED),
    "multiprocessing": (
        "import multiprocessing as m\np = m.Process(target=print)\np.start()\np.join()\nassert p.exitcode == 0\n",
        "failed",
        1.5,
        DENIED,
    ),
    "os.system": ("import os\nassert os.system('true') == 0\n", "failed", 1.5, DENIED),
    "ctypes": ("import ctypes\n", "failed", 1.5, "ModuleNotFoundError: import of ctypes halted"),
    "memory hog": ("a = []\nwhile True:\n    a.append(bytearray(1 << 24))\n", "failed", 2.5, "MemoryError"),
    "sys.exit(0)": ("import sys\nsys.exit(0)\n", "failed", 1.5, "SystemExit: 0"),
    "os._exit(0)": ("import os\nos._exit(0)\n", "failed", 1.5, ""),
    "KeyboardInterrupt": ("raise KeyboardInterrupt\n", "failed", 1.5, "KeyboardInterrupt"),
    "patched exit": ("import os\nos._exit = lambda c: None\nraise ValueError\n", "failed", 1.5, "ValueError"),
    "huge print": ("print('x' * 10**8)\n", "output_limit", 2.0, "xxxx"),
    "print loop": ("while True:\n    print('y' * 100)\n", "output_limit", 2.0, "yyyy"),
    "socket": ("import socket\nsocket.socket().close()\n", "failed", 1.5, DENIED),
    "raw socket": ("import _socket\n_socket.socket().close()\n", "failed", 1.5, DENIED),
    "name lookup": ("import socket\nsocket.getaddrinfo('localhost', 80)\n", "failed", 1.5, DENIED),
    "environment secret": (
        f"import os\nassert {SECRET!r} in repr(dict(os.environ))\n",
        "failed",
        1.5,
        "AssertionError",
    ),
    "parent's environ": (
        # /proc/PID/environ shows the environment a process started with (not monkeypatch's): PATH
        "import os\nassert b'PATH=' in open('/proc/%d/environ' % os.getppid(), 'rb').read()\n",
        "failed",
        1.5,
        DENIED,
    ),
    "setrlimit": ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n", "failed", 1.5, DENIED),
}


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("ESPERT_FAKE_TOKEN", SECRET)


def test_a_passing_program_passes_and_a_failing_one_fails():
    ok = run_program("import math\nassert math.gcd(12, 18) == 6\nprint('out')\n", LIMITS)
    assert ok.passed and ok.status == "passed" and ok.returncode == 0 and ok.output == "out\n"
    bad = run_program("assert 1 + 1 == 3\n", LIMITS)
    assert not bad.passed and bad.status == "failed" and "AssertionError" in bad.output
    syntax = run_program("def f(:\n", LIMITS)
    assert not syntax.passed and "SyntaxError" in syntax.output
    # the network guard leaves the standard library importable
    assert run_program("import socket, ssl, asyncio, urllib.request\n", LIMITS).passed


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_score_zero_within_their_limit(name, secret_env, tmp_path):
    program, status, most, says = HOSTILE[name]
    t0 = time.monotonic()
    r = run_program(program, LIMITS)
    took = time.monotonic() - t0
    assert not r.passed and r.status == status, (r.status, r.output[-500:])
    assert says in r.output, r.output[-500:]
    assert took < most, f"{name}: {took:.2f}s"


def test_the_child_sees_none_of_the_parents_environment(secret_env):
    r = run_program(f"import os\nprint(sorted(os.environ))\nassert {SECRET!r} not in repr(dict(os.environ))\n", LIMITS)
    assert r.passed, r.output
    assert "ESPERT_FAKE_TOKEN" not in r.output and SECRET not in r.output
    assert "HOME" in r.output and "PYTHONHASHSEED" in r.output


def test_writes_stay_in_the_working_directory(tmp_path):
    outside = tmp_path / "outside.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for program in (
        f"open({str(outside)!r}, 'w').write('x')\n",
        f"import os\nos.close(os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT))\n",
        f"import pathlib\npathlib.Path({str(outside)!r}).write_text('x')\n",
        f"import os\nos.remove({str(victim)!r})\n",
        f"import os\nos.rename({str(victim)!r}, 'stolen')\n",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n",
        "import os\nos.chdir('/')\nopen('espert_sandbox_escape', 'w')\n",
    ):
        r = run_program(program, LIMITS)
        assert not r.passed and "PermissionError" in r.output, (program, r.output[-300:])
    assert not outside.exists() and victim.read_text() == "keep"
    assert not os.path.exists("/espert_sandbox_escape")
    # inside the working directory, files work (and the directory is gone afterwards)
    r = run_program(
        "open('a.txt', 'w').write('hi')\nassert open('a.txt').read() == 'hi'\nimport os\nprint(os.getcwd())\n"
    )
    assert r.passed, r.output
    assert not os.path.exists(r.output.strip())


def test_file_size_limit():
    r = run_program("open('big', 'wb').write(b'x' * (1 << 20))\n", Limits(timeout_s=2.0, file_bytes=1 << 16))
    assert not r.passed


@pytest.mark.skipif(not network_namespace(), reason="this host does not allow unshare --net")
def test_network_namespace_has_no_interface_up():
    """Below the Python guard: the child's own network namespace has only a loopback, and it is down."""
    r = run_program(
        "import fcntl\n"
        "lines = open('/proc/self/net/dev').read().splitlines()[2:]\n"
        "names = [ln.split(':')[0].strip() for ln in lines]\n"
        "assert names == ['lo'], names\n"
        "flags = open('/sys/class/net/lo/flags').read().strip()\n"
        "print(names, flags)\n",
        LIMITS,
    )
    assert r.passed, r.output


def test_batches_keep_order_are_deterministic_and_bounded():
    progs = [
        "assert True\n",
        "assert False\n",
        "import sys\nsys.exit(0)\n",
        "print(hash('espert'), list({'b', 'a', 'c', 'd'}))\n",  # the same with PYTHONHASHSEED=0
    ] * 3
    first = run_programs(progs, LIMITS, workers=2)
    again = run_programs(progs, LIMITS, workers=2)
    assert [r.passed for r in first] == [True, False, False, True] * 3
    assert [(r.passed, r.output) for r in first] == [(r.passed, r.output) for r in again]
    # four infinite loops, two at a time, within a 1.5 s total: the batch ends at about 1.5 s
    t0 = time.monotonic()
    res = run_programs(["while True: pass\n"] * 4 + ["assert True\n"], LIMITS, workers=2, total_timeout_s=1.5)
    took = time.monotonic() - t0
    assert took < 2.5 and not any(r.passed for r in res)
    assert {r.status for r in res} <= {"timeout", "skipped"} and res[-1].status == "skipped"


def test_nothing_is_left_behind():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "espert-sandbox-*")))
    run_programs(["while True: pass\n", "print('x' * 10**7)\n", "assert True\n"], Limits(timeout_s=0.5), workers=3)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "espert-sandbox-*"))) == before
