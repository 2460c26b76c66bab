"""The OS-level jail of the code rewards: bubblewrap (``bwrap``, Debian's ``bubblewrap`` package).

:func:`command` wraps a Python command line so that it runs with

* new user, PID, mount, IPC, UTS, network (and, where the kernel has it, cgroup) namespaces: it sees no other process,
  no network interface but a loopback that is down, no socket file of the host (the filesystem view is its own), no
  host IPC object;
* an unprivileged uid and gid, 65534, also when espert runs as root.  As root, bwrap joins a user namespace that maps
  uid/gid 0 and 65534 to themselves (:func:`_make_root_userns`, a new one for every jail, so no keyring or other state
  of a user namespace outlives a check); bwrap does the mounts as 0 there, and the program's first act
  (``jailed.confine``) is to become 65534, a real unprivileged user to the kernel, so ``RLIMIT_NPROC`` holds (the
  kernel exempts uid 0) and only world-readable files can be read.  Not as root, bwrap makes the user namespace itself
  and maps the user to 65534.  Either way the namespace cannot make further user namespaces, and no capability is
  left;
* a read-only view of only what the interpreter needs: ``/usr``, ``/bin``, ``/lib*`` (their symlinks where they are
  links), ``/etc/ld.so.cache``, the interpreter's prefix, with every site- and dist-packages directory in that view
  hidden (the standard library and lib-dynload only) and the foreign-function and test extensions (``_ctypes``,
  ``_testcapi``, ...) masked; ``/dev/null``, ``/dev/zero``, ``/dev/random``, ``/dev/urandom``; its own ``/proc`` (of
  its PID namespace); no ``/dev/shm``; and one writable place, a private tmpfs of ``tmp_bytes`` at ``/tmp``, its
  working directory.  The root is a read-only tmpfs;
* ``--die-with-parent``: if the process that launched it dies, the jail's init is killed, and with it every process of
  its PID namespace.  :mod:`espert.jail.sandbox` kills that init itself at the deadline.

:func:`status` probes once per process whether a jail can be made here, and says why not.  Where a memory cgroup can
be made (v2, else v1), each check's candidate runs in one of its own, bounded as a whole (:func:`memory_cgroup`,
:func:`memory_bound`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

NOBODY = 65534  # the unprivileged uid and gid of jailed code
INSTALL_HINT = "install bubblewrap (Debian, Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)"
#: The whole environment of jailed code (PYTHONHASHSEED: set and dict orders, hence pass/fail, repeat).
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp"}
ENVIRONMENT.update(PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")  # fixed hash seed: pass/fail repeats
DEVICES = ("null", "zero", "random", "urandom")
#: What the probe runs in the jail: the drop to 65534 that ``jailed.confine`` makes as root, then its uid.
PROBE = f"""import os
if os.getuid() == 0:
    os.setgroups([])
    os.setresgid({NOBODY}, {NOBODY}, {NOBODY})
    os.setresuid({NOBODY}, {NOBODY}, {NOBODY})
