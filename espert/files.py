"""The files of a run directory: their names, atomic writes, checksums, config-file parsing, kill points.

Every file of a run is written to a temporary name, fsynced and ``os.replace``d (:func:`atomic_write`).
Tests kill a run at named points (:func:`kill_point`) through the environment variable
``ESPERT_TEST_KILL_AT=POINT[:ITERATION]``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import threading
from typing import Callable, Iterator

import yaml

FORMAT = "espert-run-v1"
CONFIG, LOG, CENTER, EXPORT, BASE = "config.yaml", "log.jsonl", "center.safetensors", "export", "base_model"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
#: Files of a model directory that its fingerprint covers: weights, configs, tokenizer, remote code.
MODEL_SUFFIXES = WEIGHT_SUFFIXES + (".json", ".model", ".txt", ".tiktoken", ".jinja", ".py")
KILL_ENV = "ESPERT_TEST_KILL_AT"


class RunError(ValueError):
    """A run directory (or one of its files) is damaged or does not match; the message names the file."""


class RunBusy(FileExistsError):
    """Another process holds the run directory's writer lock; the message names its pid and host."""


def lock_path(run_dir: str) -> str:
    """The writer lock of ``run_dir``: ``.NAME.lock`` beside it, so the run directory's own files are only
    the run's (a refused or failed start leaves them byte for byte as they were)."""
    parent, name = os.path.split(os.path.abspath(run_dir))
    return os.path.join(parent, f".{name}.lock")


#: Seconds between two heartbeats of a writer's holder record, and the age after which a record from
#: another host no longer stands for a live writer (see :func:`lock_run`).
HEARTBEAT_SECONDS, HEARTBEAT_STALE = 10.0, 60.0


def _holder(text: str) -> dict:
    """The fields of a holder record (``pid P on HOST since T heartbeat H``); {} when unreadable."""
    parts = text.split()
    try:
        return {"pid": int(parts[1]), "host": parts[3], "since": parts[5], "heartbeat": float(parts[7])}
    except (IndexError, ValueError):
        return {}


def lock_run(run_dir: str) -> tuple[int, str]:
    """Take the run directory's writer lock (``flock`` on :func:`lock_path`); returns ``(fd, path)``.

    The lock dies with its holder (a SIGKILLed writer leaves none behind), so there is nothing stale
    to clean up.  Raises :class:`RunBusy` naming the holder's pid and host, and changes nothing, when
    another process writes the run.  flock is not reliable on every network filesystem (some NFS
    setups grant it to two clients at once), so the lock file also holds a holder record, ``pid P on
    HOST since T heartbeat H``, whose heartbeat a thread renews every :data:`HEARTBEAT_SECONDS`: a
    record from another host with a heartbeat younger than :data:`HEARTBEAT_STALE` refuses the lock
    even when flock grants it.  :func:`unlock_run` removes the file; a killed holder leaves it, and the
    next writer reuses it.
    """
    import socket
    import time

    path, host = lock_path(run_dir), socket.gethostname()
    fd = _flock(run_dir, path)
    old = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    rec = _holder(old)
    if rec and rec["host"] != host and time.time() - rec["heartbeat"] < HEARTBEAT_STALE:
        os.close(fd)
        raise RunBusy(
            f"{run_dir} is being written by {old.split(' heartbeat')[0]} (heartbeat "
            f"{time.time() - rec['heartbeat']:.0f} s ago), although the filesystem granted this process the "
            f"lock: flock is unreliable on some network filesystems (NFS). If that writer is gone, wait "
            f"{HEARTBEAT_STALE:.0f} s, or remove {path}"
        )
    _start_heartbeat(fd, host)
    return fd, path


def _flock(run_dir: str, path: str) -> int:
    """An fd holding the exclusive flock of the lock file at ``path``; RunBusy naming the holder otherwise."""
    import fcntl
    import time

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            rec = _holder(holder)
            if rec:
                age = time.time() - rec["heartbeat"]
                holder = f"pid {rec['pid']} on {rec['host']} since {rec['since']} (heartbeat {age:.0f} s ago)"
            raise RunBusy(
                f"{run_dir} is being written by {holder}; one process at a time may write a run "
                f"(wait for it to end, or stop it: its log and checkpoints stay intact)"
            ) from None
        try:  # the holder before us may have removed the file between our open and our lock: lock the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _start_heartbeat(fd: int, host: str) -> None:
    """Write this holder's record into the lock file and renew its heartbeat every HEARTBEAT_SECONDS."""
    import time

    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    stop, guard = threading.Event(), threading.Lock()

    def beat() -> None:
        rec = f"pid {os.getpid()} on {host} since {since} heartbeat {time.time():.0f}\n".encode()
        os.pwrite(fd, rec, 0)  # then cut: a reader never sees an empty record
        os.ftruncate(fd, len(rec))

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS):
            with guard:  # unlock_run closes the fd under the guard: never a beat into a reused fd number
                if stop.is_set():
                    return
                try:
                    beat()
                except OSError:  # a full disk: the flock still holds; the record just ages
                    pass

    beat()
    _HEARTBEATS[fd] = (stop, guard)
    threading.Thread(target=heartbeat, name="espert-lock-heartbeat", daemon=True).start()


_HEARTBEATS: dict = {}  # lock fd -> (Event that stops its heartbeat thread, the Lock its beats hold)


