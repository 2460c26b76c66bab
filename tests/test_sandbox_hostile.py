"""The hostile suite of the code rewards (issue 38): attacks as HumanEval completions, run through the reward.

Every attack of tests/fixtures/hostile_code.py is scored in one batch by ``humaneval_reward``, in a process
of its own that stands for the trainer (its environment holds a secret, its working directory is a run
directory whose log.jsonl it keeps open).  Each attack must score 0 and leave the machine as it was: no
file under its token (in the test's directory, /tmp, /dev/shm, the run directory), no process with its
token, nothing sent to the test's unix socket or TCP port, the unrelated process alive, the run directory
byte for byte the same.  Killing the trainer runs alone.  Then a real ``espert train`` whose own reward
attacks it: the run completes, resumes and replays bit-identically.

Time on 2 cores shared with other jobs (load ~25): the batch and its settling ~15 s; the training run
(two espert processes, most of it their start) ~2 min; on an idle machine about a third of that.
"""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, FIXTURES)
import hostile_code as H  # noqa: E402

from espert import jail  # noqa: E402
from espert.cli import main as cli_main  # noqa: E402
from espert.tasks.code import humaneval_problem, humaneval_rows  # noqa: E402

# without a jail the code rewards refuse to run: nothing to attack (.ci/run stops when CI has none)
pytestmark = pytest.mark.skipif(not jail.status().available, reason=f"no jail here: {jail.status().reason}")

LIMITS = {"timeout_s": 3.0, "memory_mb": 512}
#: The latest delayed effect: the CPU burner writes 5 s after it started (at the latest when the batch ended).
SETTLE_S = 5.5
SECRET = "espert-hostile-secret-" + uuid.uuid4().hex[:8]
ENV_SECRET = "ESPERT_HOSTILE_SECRET"


class Listener:
    """A unix socket and a TCP port on loopback that record whatever is sent to them."""

    def __init__(self, unix_path: str):
        self.received = b""
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind(unix_path)
        os.chmod(unix_path, 0o777)
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        for s in (self.unix, self.tcp):
            s.listen(16)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s):
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    while chunk := conn.recv(4096):
                        self.received += chunk
                except OSError:
                    pass

    def close(self):
        self.unix.close()
        self.tcp.close()


def tree_digest(path: str) -> dict:
    """Every file under ``path`` -> sha256 of its bytes (and its mode)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            data = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else b""
            out[os.path.relpath(p, path)] = (st.st_mode, hashlib.sha256(data).hexdigest())
    return out


def processes_with(text: str) -> list[int]:
    """Pids whose command line contains ``text``."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if text.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    pids.append(int(pid))
            except OSError:
                pass
    return pids


def files_with(token: str, trees, flat=()) -> list[str]:
    """Files named with ``token`` (or a log.jsonl that holds it) in the trees, and at the top of ``flat``."""
    found = []
    for d in trees:
        for root, _, files in os.walk(d):
            found += [os.path.join(root, f) for f in files if token in f]
            found += [os.path.join(root, f) for f in files if f == "log.jsonl" and token in _read(root, f)]
    for d in flat:
        found += [os.path.join(d, f) for f in os.listdir(d) if token in f]
    return found


def _read(root, name):
    try:
        return open(os.path.join(root, name), errors="replace").read()
    except OSError:
        return ""


def score_in_a_trainer(completions, answers, run_dir, timeout=300):
    """``humaneval_reward`` in a process of its own (its environment holds the secret): its scores, or None
    when that process died; and the process's return code."""
    env = {**os.environ, ENV_SECRET: SECRET, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    req = {"limits": LIMITS, "run": run_dir, "completions": completions, "answers": answers}
    p = subprocess.run(
        [sys.executable, os.path.join(FIXTURES, "hostile_code.py")],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        start_new_session=True,
    )
    lines = p.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if p.returncode == 0 and lines else None), p.returncode, p.stderr[-2000:]


