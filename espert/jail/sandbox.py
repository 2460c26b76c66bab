"""Run untrusted code for the code rewards: the candidate in a jail, the verdict where it cannot reach.

A :class:`Check` is untrusted ``candidate`` code (a completion with the prompt around it), trusted ``tests`` and the
names the tests call.  :func:`run_check` starts two processes, each in a jail of its own (:mod:`espert.jail`:
bubblewrap, new namespaces, uid 65534, a read-only view, a private tmpfs):

* the *callee* runs the candidate and then only answers calls;
* the *checker* runs the trusted code and the tests, where each called name is a stand-in that sends the call's
  arguments to the callee as data (JSON, :mod:`espert.jail.jailed`) and turns its answer back into plain built-in
  objects, with the check's remaining time as the limit of every call.

The checker decides, and tells this process on a pipe the candidate does not hold.  So nothing the candidate can read
or write takes part in the decision: its frames hold no token, its patched builtins and its always-equal objects stay
in its own process, and its output is only output.  At the end (or at the deadline) both jails are killed whole: each
jail's init, found through bwrap's ``--info-fd`` and held by a pidfd, dies, and with it its PID namespace.  Limits
(:class:`Limits`) are the kernel's: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC`` (uid 65534: the
kernel enforces it), ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0, the tmpfs size; the wall clock and the output are this
process's. The callee also installs the old Python-level guards, as a second layer (docs/eval.md, "Sandbox").

Where no jail can be made (:func:`espert.jail.status` says why), code is refused (:class:`JailUnavailable`) unless the
user allowed it (``--unsafe-code-reward``, :func:`allow_unsafe_code`, or ``ESPERT_UNSAFE_CODE_REWARD=1``): then both
processes run unjailed, in sessions of their own, with the Python-level guards only (and an empty network namespace
where ``unshare --net`` works).
"""

from __future__ import annotations

import binascii
import contextlib
import functools
import json
import marshal
import math
import os
import re
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .. import jail

UNSAFE_ENV = "ESPERT_UNSAFE_CODE_REWARD"  # allows unjailed code, as ``--unsafe-code-reward`` does
MAX_ARG_BYTES = 1 << 17  # the longest argument the kernel passes to a program (MAX_ARG_STRLEN, 32 pages)


class JailUnavailable(ValueError):
    """Code rewards were asked for where no jail can be made, and unjailed code was not allowed."""


@dataclass(frozen=True)
class Limits:
    """Limits of one check.  timeout_s: CPU seconds of each process (``RLIMIT_CPU``; cpu_s, when given, in whole
    seconds instead), so the verdict does not depend on the machine's load; wall_s: the wall-clock cap, for code that
    waits (None: ``2·timeout_s + 1``); memory_mb: address space of each process; output_bytes: stdout+stderr kept (more
    kills the check); file_bytes: largest file; tmp_bytes: the writable tmpfs; procs: processes the candidate may start
    (0: not even a thread; per jail); open_files: descriptors of each process (with file_bytes, it bounds what memfds
    hold); message_bytes: the largest call or answer."""

    timeout_s: float = 10.0
    wall_s: Optional[float] = None
    cpu_s: Optional[int] = None
    memory_mb: int = 1024
    output_bytes: int = 1 << 16
    file_bytes: int = 1 << 24
    tmp_bytes: int = 1 << 24
    procs: int = 0
    open_files: int = 32
    message_bytes: int = 1 << 20


@dataclass(frozen=True)
class Check:
    """One check: untrusted ``candidate`` code (run in the callee); trusted ``tests`` (run in the checker, passing when
    they end without raising) calling ``calls``, stand-ins for the candidate's functions; ``trusted`` code run in the
    checker before the tests (a HumanEval prompt's helpers, MBPP's setup), never the candidate's version of it."""

    candidate: str
    tests: str
    calls: tuple[str, ...] = ()
    trusted: str = ""


@dataclass
class Result:
    """One check's outcome: ``status`` ``passed``, ``failed`` (a test failed; the candidate raised, did not load or
    ended), ``timeout``, ``output_limit`` or ``skipped`` (the batch's time ran out first); ``output``: the candidate's
    stdout+stderr and the tests' prints (at most ``output_bytes``); ``error``: why it failed, in one line."""

    passed: bool
    status: str
    seconds: float = 0.0
    output: str = field(default="", repr=False)
    error: str = ""


_UNSAFE = _WARNED = False


def allow_unsafe_code(allowed: bool = True) -> None:
    """Allow (or stop allowing) this process to run code rewards without a jail (``--unsafe-code-reward``)."""
    global _UNSAFE
    _UNSAFE = bool(allowed)