def unlock_run(lock: tuple[int, str]) -> None:
    """Release the lock taken by :func:`lock_run` and remove its file (still holding it, so no other process
    can hold a removed file's lock: :func:`lock_run` checks that the file it locked is still the path's)."""
    fd, path = lock
    stop, guard = _HEARTBEATS.pop(fd, (threading.Event(), threading.Lock()))
    with guard:
        stop.set()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.close(fd)


def enclosing_run(path: str) -> str | None:
    """The run directory that ``path`` is (or lies in): the nearest directory up from it with a
    ``config.yaml`` and a ``log.jsonl``; None when there is none."""
    p = os.path.abspath(path)
    while True:
        if os.path.isfile(os.path.join(p, CONFIG)) and os.path.isfile(os.path.join(p, LOG)):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


@contextlib.contextmanager
def writing_into(path: str) -> Iterator[None]:
    """Hold the writer lock of the run that ``path`` lies in, if any, while the body writes there
    (``replay --out``, ``analyze --export``); readers and writes elsewhere take no lock."""
    run = enclosing_run(path)
    if run is None:
        yield
        return
    lock = lock_run(run)
    try:
        yield
    finally:
        unlock_run(lock)


def kill_point(name: str, iteration: int | None = None) -> None:
    """SIGKILL this process here when ``ESPERT_TEST_KILL_AT`` is ``name`` or ``name:iteration`` (chaos tests)."""
    want = os.environ.get(KILL_ENV)
    if want and want in (name, f"{name}:{iteration}"):
        os.kill(os.getpid(), signal.SIGKILL)


# ---- atomic files ----------------------------------------------------------------------------------

#: errnos of a write the environment refused (full disk, quota, I/O error, read-only filesystem, file
#: too large): reported in one line naming the file, never a traceback (:func:`write_error_line`).
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})


def is_write_error(e: BaseException) -> bool:
    """An OSError of :data:`WRITE_ERRNOS`."""
    return isinstance(e, OSError) and e.errno in WRITE_ERRNOS


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Name ``path`` in an OSError raised inside (``write()`` and ``fsync()`` errors name no file; the
    temporary file of an atomic write is named by its target)."""
    try:
        yield
    except OSError as e:
        if e.filename is None or ".tmp-" in os.path.basename(str(e.filename)):
            e.filename = path
        raise


def write_error_line(e: OSError) -> str:
    """``cannot write FILE: ENOSPC (No space left on device)``."""
    name = errno.errorcode.get(e.errno, str(e.errno))
    target = e.filename2 or e.filename  # a copy's or a rename's second file is the one written
    return f"cannot write {target or 'a file'}: {name} ({os.strerror(e.errno)})"


def check_output_path(path: str, what: str, kind: str = "directory", spare: int = 0) -> None:
    """ValueError, before anything is written, when ``path`` cannot become the output ``kind`` ("directory" or
    "file") that ``what`` names: a NUL byte, an existing entry of the other kind, a regular file among its
    parents, or a name longer than the filesystem takes (``spare``: bytes its last name must leave for the
    temporary sibling an atomic write adds)."""
    if "\0" in path:
        raise ValueError(f"{what} {path!r} holds a NUL byte")
    full = os.path.abspath(path)
    if os.path.isdir(full) if kind == "file" else (os.path.exists(full) and not os.path.isdir(full)):
        raise ValueError(f"{what} {path} exists and is {'a directory' if kind == 'file' else 'not a directory'}")
    parent = full
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if parent != full and not os.path.isdir(parent):
        raise ValueError(f"{what} {path}: {parent} is a file, not a directory")
    try:
        limit = os.pathconf(parent if os.path.isdir(parent) else os.path.dirname(parent), "PC_NAME_MAX")
    except (OSError, ValueError):  # pragma: no cover - a filesystem that does not say
        limit = 255
    names = full[len(parent) :].split(os.sep)
    for i, name in enumerate(names):
        if len(os.fsencode(name)) + (spare if i == len(names) - 1 else 0) > limit:
            raise ValueError(f"{what} {path}: the name {name[:16]}... is longer than the filesystem's {limit} bytes")


def fsync_dir(path: str) -> None:
    """fsync a directory (makes renames in it durable); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], object], before_replace: Callable[[object], None] | None = None):
    """``r = write(tmp_path)``, fsync it, ``before_replace(r)``, then ``os.replace`` it onto ``path`` and fsync
    the directory.  Returns r."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with naming(path):  # a failed write leaves the old file untouched and no temporary one
            r = write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        if before_replace is not None:
            before_replace(r)
        with naming(path):
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with naming(path):
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    return r


def atomic_write_text(path: str, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def stat_key(st: os.stat_result) -> str:
    # ctime and inode change whenever a file is rewritten or replaced, and cannot be set back by hand
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def read_config_file(path: str):
    """The parsed YAML (``.yaml``/``.yml``/anything else) or TOML (``.toml``) document at ``path``.

    Raises FileNotFoundError, or ValueError with one line naming the file and the position of a
    syntax error.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file not found: {path}")
    if path.endswith(".toml"):
        import tomllib

        try:
            with open(path, "rb") as f:
                return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: invalid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = " ".join(str(x) for x in (e.context, e.problem) if x)
        raise ValueError(f"{path}: invalid YAML at {where}{what}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: invalid YAML: not UTF-8 text ({e.reason} at byte {e.start})") from None