def make_run_dir(path) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        f.write('{"kind": "start"}\n')
    open(os.path.join(path, "espert-run-marker"), "w").write("a run directory\n")
    open(os.path.join(path, "center.safetensors"), "wb").write(os.urandom(4096))
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Run every attack (and the honest answers) in one batch; per attack its score and what it left behind."""
    out = str(tmp_path_factory.mktemp("hostile"))
    run = make_run_dir(os.path.join(out, "run"))
    private = os.path.join(out, "private")
    open(private, "w").write(SECRET)
    os.chmod(private, 0o600)
    victim = subprocess.Popen(["sleep", "120"], start_new_session=True)
    listener = Listener(os.path.join(out, "sock"))
    rows = humaneval_rows()
    batch = uuid.uuid4().hex[:10]
    names = sorted(H.ATTACKS) + sorted(H.HONEST)
    tokens = {name: f"espert-hostile-{batch}-{i:03d}" for i, name in enumerate(names)}  # none a prefix of another
    values = {"OUT": out, "RUN": run, "SECRET": SECRET, "PRIVATE": private, "VICTIM": victim.pid}
    values.update(UNIX=os.path.join(out, "sock"), PORT=listener.port)
    catalog = {**H.ATTACKS, **H.HONEST}
    completions = [H.fill(catalog[n][1], {**values, "TOKEN": tokens[n]}) for n in names]
    answers = [humaneval_problem(rows[catalog[n][0]])[1] for n in names]
    before = tree_digest(run)
    t0 = time.monotonic()
    scores, code, err = score_in_a_trainer(completions, answers, run)
    took, t1 = time.monotonic() - t0, time.monotonic()
    kill_token = f"espert-hostile-{batch}-kill"
    kill_scores, kill_code, kill_err = score_in_a_trainer(
        [H.fill(H.KILL_PARENT, {**values, "TOKEN": kill_token})], [answers[0]], run
    )
    time.sleep(max(0.0, SETTLE_S - (time.monotonic() - t1)))
    result = {"scores": scores, "code": code, "err": err, "took": took, "kill": (kill_scores, kill_code, kill_err)}
    shared = ["/dev/shm", "/tmp"] if os.path.isdir("/dev/shm") else ["/tmp"]
    effects = {}
    for i, name in enumerate(names):
        tok = tokens[name]
        found = []
        found += [f"file {p}" for p in files_with(tok, [out], shared)]
        found += [f"process {pid}" for pid in processes_with(tok)]
        if tok.encode() in listener.received:
            found.append("data sent to the test's socket")
        if "@VICTIM@" in catalog[name][1] and victim.poll() is not None:
            found.append("the unrelated process was killed")
        effects[name] = found
    result["effects"] = effects
    result["score"] = dict(zip(names, scores)) if scores else {}
    result["victim_alive"] = victim.poll() is None
    result["run_unchanged"] = tree_digest(run) == before
    print(f"batch of {len(names)}: {took:.1f} s; unrelated process alive: {result['victim_alive']}")
    for name in names:  # what got through (pytest -s shows it)
        print(f"{name:55s} score {result['score'].get(name)}  {'; '.join(effects[name]) or '-'}")
    yield result
    # clean up whatever got through
    for tok in list(tokens.values()) + [kill_token]:
        for pid in processes_with(tok):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in files_with(tok, [], shared):
            try:
                os.remove(p)
            except OSError:
                pass
    victim.kill()
    victim.wait()
    listener.close()


def test_the_batch_ran(world):
    assert world["scores"] is not None, (world["code"], world["err"])


@pytest.mark.parametrize("name", sorted(H.ATTACKS))
def test_attack_scores_zero_and_leaves_nothing(world, name):
    assert world["score"].get(name) == 0.0, f"{name}: scored {world['score'].get(name)}"
    assert world["effects"][name] == [], f"{name}: {world['effects'][name]}"


@pytest.mark.parametrize("name", sorted(H.HONEST))
def test_honest_answers_in_the_same_batch_score_one(world, name):
    assert world["score"].get(name) == 1.0


def test_the_unrelated_process_survives(world):
    assert world["victim_alive"]


def test_the_run_directory_is_unchanged(world):
    assert world["run_unchanged"]


def test_killing_the_process_that_scores_fails(world):
    scores, code, err = world["kill"]
    assert code == 0 and scores == [0.0], (code, err)


LETTERS = [a + b + c + ">" for a in "abcdef" for b in "abcdef" for c in "abcdef"]


def test_a_real_training_run_survives_attacks_from_its_own_reward(tmp_path, capsys):
    """``espert train`` whose reward attacks it at every call (tests/fixtures/hostile_code.py:reward): its log,
    config and process are the targets.  The run completes, every attack scores 0, no file of the run holds a
    token, and the run resumes and replays bit-identically."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": p[0]}) + "\n" for p in LETTERS[:120]))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in LETTERS[150:156]))
    report = tmp_path / "report.jsonl"
    token = "espert-hostile-train-" + uuid.uuid4().hex[:10]
    env = {
        **os.environ,
        ENV_SECRET: SECRET,
        "HOSTILE_SECRET": SECRET,
        "HOSTILE_TOKEN": token,
        "HOSTILE_REPORT": str(report),
        "PYTHONPATH": FIXTURES + os.pathsep + ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    d = str(tmp_path / "run")
    small = ["--iterations", "2", "--population", "2", "--prompts-per-iteration", "4", "--eval-size", "6"]
    small += ["--max-new-tokens", "2", "--pretrain-steps", "0", "--eval-every", "1", "--checkpoint-every", "1"]

    def espert(*args):
        return subprocess.run(
            [sys.executable, "-m", "espert", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(tmp_path),
            timeout=900,
        )

    p = espert("train", "--run-dir", d, "--task", "hostile_code:reward", "--train-data", str(data),
               "--eval-data", str(held), "--no-progress", *small)  # fmt: skip
    time.sleep(1.5)  # the daemon's delay
    assert p.returncode == 0, p.stderr[-3000:]
    calls = [json.loads(line) for line in report.read_text().splitlines()]
    assert {n for c in calls for n in c} == set(H.TRAINER_ATTACKS), calls  # each ran at least once
    assert all(set(c.values()) == {0.0} for c in calls), calls
    assert not [f for f in files_with(token, [d, str(tmp_path)])], "a file of the run holds an attack's token"
    assert not processes_with(token)
    p = espert("train", "--run-dir", d, "--resume", "--iterations", "3", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    capsys.readouterr()
    assert cli_main(["replay", d, "--out", str(tmp_path / "replay")]) == 0  # no reward: in this process
    err = capsys.readouterr().err
    assert "bit-identical" in err and ": yes" in err, err[-3000:]
    time.sleep(1.5)
    assert not [f for f in files_with(token, [d])]
