"""Chaos: SIGKILL `espert train` again and again (startup, evaluation, log and checkpoint writes, twice in a
row), resume each time, and end exactly where an uninterrupted run ends: the same center and export bits
and the same log records.

Kills come from a seeded RNG (random moments) and from the named kill points of espert.runs
(``ESPERT_TEST_KILL_AT``); ``log-torn:N`` (half of iteration N's log line written, then SIGKILL) is this
file's own hook around ``Run.append``, installed in the zygote.  To keep the suite short on two cores, most runs are forked from one
"zygote" process that has already imported espert, torch and transformers; the first run and the
final resume are fresh ``python -m espert`` processes.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

from test_runs import FLAGS, assert_same_run, espert, reference  # noqa: F401 - reference is a fixture

from espert import runs

ZYGOTE = r"""
import json, os, signal, sys, time
import espert.cli, espert.runs, espert.trainer, espert.evaluators.torch_model, espert.tasks, tqdm  # noqa: E401
import transformers
from transformers.models.llama import modeling_llama  # noqa: F401


def torn_append(self, rec, append=espert.runs.Run.append):  # the test hook of kill point "log-torn:N"
    if os.environ.get("ESPERT_TEST_KILL_AT") == f"log-torn:{rec.get('iteration')}" and rec.get("kind") == "iter":
        line = espert.runs.log_line(rec)
        self._log.write(line[: len(line) // 2])  # a process killed in the middle of the write
        self._log.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    append(self, rec)


espert.runs.Run.append = torn_append
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the run: espert's command line in a child, its output to a file
        code = 99
        try:
            os.environ.update(req["env"])
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = espert.cli.main(req["argv"])
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = None if req["kill_after"] is None else time.time() + req["kill_after"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if deadline is not None and time.time() >= deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.002)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Zygote:
    def __init__(self):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.p = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.p.stdout.readline().strip() == "ready"

    def run(self, argv, env, log, kill_after=None) -> int:
        self.p.stdin.write(json.dumps({"argv": argv, "env": env, "log": log, "kill_after": kill_after}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())["code"]

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def state(d):
    """What the run directory holds now: (exists, last iteration, eval iterations, checkpoint iterations,
    export iteration, has a task record)."""
    if not os.path.exists(d):
        return False, 0, set(), set(), None, False
    recs = runs.read_log(os.path.join(d, runs.LOG))
    its = [r["iteration"] for r in recs if r["kind"] == "iter"]
    return (
        True,
        its[-1] if its else 0,
        {r["iteration"] for r in recs if r["kind"] == "eval"},
        {r["iteration"] for r in recs if r["kind"] == "checkpoint"},
        runs.export_iteration(os.path.join(d, "export")),
        any(r["kind"] == "task" for r in recs),
    )


# Named kill points in the order a run reaches them, each with "not reached yet" as a test on state().
POINTS = [
    ("setup-base", lambda s: not s[0]),  # while the tiny base model is built
    ("setup-base", lambda s: not s[0]),  # killed again at the same place: a double kill, before any random kill
    ("setup-done", lambda s: not s[0]),  # setup complete, directory not yet renamed into place
    ("logged-task", lambda s: not s[5]),
    ("evaluated:0", lambda s: 0 not in s[2]),  # held-out evaluation done, its record not written
    ("log-torn:1", lambda s: s[1] < 1),  # half of iteration 1's record written
    ("logged-iter:2", lambda s: s[1] < 2),  # record written, update not applied
    ("center-written:2", lambda s: 2 not in s[3]),  # new checkpoint complete, checksum not logged
    ("evaluated:3", lambda s: 3 not in s[2]),
    ("evaluated:3", lambda s: 3 not in s[2]),  # the resume dies at the same place again (when still ahead)
    ("checkpoint-logged:4", lambda s: 4 not in s[3]),  # checksum logged, file not yet in place
    ("export-swap:4", lambda s: s[4] != 4),  # old export moved aside, new one not yet in place
    ("logged-iter:5", lambda s: s[1] < 5),
    ("log-torn:6", lambda s: s[1] < 6),
    ("logged-eval:6", lambda s: 6 not in s[2]),
    ("center-written:6", lambda s: 6 not in s[3]),
]


def test_sigkill_anywhere_then_resume_is_bit_identical(reference, tmp_path):  # noqa: F811
    rng = random.Random(20261201)
    d = str(tmp_path / "run")
    logs = str(tmp_path / "logs")
    os.makedirs(logs)
    kills, double = [], False

    def argv():
        return ["train", "--run-dir", d, *(["--resume", "--no-progress"] if os.path.exists(d) else FLAGS)]

    # a fresh process killed at a random moment of its startup (imports, setup)
    p = subprocess.Popen(
        [sys.executable, "-m", "espert", *argv()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(rng.uniform(0.5, 4.0))
    p.send_signal(signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL
    kills.append("startup (random)")
    assert not os.path.exists(d) or os.path.exists(os.path.join(d, runs.CONFIG))

    zygote = Zygote()
    try:
        for i, (point, ahead) in enumerate(POINTS):
            before = state(d)
            if ahead(before):
                code = zygote.run(argv(), {runs.KILL_ENV: point}, os.path.join(logs, f"{i}.log"))
                assert code == -signal.SIGKILL, (point, code, open(os.path.join(logs, f"{i}.log")).read())
                double |= bool(kills) and kills[-1] == point and state(d)[2] == before[2]
                kills.append(point)
            if i % 3 == 2:  # and a kill at a random moment, mostly while the resume restores
                # on a fast machine the timer may come too late: the next named point stops the run there at
                # the latest, so the points after it stay ahead
                nxt = {runs.KILL_ENV: POINTS[i + 1][0]} if i + 1 < len(POINTS) else {}
                code = zygote.run(argv(), nxt, os.path.join(logs, f"{i}r.log"), kill_after=rng.uniform(0.05, 0.6))
                if code == -signal.SIGKILL:
                    kills.append("random")
                else:
                    assert code == 0, open(os.path.join(logs, f"{i}r.log")).read()
    finally:
        zygote.close()
    assert len(kills) >= 10 and double, kills
    final = espert("train", "--run-dir", d, "--resume", "--no-progress")
    assert final.returncode == 0, final.stderr
    assert_same_run(reference, d)