def code_jail() -> bool:
    """True: code runs jailed.  False: no jail can be made here and unjailed code was allowed (one warning line on
    stderr, once).  Raises :class:`JailUnavailable` (one line: why, and what to do) otherwise."""
    global _WARNED
    st = jail.status()
    if st.available:
        return True
    if not (_UNSAFE or os.environ.get(UNSAFE_ENV) == "1"):
        raise JailUnavailable(
            f"code rewards run untrusted code, and no jail can be made here ({st.reason}); "
            f"pass --unsafe-code-reward (or set {UNSAFE_ENV}=1) to run it with Python-level guards only"
        )
    if not _WARNED:
        _WARNED = True
        print(f"[espert] warning: code rewards run WITHOUT a jail (--unsafe-code-reward): {st.reason}", file=sys.stderr)
    return False


@functools.cache
def network_namespace() -> tuple[str, ...]:
    """Unjailed only: the prefix that gives a process its own empty network namespace, or ``()``.  Probed once."""
    exe = shutil.which("unshare")
    try:
        ok = bool(exe) and subprocess.run([exe, "--net", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "--net") if ok else ()


@functools.cache
def _jailed_code() -> str:
    """jailed.py compiled, marshalled, compressed, base64: not compiled again per process (~6 ms), ~25 KB of 128 KiB."""
    from . import jailed

    with open(jailed.__file__, encoding="utf-8") as f:
        code = compile(f.read(), jailed.__file__, "exec", dont_inherit=True)
    text = binascii.b2a_base64(zlib.compress(marshal.dumps(code), 9), newline=False).decode()
    if len(text) >= MAX_ARG_BYTES:
        raise jail.JailError(f"espert/jail/jailed.py is too large to pass as an argument: {len(text)}")
    return text


def _rlimits(limits: Limits, candidate: bool) -> dict:
    cpu = limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s)
    mem = limits.memory_mb << 20
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [mem, mem],
        "RLIMIT_FSIZE": [limits.file_bytes if candidate else 1 << 20] * 2,
        "RLIMIT_NPROC": [limits.procs if candidate else 0] * 2,
        "RLIMIT_NOFILE": [limits.open_files] * 2,
        "RLIMIT_CORE": [0, 0],
    }