print("jailed as", os.getuid())
"""


class JailError(RuntimeError):
    """A jail could not be made, or broke while it ran."""


@dataclass(frozen=True)
class JailStatus:
    """Whether code can be jailed here: ``tool`` ("bubblewrap 0.8.0") and ``how`` (the uid setup), or ``reason``."""

    available: bool
    tool: str = ""
    how: str = ""
    reason: str = ""

    def line(self) -> str:
        """``bubblewrap 0.8.0 (...)`` or ``unavailable: REASON``."""
        return f"{self.tool} ({self.how})" if self.available else f"unavailable: {self.reason}"


_STATUS_LOCK = threading.Lock()
_STATUS: JailStatus | None = None


def _make_root_userns() -> int:
    """``unshare --user`` a helper, map uid/gid 0 and 65534 to themselves in its namespace, forbid further user
    namespaces there (``user.max_user_namespaces`` 0, written from inside as its root), keep a descriptor of it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise JailError("unshare (util-linux) is not installed: as root the jail needs it")
    script = 'read _ && exec sh -c "echo 0 > /proc/sys/user/max_user_namespaces && echo ready && exec cat"'
    argv, pipe = [unshare, "--user", "--", "sh", "-c", script], subprocess.PIPE
    p = subprocess.Popen(argv, env=ENVIRONMENT, stdin=pipe, stdout=pipe, stderr=pipe, start_new_session=True)
    try:
        own, deadline = os.readlink("/proc/self/ns/user"), time.monotonic() + 30
        while os.readlink(f"/proc/{p.pid}/ns/user") == own:  # unshare has not unshared yet
            if p.poll() is not None or time.monotonic() > deadline:
                raise JailError(f"unshare --user failed: {p.stderr.read().decode(errors='replace').strip()}")
            time.sleep(0.001)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{p.pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{NOBODY} {NOBODY} 1\n")
        p.stdin.write(b"go\n")
        p.stdin.flush()
        if p.stdout.readline().strip() != b"ready":
            p.kill()
            raise JailError(f"a user namespace for the jail failed: {p.stderr.read().decode(errors='replace')}")
        return os.open(f"/proc/{p.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        p.kill()
        p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            f.close()


def _python_dirs() -> list[str]:
    """What the interpreter needs that ``/usr`` does not hold: its prefix (the real one, under a venv)."""
    real = os.path.realpath
    dirs = {real(sys.base_prefix), real(sys.base_exec_prefix), os.path.dirname(os.path.dirname(real(sys.executable)))}
    out = []
    for d in sorted(dirs, key=len):
        if d not in ("/", "") and not any(d == o or d.startswith(o + "/") for o in ["/usr", *out]):
            out.append(d)
    return out


def _masked() -> list[str]:
    """Files hidden under ``/dev/null`` in the jail: the foreign-function and test extensions (``_ctypes*``, ``_test*``,
    ``_xxtest*``), so that no foreign call or raw memory access can be made even past the Python-level guard."""
    import glob
    import importlib.util

    found = set()
    origin = getattr(importlib.util.find_spec("_ctypes"), "origin", None)
    if origin and os.path.isfile(origin):
        found.add(os.path.realpath(origin))
        dynload = os.path.dirname(origin)
        for pattern in ("_ctypes*", "_test*", "_xxtest*"):
            found.update(os.path.realpath(f) for f in glob.glob(os.path.join(dynload, pattern)) if os.path.isfile(f))
    return sorted(found)


def _package_dirs() -> list[str]:
    """Package directories in the jail's view, hidden under empty read-only tmpfses: cffi & co. make foreign calls."""
    import glob
    import sysconfig

    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    found = {paths["purelib"], paths["platlib"]}
    for root in ("/usr/lib", "/usr/local/lib", "/usr/lib64"):
        found.update(glob.glob(os.path.join(root, "python3*", "*-packages")))
    views = ["/usr", *_python_dirs()]
    real = {os.path.realpath(d) for d in found if os.path.isdir(d)}
    return sorted(d for d in real if any(d == v or d.startswith(v + "/") for v in views))


def _filesystem(tmp_bytes: int) -> list[str]:
    """bwrap's mount options: read-only system and interpreter, devices, /proc, the tmpfs, a read-only root."""
    binds = [("--ro-bind", "/usr", "/usr")]
    links = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            links += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            binds.append(("--ro-bind", path, path))
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append(("--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"))
    binds += [("--ro-bind", d, d) for d in _python_dirs()]
    binds += [("--ro-bind", "/dev/null", f) for f in _masked()]
    binds += [("--dev-bind", f"/dev/{dev}", f"/dev/{dev}") for dev in DEVICES]
    # the directories above the mount points: bwrap would make them 0700, which 65534 could not pass through
    under = [d for _, _, d in binds]
    above = {"/" + "/".join(d.strip("/").split("/")[:i]) for d in under for i in range(1, d.strip("/").count("/") + 1)}
    parents = sorted(p for p in above if not any(p == u or p.startswith(u + "/") for u in under))
    ops = [x for p in parents for x in ("--perms", "0755", "--dir", p)] + links
    ops += [x for bind in binds for x in bind]
    ops += [x for d in _package_dirs() for x in ("--perms", "0755", "--tmpfs", d, "--remount-ro", d)]
    ops += ["--proc", "/proc", "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp", "--remount-ro", "/"]
    return ops


def command(args: list[str], tmp_bytes: int) -> tuple[list[str], tuple[int, ...]]:
    """``(argv, fds)``: ``args`` run in the jail, and the descriptors bwrap must inherit, closed once it has started
    (:func:`launch`).  As root, ``jailed.confine(drop=True)`` drops to 65534.  Raises :class:`JailError`."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise JailError(f"bwrap not found: {INSTALL_HINT}")
    if os.geteuid() == 0:
        fd = _make_root_userns()  # one per jail: no keyring or other per-namespace state is shared
        who = ["--userns", str(fd), "--uid", "0", "--gid", "0", "--cap-drop", "ALL"]
        who += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]  # to drop to 65534, then gone
        fds: tuple[int, ...] = (fd,)
    else:
        who, fds = ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)], ()
    spaces = ["--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    spaces += ["--die-with-parent", "--new-session", "--hostname", "jail"]
    env = ["--clearenv"] + [x for k, v in ENVIRONMENT.items() for x in ("--setenv", k, v)]
    return [bwrap, *who, *spaces, *_filesystem(tmp_bytes), *env, "--chdir", "/tmp", "--", *args], fds


@functools.cache
def _memory_root() -> tuple[str, str] | None:
    """``(version, directory)`` of this process's memory cgroup where a child can be made (v2, else v1), or None."""
    found = []
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and "memory" in _read("/sys/fs/cgroup/cgroup.controllers"):
            found.append(("v2", f"/sys/fs/cgroup{path.rstrip('/')}"))
        elif "memory" in controllers.split(","):
            found.append(("v1", f"/sys/fs/cgroup/memory{path.rstrip('/')}"))
    for version, d in sorted(found):  # v2 first
        try:
            os.rmdir(_new_cgroup(d, 1 << 30))
            return version, d
        except OSError:
            continue
    return None


def _read(path: str) -> str:
    try:
        return open(path, encoding="utf-8").read()
    except OSError:
        return ""


def _new_cgroup(parent: str, limit_bytes: int) -> str:
    """A new memory cgroup under ``parent`` holding at most ``limit_bytes`` of memory and no swap."""
    d = os.path.join(parent, f"espert-check-{os.getpid()}-{next(_CGROUP_IDS)}")
    os.mkdir(d)
    v2 = os.path.exists(os.path.join(d, "memory.max"))
    limits = [("memory.max", limit_bytes), ("memory.swap.max", 0)] if v2 else [("memory.limit_in_bytes", limit_bytes)]
    if not v2 and os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
        limits.append(("memory.memsw.limit_in_bytes", limit_bytes))
    try:
        for name, value in limits:
            with open(os.path.join(d, name), "w") as f:
                f.write(str(value))
    except OSError:
        os.rmdir(d)
        raise
    return d


_CGROUP_IDS = itertools.count()


def memory_bound() -> str:
    """Which memory bound holds for a check's candidate, in one line (``espert env`` prints it)."""
    if (root := _memory_root()) is not None:
        return (
            f"cgroup {root[0]} memory: each check's candidate ≤ memory_mb as a whole (memfds and /tmp included), "
            f"a cgroup of its own under {root[1]}"
        )
    return (
        "no memory cgroup can be made here: each candidate process ≤ memory_mb of address space + "
        "open_files × file_bytes of memfds, + tmp_bytes in /tmp; all checks: workers × that"
    )


def oom_killed(cgroup: str) -> bool:
    """Whether the kernel killed a process of ``cgroup`` (a :func:`memory_cgroup` directory) for its memory."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1: an "oom_kill N" line
        for line in _read(os.path.join(cgroup, name)).splitlines():
            if line.startswith("oom_kill ") and line.split()[1] != "0":
                return True
    return False


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A memory cgroup of ``limit_bytes`` for one jail, removed once the jail is gone; None where none can be made."""
    root = _memory_root()
    d = _new_cgroup(root[1], limit_bytes) if root is not None else None
    try:
        yield d
    finally:
        for _ in range(100) if d is not None else ():
            try:  # a killed jail's processes may take a moment to leave it
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.01)


def launch(
    args: list[str], tmp_bytes: int, info_fd: int | None = None, pass_fds=(), cgroup: str | None = None, **popen
) -> subprocess.Popen:
    """Start ``args`` in a jail (:func:`command`; ``info_fd``: bwrap's ``--info-fd``; ``cgroup``: joined before bwrap
    starts).  bwrap has the jail's environment: not as root, it is the jail's process 1 with the candidate's uid, so its
    environment would be readable in ``/proc/1/environ`` (``--clearenv`` clears only the program's)."""
    argv, fds = command(args, tmp_bytes)
    if info_fd is not None:
        argv = [argv[0], "--info-fd", str(info_fd), *argv[1:]]
        pass_fds = (*pass_fds, info_fd)
    if cgroup is not None:  # the shell joins the cgroup, then becomes bwrap (same process): nothing runs outside it
        argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(cgroup, "cgroup.procs"), *argv]
    try:
        return subprocess.Popen(argv, pass_fds=(*pass_fds, *fds), env=ENVIRONMENT, **popen)
    finally:
        for fd in fds:  # the jail holds its user namespace now
            os.close(fd)


