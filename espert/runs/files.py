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


def lock_run(run_dir: str) -> tuple[int, str]:
    """Take the run directory's writer lock (``flock`` on :func:`lock_path`); returns ``(fd, path)``.

    The lock dies with its holder (a SIGKILLed writer leaves none behind), so there is nothing stale
    to clean up.  Raises :class:`RunBusy` naming the holder's pid and host, and changes nothing, when
    another process writes the run.  flock is not reliable on every network filesystem (some NFS
    setups grant it to both clients); the holder record (pid, host, start time) is written for people.
    :func:`unlock_run` removes the file; a killed holder leaves it, and the next writer reuses it.
    """
    import fcntl
    import socket
    import time

    path = lock_path(run_dir)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise RunBusy(
                f"{run_dir} is being written by {holder}; one process at a time may write a run "
                f"(wait for it to end, or stop it: its log and checkpoints stay intact)"
            ) from None
        try:  # the holder before us may have removed the file between our open and our lock: lock the new one
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0)
    return fd, path


def unlock_run(lock: tuple[int, str]) -> None:
    """Release the lock taken by :func:`lock_run` and remove its file (still holding it, so no other process
    can hold a removed file's lock: :func:`lock_run` checks that the file it locked is still the path's)."""
    fd, path = lock
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


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