def _init_pidfd(r: int, launcher: int) -> Optional[int]:
    """A pidfd of the jail's init (on ``--info-fd``) if it is the launcher's child: the pidfd pins that process."""
    data, deadline = b"", time.monotonic() + 30
    while b"}" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            return None
        chunk = os.read(r, 4096)
        if not chunk:
            return None
        data += chunk
    m = re.search(rb'"child-pid":\s*(\d+)', data)
    if m is None:
        return None
    try:
        fd = os.pidfd_open(int(m.group(1)))
    except OSError:  # already gone
        return None
    try:
        with open(f"/proc/{int(m.group(1))}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = -1
    if ppid != launcher:
        os.close(fd)
        return None
    return fd


class _Process:
    """One process of a check: jailed, killed by killing its jail's init; unjailed, in a session of its own."""

    def __init__(self, args: list[str], io: tuple, fds: tuple, jailed: bool, tmp_bytes: int, cwd, cgroup=None):
        std = dict(zip(("stdin", "stdout", "stderr"), io))
        self.pidfd, self.jailed = None, jailed
        if not jailed:
            env = {**jail.ENVIRONMENT, "HOME": cwd, "TMPDIR": cwd}
            self.proc = subprocess.Popen(
                [*network_namespace(), *args], pass_fds=fds, cwd=cwd, env=env, start_new_session=True, **std
            )
            return
        r, w = os.pipe()
        try:
            self.proc = jail.launch(args, tmp_bytes, info_fd=w, pass_fds=fds, cgroup=cgroup, **std)
        finally:
            os.close(w)
        try:
            self.pidfd = _init_pidfd(r, self.proc.pid)
        finally:
            os.close(r)

    def kill(self) -> None:
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            elif self.jailed:
                self.proc.kill()
            else:  # the leader is not reaped yet, so its group id cannot be anyone else's
                os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> Optional[int]:
        """Wait for the launcher and, jailed, for the jail's init (hence its whole namespace) to end."""
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if self.pidfd is not None:
            # readable once the init has ended, which it does only after every process of its namespace: when
            # the program ended by itself, bwrap's launcher may have ended first
            select.select([self.pidfd], [], [], 30)
            os.close(self.pidfd)
            self.pidfd = None
        return rc


#: What the jailed interpreter runs (``-c``): the marshalled program that follows it on the command line.
LOADER = "import binascii, marshal, sys, zlib\nexec(marshal.loads(zlib.decompress(binascii.a2b_base64(sys.argv[1]))))"
GRACE_S = 0.5  # how long past a check's end the checker may take to report its own timeout before it is killed


class _Run:
    """The pipes and the two processes of one check, driven to a verdict."""

    def __init__(self, check: Check, limits: Limits, jailed: bool, end: float):
        self.check, self.limits, self.jailed, self.end = check, limits, jailed, end
        self.procs: list[_Process] = []
        self.fds: list[int] = []  # this process's ends of the pipes
        self.pending: dict[int, bytes] = {}  # stdin still to write: the candidate, the checker's spec
        self.output, self.verdict_data = bytearray(), bytearray()
        self.returncodes: list[Optional[int]] = []  # the callee's, then the checker's (bwrap's: 128 + signal)
        self.verdict: Optional[dict] = None  # the checker's verdict, parsed once the jails are gone (finish)
        self.workdir = None if jailed else tempfile.mkdtemp(prefix="espert-sandbox-")
        self.cleanup = contextlib.ExitStack()  # the candidate's memory cgroup, once its jail is gone
        self.cgroup, self.over_memory = None, False

    def _pipe(self, mine: int) -> tuple[int, int]:
        r, w = os.pipe()
        self.fds.append((r, w)[mine])
        return r, w

    def start(self) -> None:
        (c_in, c_src), (k_in, k_src) = self._pipe(1), self._pipe(1)
        (req_r, req_w), (resp_r, resp_w) = os.pipe(), os.pipe()
        (self.out, out_w), (self.verdict, verdict_w) = self._pipe(0), self._pipe(0)
        theirs = (c_in, k_in, req_r, req_w, resp_r, resp_w, out_w, verdict_w)
        lim, program = self.limits, _jailed_code()
        common = {"drop": self.jailed and os.geteuid() == 0, "message_bytes": lim.message_bytes}
        callee = {**common, "in": req_r, "out": resp_w, "rlimits": _rlimits(lim, True)}
        checker = {**common, "in": resp_r, "out": req_w, "rlimits": _rlimits(lim, False)}
        checker["seconds"] = max(0.0, self.end - time.monotonic())
        if self.jailed:  # the candidate's jail as a whole (memfds, /tmp) within memory_mb, where cgroups allow
            self.cgroup = self.cleanup.enter_context(jail.memory_cgroup(lim.memory_mb << 20))
        c = self.check
        spec = json.dumps({"trusted": c.trusted, "tests": c.tests, "calls": list(c.calls)}).encode()
        self.pending = {c_src: c.candidate.encode("utf-8", "surrogatepass"), k_src: spec}
        try:
            for role, cfg, io, fds, cgroup in (
                ("callee", callee, (c_in, out_w, out_w), (req_r, resp_w), self.cgroup),
                ("checker", checker, (k_in, verdict_w, out_w), (resp_r, req_w), None),
            ):
                args = jail.python_args(LOADER, program, role, json.dumps(cfg))
                self.procs.append(_Process(args, io, fds, self.jailed, lim.tmp_bytes, self.workdir, cgroup))
        finally:
            for fd in theirs:
                os.close(fd)

    def _feed(self, sel: selectors.BaseSelector, fd: int) -> None:
        try:
            n = os.write(fd, self.pending[fd][: 1 << 16])
            self.pending[fd] = self.pending[fd][n:]
            if self.pending[fd]:
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the process is gone (BrokenPipeError): what it does not read it cannot run
            pass
        sel.unregister(fd)
        del self.pending[fd]
        self.fds.remove(fd)
        os.close(fd)

    def drive(self) -> Optional[str]:
        """Feed both programs, collect output and verdict: None (verdict complete), ``timeout`` or ``output_limit``."""
        with selectors.DefaultSelector() as sel:
            for fd in self.pending:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_WRITE)
            for fd in (self.out, self.verdict):
                sel.register(fd, selectors.EVENT_READ)
            while True:
                left = self.end + GRACE_S - time.monotonic()
                if left <= 0:
                    return "timeout"
                for key, _ in sel.select(left):
                    if key.fd in self.pending:
                        self._feed(sel, key.fd)
                        continue
                    data = os.read(key.fd, 1 << 16)
                    if key.fd == self.verdict:
                        self.verdict_data += data
                        if not data or self.verdict_data.endswith(b"\n"):
                            return None
                    elif not data:
                        sel.unregister(key.fd)
                    else:
                        self.output += data
                        if len(self.output) > self.limits.output_bytes:
                            return "output_limit"

    def finish(self) -> None:
        """Kill both jails whole, wait for them, keep what output is left, close everything."""
        self.verdict = _parse_verdict(self.verdict_data)
        if self.verdict is not None and self.verdict.get("ended") is True and self.procs:
            try:  # the callee ended by itself: let its launcher report how (a CPU limit reads 'timeout')
                self.procs[0].proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            p.kill()
        self.returncodes = [p.reap() for p in self.procs]
        os.set_blocking(self.out, False)
        try:  # every writer is gone (jailed); unjailed, an escaped process may still hold the pipe
            while len(self.output) <= self.limits.output_bytes and (data := os.read(self.out, 1 << 16)):
                self.output += data
        except BlockingIOError:
            pass
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.over_memory = self.cgroup is not None and jail.oom_killed(self.cgroup)
        self.cleanup.close()

    def result(self, status: Optional[str], t0: float) -> Result:
        out = bytes(self.output[: self.limits.output_bytes]).decode("utf-8", "replace")
        seconds = time.monotonic() - t0
        if status is not None:
            return Result(False, status, seconds, out)
        verdict = self.verdict
        if verdict is None:
            raise jail.JailError(f"the checker ended without a verdict; its output: {out[-500:]!r}")
        if verdict.get("started") is not True and verdict.get("status") != "timeout":
            raise jail.JailError(f"the candidate's process did not start; its output: {out[-500:]!r}")
        passed = verdict.get("passed") is True
        status, error = "passed" if passed else str(verdict.get("status") or "failed"), str(verdict.get("error") or "")
        if status == "failed" and self.returncodes and self.returncodes[0] in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            status, error = "timeout", f"the candidate's process used its CPU time ({error})"
        elif not passed and self.over_memory:
            error = f"the candidate went over its memory bound ({self.limits.memory_mb} MiB, memfds and /tmp included)"
        return Result(passed, status, seconds, out, error)