def python_args(source: str, *argv: str) -> list[str]:
    """The interpreter running ``source``: ``-S`` (stdlib only), ``-s -P`` (no user site, no script path)."""
    return [os.path.realpath(sys.executable), "-S", "-s", "-P", "-c", source, *argv]


def status() -> JailStatus:
    """Whether a jail can be made here (probed once per process: a jailed interpreter must start and say so)."""
    global _STATUS
    with _STATUS_LOCK:
        if _STATUS is None:
            _STATUS = _probe()
        return _STATUS


def _probe() -> JailStatus:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return JailStatus(False, reason=f"bwrap not found: {INSTALL_HINT}")
    try:
        v = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30).stdout.split()
        tool = " ".join(v[:2]) if v else "bubblewrap"
        with launch(python_args(PROBE), 1 << 20, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()  # as subprocess.run does: no probe outlives its time
                raise
    except (JailError, OSError, subprocess.SubprocessError) as e:
        return JailStatus(False, reason=str(e))
    said = (out + err).strip().splitlines()
    if p.returncode != 0 or out.strip() != f"jailed as {NOBODY}":
        return JailStatus(False, reason=f"{tool} cannot make a jail here: {said[-1] if said else p.returncode}")
    how = "root: joins a user namespace mapping 0 and 65534, then drops to 65534" if os.geteuid() == 0 else ""
    return JailStatus(True, tool, how or f"uid {os.geteuid()} mapped to {NOBODY} in its own user namespace")
