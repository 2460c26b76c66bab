"""Run untrusted Python programs (model-written code plus its unit tests) for the code rewards.

Each program runs in its own process, ``sys.executable -S -s -P -c RUNNER`` in a fresh temporary
directory, and *passes* only when the runner reaches its end: the program (solution and tests) ran
without raising, and the runner then wrote a random per-run token to its saved stdout and exited 0.
``sys.exit(0)``, ``os._exit(0)``, ``KeyboardInterrupt``, a crash, a limit or a timeout before that
point is a failure; so is a program that does not compile (checked in the parent: compiling runs
nothing, and the child would fail the same way).  What is enforced, and how (docs/eval.md, "Sandbox"):

* wall clock: the parent kills the process group (``start_new_session=True``, ``os.killpg``)
  at the deadline; CPU time: ``RLIMIT_CPU``; memory: ``RLIMIT_AS``; files: ``RLIMIT_FSIZE``;
  processes: ``RLIMIT_NPROC`` (0: no new process or thread; the kernel ignores it for root) and a
  Python-level guard that replaces ``os.fork``/``os.system``/``os.exec*``/``os.spawn*``/
  ``os.posix_spawn``/``subprocess`` (``_posixsubprocess.fork_exec``)/``os.kill``; ``ctypes`` cannot
  be imported; core dumps: ``RLIMIT_CORE`` 0;
* output: at most ``output_bytes`` of stdout+stderr are read; more kills the process (a failure);
* environment: the child gets a fixed minimal environment (no variable of the parent); reading
  ``/proc/<pid>`` of another process is refused by the guard (a same-user process could otherwise
  read the trainer's environment from ``/proc/<ppid>/environ``);
* files: ``open``/``os.open`` for writing and ``os.remove``/``rename``/``mkdir``/... outside the
  temporary directory raise ``PermissionError`` (Python-level guard); the directory is removed after;
* network: a new network namespace with no interface up (``unshare --net``) when the host allows it
  (root, see :func:`network_namespace`), and in any case a Python-level guard: ``_socket.socket``,
  hence ``socket.socket``, cannot be instantiated, ``socketpair`` and name lookups raise.

The Python-level guards are best effort, not a security boundary: they stop accidents and the
usual hostile shapes (fork bombs, ``rm -rf``, exfiltration), not code written to defeat them (for
instance through ``_io.FileIO`` or by reading the token out of the interpreter's memory).  Run
untrusted code from the open internet in a container or VM.  ``-s -P`` with a controlled
environment is ``-I`` (isolated mode) except ``-E``: the environment is wholly ours, and it sets
``PYTHONHASHSEED=0`` so that set and dict orders, hence pass/fail, do not change between runs.
``-S`` (no ``site``): only the standard library can be imported, and a start takes ~20 ms instead
of ~90 ms (the environment's ``.pth`` files are not run).
"""

from __future__ import annotations

import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