def _parse_verdict(data: bytes) -> Optional[dict]:
    try:
        verdict = json.loads(bytes(data))
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) else None


def _compiles(source: str, name: str) -> Optional[str]:
    try:
        compile(source, name, "exec", dont_inherit=True)
    except Exception as e:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), RecursionError, ...
        return f"{type(e).__name__}: {e}"
    return None


def run_check(check: Check, limits: Limits = Limits(), deadline: Optional[float] = None) -> Result:
    """Run one check (see the module docstring); ``deadline``: a ``time.monotonic()`` bound (the batch's).  Raises
    :class:`JailUnavailable`, ValueError (trusted code or tests do not compile) or ``jail.JailError``."""
    t0 = time.monotonic()
    for source, name in ((check.trusted, "trusted code"), (check.tests, "tests")):
        if (err := _compiles(source, name)) is not None:
            raise ValueError(f"the {name} of a code check do not compile: {err}")
    wall = limits.wall_s if limits.wall_s is not None else 2 * limits.timeout_s + 1
    end = t0 + wall if deadline is None else min(t0 + wall, deadline)
    if end <= t0:
        return Result(False, "skipped")
    jailed = code_jail()
    if (err := _compiles(check.candidate, "candidate.py")) is not None:  # it would fail in the jail the same way
        return Result(False, "failed", time.monotonic() - t0, "", err)
    run = _Run(check, limits, jailed, end)
    try:
        run.start()
        status = run.drive()
    finally:
        run.finish()
    return run.result(status, t0)


def run_checks(
    checks: Sequence[Check], limits: Limits = Limits(), workers: int | None = None, total_timeout_s: float | None = None
) -> list[Result]:
    """Run checks ``workers`` at a time (default: the CPU count, at most 8); results in input order.
    ``total_timeout_s`` bounds the batch: those running then are killed (``timeout``), those not started ``skipped``."""
    checks = list(checks)
    if not checks:
        return []
    code_jail()  # refused here, once, rather than in every worker
    deadline = None if total_timeout_s is None else time.monotonic() + total_timeout_s
    workers = workers or min(8, os.cpu_count() or 1)
    if workers == 1 or len(checks) == 1:
        return [run_check(c, limits, deadline) for c in checks]
    with ThreadPoolExecutor(max_workers=min(workers, len(checks)), thread_name_prefix="espert-sandbox") as ex:
        return list(ex.map(lambda c: run_check(c, limits, deadline), checks))


def run_program(program: str, limits: Limits = Limits(), deadline: Optional[float] = None) -> Result:
    """Run a whole program as a candidate with no tests: it passes when its code ran without raising.  That is the
    program's own claim (it can exit early, or fake it): fine for limits and isolation, never a verdict."""
    return run_check(Check(program, ""), limits, deadline)


def run_programs(programs: Sequence[str], limits: Limits = Limits(), **kw) -> list[Result]:
    """:func:`run_program` over a batch, as :func:`run_checks`."""
    return run_checks([Check(p, "") for p in programs], limits, **kw)
