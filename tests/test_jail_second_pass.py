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

The non-root cases run espert's scorer as uid 65534 (``setpriv``) in a private mount namespace where the
interpreter's prefix is reachable (it lives under /root, mode 0700, here): a test device, as a user's own
account would be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

from espert.tasks import jail
from espert.tasks.sandbox import Check, Limits, run_check

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


#: the scorer as uid 65534, in a private mount namespace where the interpreter's prefix is reachable
NONROOT = textwrap.dedent("""
    set -e
    keep=$(mktemp -d)
    mount --bind "$PREFIX_TOP" "$keep"
    mount -t tmpfs -o mode=0755 tmpfs "$HIDE"
    mkdir -p "$PREFIX_TOP"
    mount --bind "$keep" "$PREFIX_TOP"
    exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all \\
        env HOME=/tmp HF_TOKEN="$SECRET" PYTHONPATH="$REPO" "$PY" -c "$SCRIPT" "$TESTS"
""")
NONROOT_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import test_jail_second_pass as T
    from espert.tasks import jail
    st = jail.status()
    out = {"uid": __import__("os").getuid(), "jail": st.available, "reason": st.reason}
    if st.available:
        out["environ"] = T._probe(T.ENVIRON)
        out["foreign"] = T._probe(T.FOREIGN)
    print("RESULT" + json.dumps(out))
""")


def _hidden_parent(path: str) -> str | None:
    """The topmost directory above ``path`` that 65534 cannot pass through (None: none)."""
    parts = os.path.realpath(path).strip("/").split("/")
    for i in range(1, len(parts)):
        d = "/" + "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("unshare"), reason="root only")
def test_as_a_non_root_user_the_jail_holds_no_secret_and_no_ffi(tmp_path):
    exe = os.path.realpath(sys.executable)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hide = _hidden_parent(exe)
    if _hidden_parent(repo) is not None:
        pytest.skip(f"the checkout {repo} is not readable by other users here")
    top = os.path.dirname(os.path.dirname(exe))  # the interpreter's prefix
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PREFIX_TOP": top,
        "HIDE": hide or "/nonexistent",
        "SECRET": SECRET,
        "REPO": repo,
        "PY": sys.executable,
        "SCRIPT": NONROOT_SCRIPT,
        "TESTS": os.path.dirname(os.path.abspath(__file__)),
    }
    script = NONROOT if hide else NONROOT.replace('mount -t tmpfs -o mode=0755 tmpfs "$HIDE"\n', "")
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", script, "_"],
        input="",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(line[len("RESULT") :])
    assert out["uid"] == 65534 and out["jail"], out
    assert SECRET not in out["environ"] and "HF_TOKEN" not in out["environ"], out["environ"]
    assert out["foreign"].startswith("refused"), out["foreign"]


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