#: The program the child runs before (and around) the untrusted code.  argv: cpu seconds, address
#: space bytes, file size bytes, process limit.  stdin: the token.  The program is ./program.py.
RUNNER = r"""
import os, sys, resource
def _setup():
    tok = sys.stdin.buffer.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
    cpu, mem, fsize, nproc = (int(x) for x in sys.argv[1:5])
    for lim, v in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                   (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NPROC, (nproc, nproc)),
                   (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(lim, v)
    root = os.path.realpath(os.getcwd())
    src = open("program.py", encoding="utf-8").read()
    import builtins, io, posix, _socket, _posixsubprocess
    def deny(name):
        def denied(*a, **k):
            raise PermissionError("sandbox: " + name + " is not allowed")
        return denied
    for n in ("fork", "forkpty", "system", "popen", "execv", "execve", "execvp", "execvpe", "execl",
              "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
              "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "kill", "killpg",
              "setsid", "setpgid", "setpgrp", "chroot", "pidfd_open"):
        for m in (os, posix):
            if hasattr(m, n):
                setattr(m, n, deny("os." + n))
    _posixsubprocess.fork_exec = deny("subprocess")
    resource.setrlimit = resource.prlimit = deny("resource.setrlimit")
    for n in ("ctypes", "_ctypes"):
        sys.modules[n] = None
    real = os.path.realpath
    own = ("/proc/self", "/proc/thread-self", "/proc/%d" % os.getpid())
    def check(path, write, dir_fd=None):
        if isinstance(path, int):
            return
        p = os.fsdecode(path)
        if dir_fd is not None and not p.startswith("/"):
            p = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd), p)
        p = real(p)
        if write and p != root and not p.startswith(root + os.sep):
            raise PermissionError("sandbox: writing outside the working directory: " + p)
        if p.startswith("/proc/") and not any(p == o or p.startswith(o + "/") for o in own):
            raise PermissionError("sandbox: reading another process: " + p)
    real_open, real_os_open = builtins.open, os.open
    def guarded_open(file, mode="r", *a, **k):
        check(file, any(c in mode for c in "wax+"))
        return real_open(file, mode, *a, **k)
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    def guarded_os_open(path, flags, *a, **k):
        check(path, flags & W, k.get("dir_fd"))
        return real_os_open(path, flags, *a, **k)
    builtins.open = io.open = guarded_open
    os.open = posix.open = guarded_os_open
    def wrap(fn, npaths):
        def guarded(*a, **k):
            fds = (k.get("src_dir_fd", k.get("dir_fd")), k.get("dst_dir_fd", k.get("dir_fd")))
            for p, fd in zip(a[:npaths], fds):
                check(p, True, fd)
            return fn(*a, **k)
        return guarded
    for n, k in (("remove", 1), ("unlink", 1), ("rmdir", 1), ("mkdir", 1), ("rename", 2), ("replace", 2),
                 ("truncate", 1), ("chmod", 1), ("chown", 1), ("lchown", 1), ("link", 2), ("symlink", 2),
                 ("utime", 1), ("mkfifo", 1), ("mknod", 1), ("removedirs", 1), ("renames", 2)):
        if hasattr(os, n):
            g = wrap(getattr(os, n), k)
            setattr(os, n, g)
            if hasattr(posix, n):
                setattr(posix, n, g)
    # socket.py is not imported yet: it subclasses _socket.socket and calls _socket's functions, so
    # patching _socket covers both (and importing socket here would cost ~15 ms a program)
    class NoSocket(_socket.socket):
        __slots__ = ()  # socket.socket adds __weakref__
        def __init__(self, *a, **k):
            raise PermissionError("sandbox: network access is not allowed")
    _socket.socket = _socket.SocketType = NoSocket
    for n in ("socketpair", "dup", "getaddrinfo", "getnameinfo", "gethostbyname", "gethostbyname_ex",
              "gethostbyaddr"):
        if hasattr(_socket, n):
            setattr(_socket, n, deny("network access"))
    return tok, src, os.dup(1)
def _main():
    tok, src, out = _setup()
    _exit, _write, _flush = os._exit, os.write, (sys.stdout.flush, sys.stderr.flush)
    ok = False
    try:
        exec(compile(src, "program.py", "exec"), {"__name__": "__main__"})
        for f in _flush:
            f()
        ok = True
    except BaseException:
        try:
            import traceback
            traceback.print_exc(limit=3)
            sys.stderr.flush()
        except BaseException:
            pass
    if ok:
        _write(out, b"\n" + tok + b"\n")
        _exit(0)
    _exit(1)
_main()
"""


@dataclass(frozen=True)
class Limits:
    """Limits of one program.  cpu_s None: ``ceil(timeout_s)``."""

    timeout_s: float = 10.0
    cpu_s: Optional[int] = None
    memory_mb: int = 1024
    output_bytes: int = 1 << 16
    file_bytes: int = 1 << 24
    procs: int = 0


@dataclass
class Result:
    """What became of one program: ``status`` is ``passed``, ``failed`` (it raised or exited before the
    end), ``timeout``, ``output_limit`` or ``skipped`` (the batch's total time was spent before it
    started).  ``output``: its stdout+stderr (at most ``output_bytes``), the token removed."""

    passed: bool
    status: str
    returncode: Optional[int] = None
    seconds: float = 0.0
    output: str = field(default="", repr=False)


_NETNS: Optional[list[str]] = None


def network_namespace() -> list[str]:
    """The command prefix that gives a child its own empty network namespace (``["unshare", "--net"]``),
    or ``[]`` where this host does not allow it (not root, no ``unshare``).  Probed once."""
    global _NETNS
    if _NETNS is None:
        _NETNS = []
        exe = shutil.which("unshare")
        if exe:
            try:
                ok = subprocess.run([exe, "--net", "true"], capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            _NETNS = [exe, "--net"] if ok else []
    return list(_NETNS)


def _child_env(workdir: str) -> dict:
    """The whole environment of a child: nothing of the parent's."""
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits, leaving it a zombie (its pid, hence its process group id, stays
    reserved, so the ``killpg`` after cannot hit a stranger).  False at the deadline."""
    delay = 0.0005
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(program: str, limits: Limits = Limits(), deadline: Optional[float] = None) -> Result:
    """Run one program in the sandbox (see the module docstring).  ``deadline``: a ``time.monotonic()``
    bound that may cut ``limits.timeout_s`` short (the batch's total time)."""
    t0 = time.monotonic()
    end = t0 + limits.timeout_s if deadline is None else min(t0 + limits.timeout_s, deadline)
    if end <= t0:
        return Result(False, "skipped")
    try:  # compiling runs nothing; a program that does not compile fails in the child too, so skip it
        compile(program, "program.py", "exec", dont_inherit=True)
    except Exception as e:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), RecursionError, ...
        return Result(False, "failed", None, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    cpu = limits.cpu_s if limits.cpu_s is not None else max(1, math.ceil(limits.timeout_s))
    token = secrets.token_hex(16).encode()
    workdir = tempfile.mkdtemp(prefix="espert-sandbox-")
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(program)
        argv = [
            *network_namespace(),
            sys.executable,
            "-S",
            "-s",
            "-P",
            "-c",
            RUNNER,
            str(cpu),
            str(limits.memory_mb << 20),
            str(limits.file_bytes),
            str(limits.procs),
        ]
        p = subprocess.Popen(
            argv,
            cwd=workdir,
            env=_child_env(workdir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
        buf, status = b"", "failed"
        try:
            buf, status = _drive(p, token, limits.output_bytes, end)
        finally:
            if not _wait_unreaped(p.pid, max(end, time.monotonic())):  # it closed its output but runs on
                _killpg(p.pid)
                status = status or "timeout"
                _wait_unreaped(p.pid, time.monotonic() + 5.0)
            _killpg(p.pid)  # whatever is left of its group (the leader is a zombie: its pgid is still ours)
            p.wait()
            p.stdout.close()
        tail = b"\n" + token + b"\n"
        passed = status is None and p.returncode == 0 and buf.endswith(tail)
        if status is None and p.returncode == -signal.SIGXCPU:
            status = "timeout"  # the CPU-time limit (RLIMIT_CPU) can fire before the wall-clock one
        if status is None:
            status = "passed" if passed else "failed"
        out = buf[: -len(tail)] if buf.endswith(tail) else buf
        return Result(passed, status, p.returncode, time.monotonic() - t0, out.decode("utf-8", "replace"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _drive(p: subprocess.Popen, token: bytes, max_bytes: int, end: float) -> tuple[bytes, Optional[str]]:
    """Hand the child its token and read its output until EOF: ``(output, None)``, or ``(output,
    "timeout" | "output_limit")`` after killing its process group."""
    try:
        p.stdin.write(token + b"\n")
        p.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    fd = p.stdout.fileno()
    os.set_blocking(fd, False)
    chunks, n = [], 0
    limit = max_bytes + len(token) + 2
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                _killpg(p.pid)
                return b"".join(chunks), "timeout"
            if not sel.select(left):
                continue
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not data:
                return b"".join(chunks), None
            chunks.append(data)
            n += len(data)
            if n > limit:
                _killpg(p.pid)
                return b"".join(chunks)[:max_bytes], "output_limit"


def run_programs(
    programs: Sequence[str],
    limits: Limits = Limits(),
    workers: Optional[int] = None,
    total_timeout_s: Optional[float] = None,
) -> list[Result]:
    """Run programs in parallel (``workers`` processes at a time, default: the CPU count, at most 8);
    results in input order.  ``total_timeout_s`` bounds the whole batch: programs still running at
    that point are killed (``timeout``) and programs not started are ``skipped``."""
    programs = list(programs)
    if not programs:
        return []
    deadline = None if total_timeout_s is None else time.monotonic() + total_timeout_s
    workers = workers or min(8, os.cpu_count() or 1)
    if workers == 1 or len(programs) == 1:
        return [run_program(p, limits, deadline) for p in programs]
    with ThreadPoolExecutor(max_workers=min(workers, len(programs)), thread_name_prefix="espert-sandbox") as ex:
        return list(ex.map(lambda prog: run_program(prog, limits, deadline), programs))
