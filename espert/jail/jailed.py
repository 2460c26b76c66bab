"""The two programs of a code check: the *callee* runs the untrusted candidate, the *checker* runs the trusted tests
and decides (:mod:`espert.jail.sandbox` launches them).

Its compiled code is handed to a fresh interpreter (``python -S -s -P -c LOADER CODE ROLE CONFIG``) in the jail, where
only the standard library exists, so it imports nothing else (not even ``json``: :func:`_json_codec`).  The two
processes talk over two pipes, one JSON document a line:

* checker -> callee: ``{"resolve": NAME}`` (the candidate's value of a name the tests call), ``{"call": {"r": ID},
  "args": [...], "kwargs": {...}}``, ``{"get": {"r": ID}, "attr": NAME}``;
* callee -> checker: ``{"started": true}`` (before any untrusted code), ``{"loaded": true}`` or ``{"loaded": false,
  "raise": [TYPE, MESSAGE]}``, then per request ``{"ok": VALUE, "after": [...]}`` or ``{"raise": [TYPE, MESSAGE]}``.

Values travel as data (:func:`encode`, :func:`decode`): ``None``, bools, ints, floats, strings and lists as
themselves; tuples, dicts, sets, frozensets, bytes, bytearrays and complex numbers tagged; any other object of the
candidate stays in the callee, a reference (``{"r": ID}``) that the checker can pass back, call or read attributes of,
and that equals only itself.  The checker decodes into plain built-in objects of its own, so the tests compare data:
the candidate's ``__eq__``, patched builtins, frames and memory never reach the decision.  ``after`` carries the new
contents of list, dict, set and bytearray arguments (a function that changes its argument in place changes the
test's object).  The checker writes its verdict, ``{"passed", "status", "error", "started", "calls"}``, to stdout, one
line; then both wait to be killed (:func:`linger`).
"""

import builtins
import os
import select
import sys
import time

NOBODY = 65534
_TAGGED = {"t": tuple, "s": set, "fs": frozenset}  # the containers the codec tags (lists travel as JSON arrays)


def _json_codec():
    """``(dumps, loads)`` from ``_json``'s C scanner and encoder: ``import json`` imports ``re``, ~12 ms a process."""
    try:
        import _json

        class Context:  # what _json's scanner reads
            strict, object_hook, object_pairs_hook = True, None, None
            parse_float, parse_int = float, int
            parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__

        scan = _json.make_scanner(Context())

        def refuse(o):
            raise TypeError(f"{type(o).__name__} is not JSON")

        encode = _json.make_encoder({}, refuse, _json.encode_basestring_ascii, None, ":", ",", False, False, True)
    except (ImportError, AttributeError, TypeError):  # another interpreter: the package
        import json

        return (lambda doc: json.dumps(doc, separators=(",", ":"))), json.loads

    def loads(text):
        try:
            doc, end = scan(text, 0)
        except StopIteration:
            raise ValueError("not JSON") from None
        if end != len(text):
            raise ValueError("extra data after a JSON document")
        return doc

    return (lambda doc: "".join(encode(doc, 0))), loads


dumps, loads = _json_codec()


class CandidateError(Exception):
    """The candidate failed in a way no built-in exception names (it exited, sent garbage, raised SystemExit)."""


class CheckTimeout(Exception):
    """The check's time ran out while waiting for the candidate."""


def encode(x, refs=None):
    """``x`` as JSON-able data; other objects go into ``refs``, the callee's references (checker: None, TypeError)."""
    if x is None or x is True or x is False:
        return x
    for kind in (bool, int, float, str):
        if isinstance(x, kind):
            return kind(x)
    if isinstance(x, list):
        return [encode(v, refs) for v in x]
    for tag, kind in _TAGGED.items():
        if isinstance(x, kind):
            return {tag: [encode(v, refs) for v in x]}
    if isinstance(x, dict):
        return {"d": [[encode(k, refs), encode(v, refs)] for k, v in x.items()]}
    if isinstance(x, (bytes, bytearray)):
        return {"ba" if isinstance(x, bytearray) else "b": bytes(x).hex()}
    if isinstance(x, complex):
        return {"c": [x.real, x.imag]}
    if isinstance(x, Remote):
        return {"r": x.ref}
    if refs is None:
        raise TypeError(f"a {type(x).__name__} cannot be sent to the candidate")
    refs[id(x)] = x
    return {"r": id(x), "type": type(x).__name__}


def decode(x, resolve):
    """Built-in objects from :func:`encode`'s data; ``resolve(ref)`` turns a reference into an object."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [decode(v, resolve) for v in x]
    if not isinstance(x, dict) or len(x) not in (1, 2):
        raise TypeError("malformed value")
    (tag, v), *_ = x.items()
    if tag == "r":
        return resolve(x)
    if tag in _TAGGED:
        return _TAGGED[tag](decode(e, resolve) for e in v)
    if tag == "d":
        return {decode(k, resolve): decode(e, resolve) for k, e in v}
    if tag in ("b", "ba"):
        return (bytes if tag == "b" else bytearray).fromhex(v)
    if tag == "c":
        return complex(float(v[0]), float(v[1]))
    raise TypeError(f"malformed value (tag {tag!r})")


class Channel:
    """One end of the pipe pair: JSON lines of at most ``limit`` bytes, reads bounded by ``deadline`` (monotonic)."""

    def __init__(self, rfd: int, wfd: int, limit: int, deadline: float = float("inf")):
        self.rfd, self.wfd, self.limit, self.deadline = rfd, wfd, limit, deadline
        self.buf = b""

    def send(self, doc) -> None:
        data = dumps(doc).encode() + b"\n"
        while data:
            data = data[os.write(self.wfd, data) :]

    def receive(self):
        """The next document; None at end of file."""
        while self.buf.find(b"\n", 0, self.limit + 1) < 0:  # no line of at most ``limit`` bytes yet
            if len(self.buf) > self.limit:
                raise CandidateError(f"the candidate sent more than {self.limit} bytes at once")
            left = self.deadline - time.monotonic()
            wait = None if left == float("inf") else max(0.0, left)
            if left <= 0 or not select.select([self.rfd], [], [], wait)[0]:
                raise CheckTimeout("the check's time ran out waiting for the candidate")
            chunk = os.read(self.rfd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return loads(line.decode("utf-8"))


def raised(pair) -> BaseException:
    """The candidate's ``[TYPE, MESSAGE]`` as an exception: that built-in (tests may expect it), else CandidateError."""
    kind, message = (list(pair) + ["", ""])[:2] if isinstance(pair, (list, tuple)) else ("CandidateError", pair)
    cls = getattr(builtins, str(kind), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(str(message))
        except Exception:  # noqa: BLE001 - a built-in that wants other arguments (UnicodeDecodeError)
            pass
    return CandidateError(f"{kind}: {message}")


class Remote:
    """The checker's stand-in for an object of the candidate: calling it, or reading an attribute, asks the callee."""

    def __init__(self, link, ref: int, kind: str):
        self.link, self.ref, self.kind = link, ref, kind

    def __call__(self, *args, **kwargs):
        return self.link.request({"call": {"r": self.ref}}, args, kwargs)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self.link.request({"get": {"r": self.ref}, "attr": attr}, (), {})

    def __repr__(self):
        return f"<the candidate's {self.kind}>"


class Link:
    """The checker's side of the conversation with the callee."""

    def __init__(self, channel: Channel):
        self.channel, self.started, self.calls, self.ended = channel, False, 0, False
        self.remotes: dict = {}  # one stand-in per object of the candidate: it is itself, and only itself

    def remote(self, ref: dict) -> Remote:
        key = ref.get("r")
        if not isinstance(key, int):
            raise TypeError("malformed reference")
        return self.remotes.setdefault(key, Remote(self, key, str(ref.get("type", "object"))))

    def expect(self):
        doc = self.channel.receive()
        if doc is None:
            self.ended = True
            raise CandidateError("the candidate's process ended")
        if not isinstance(doc, dict):
            raise CandidateError("the candidate sent something that is not a message")
        return doc

    def wait_loaded(self) -> None:
        """Wait for the callee's ``started`` (sent before any untrusted code ran), then for ``loaded``."""
        self.started = self.expect() == {"started": True}
        if not self.started:
            raise CandidateError("the candidate's jail did not start")
        doc = self.expect()
        if doc.get("loaded") is not True:
            raise raised(doc.get("raise") or "its code did not load")

    def bind(self, namespace: dict, names) -> None:
        """``namespace[name]``: the candidate's value of each name; one it lacks is removed (tests: NameError)."""
        for name in names:
            try:
                namespace[name] = self.request({"resolve": str(name)}, (), {})
            except NameError:
                namespace.pop(name, None)

    def request(self, head: dict, args, kwargs):
        self.calls += 1
        payload = {"args": [encode(a) for a in args], "kwargs": {str(k): encode(v) for k, v in kwargs.items()}}
        self.channel.send({**head, **payload})
        doc = self.expect()
        if "raise" in doc:
            raise raised(doc["raise"])
        if "ok" not in doc:
            raise CandidateError("the candidate's answer has no value")
        for arg, state in zip(args, doc.get("after") or ()):
            if state is not None:
                write_back(arg, decode(state, self.remote))
        return decode(doc["ok"], self.remote)


def write_back(arg, new) -> None:
    """Give the test's argument the contents the candidate left in its copy (same type only)."""
    if type(arg) is not type(new):
        return
    if isinstance(arg, (list, bytearray)):
        arg[:] = new
    elif isinstance(arg, (dict, set)):
        arg.clear()
        arg.update(new)


def serve(channel: Channel, namespace: dict) -> None:
    """The callee's loop: answer each request of the checker until it closes the pipe."""
    refs: dict = {}

    def resolve(ref):
        try:
            return refs[ref["r"]]
        except (KeyError, TypeError):
            raise TypeError("unknown reference") from None

    while True:
        doc = channel.receive()
        if doc is None:
            return
        try:
            args = [decode(a, resolve) for a in doc.get("args", ())]
            kwargs = {k: decode(v, resolve) for k, v in doc.get("kwargs", {}).items()}
            if "resolve" in doc:
                if str(doc["resolve"]) not in namespace:
                    raise NameError(f"name {str(doc['resolve'])!r} is not defined")
                value = namespace[str(doc["resolve"])]
            elif "get" in doc:
                value = getattr(resolve(doc["get"]), str(doc["attr"]))
            else:
                value = resolve(doc["call"])(*args, **kwargs)
            after = [encode(a, refs) if isinstance(a, (list, dict, set, bytearray)) else None for a in args]
            reply = {"ok": encode(value, refs), "after": after}
        except BaseException as e:  # noqa: BLE001 - whatever the candidate raised (SystemExit too) is its answer
            reply = {"raise": [type(e).__name__, str(e)[:2000]]}
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        except BaseException:  # noqa: BLE001
            pass
        channel.send(reply)


def confine(cfg: dict, keep: tuple) -> None:
    """First of all: close every descriptor but the standard three and ``keep`` (bwrap leaves its own open), leave uid
    0 for 65534 where the jail starts this process as root (its user namespace maps both), and set the kernel limits,
    which an unprivileged process cannot raise again."""
    lo = 3
    for fd in sorted(keep):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, os.sysconf("SC_OPEN_MAX"))
    if cfg.get("drop") and os.getuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    import resource

    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def read_stdin() -> str:
    """All of stdin (the program to run), then /dev/null in its place."""
    data = sys.stdin.buffer.read().decode("utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return data


def failure(e: BaseException, sources: dict) -> str:
    """One line for a failed check: the exception and, for an ``assert``, the line of the tests it failed on."""
    text, where = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__), ""
    tb = e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        lines = sources.get(name, "").splitlines()
        if 0 < tb.tb_lineno <= len(lines):
            where = f" ({name} line {tb.tb_lineno}: {lines[tb.tb_lineno - 1].strip()[:200]})"
        tb = tb.tb_next
    return text[:1000] + where


def callee(cfg: dict) -> None:
    """Run the candidate (stdin) and answer the checker's calls; untrusted code runs from ``exec`` on."""
    confine(cfg, (cfg["in"], cfg["out"]))
    source = read_stdin()
    channel = Channel(cfg["in"], cfg["out"], cfg["message_bytes"])
    channel.send({"started": True})
    install_guards(os.getcwd())
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(source, "candidate.py", "exec"), namespace)
        sys.stdout.flush()
    except BaseException as e:  # noqa: BLE001 - its code did not load: that is the answer
        channel.send({"loaded": False, "raise": [type(e).__name__, str(e)[:2000]]})
        linger()
    channel.send({"loaded": True})
    serve(channel, namespace)
    linger()


def _recording_asserts(tests: str):
    """The tests' syntax tree with every ``assert COND`` made ``__espert_assert__(COND, line)``: a failed assertion is
    recorded and the test goes on, so the candidate gets the same calls whatever its earlier answers were and cannot
    tell from the next call arriving which assertion passed.  The verdict is decided once the test ends."""
    import ast

    class Recording(ast.NodeTransformer):
        def visit_Assert(self, node):
            call = ast.Call(ast.Name("__espert_assert__", ast.Load()), [node.test, ast.Constant(node.lineno)], [])
            return ast.copy_location(ast.Expr(call), node)

    return ast.fix_missing_locations(Recording().visit(ast.parse(tests, "tests.py")))


def checker(cfg: dict) -> None:
    """Run trusted code and tests (stdin: ``{"trusted", "tests", "calls"}``): verdict to stdout, prints to stderr."""
    confine(cfg, (cfg["in"], cfg["out"]))
    spec = loads(read_stdin())
    verdict_fd = os.dup(1)
    os.dup2(2, 1)
    link = Link(Channel(cfg["in"], cfg["out"], cfg["message_bytes"], time.monotonic() + cfg["seconds"]))
    verdict = {"passed": False, "status": "failed", "error": ""}
    sources = {"trusted.py": spec["trusted"], "tests.py": spec["tests"]}
    failed: list[int] = []  # the lines of the tests' failed assertions, in order
    try:
        link.wait_loaded()
        namespace = {"__name__": "__main__"}
        exec(compile(spec["trusted"], "trusted.py", "exec"), namespace)
        link.bind(namespace, spec["calls"])
        namespace["__espert_assert__"] = lambda ok, line: ok or failed.append(line)
        exec(compile(_recording_asserts(spec["tests"]), "tests.py", "exec"), namespace)
        verdict.update(passed=not failed, status="failed" if failed else "passed")
    except CheckTimeout as e:
        verdict.update(status="timeout", error=str(e))
    except BaseException as e:  # noqa: BLE001 - a failed test, a failed candidate: the verdict says which
        verdict["error"] = failure(e, sources)
    if failed:  # the first failed assertion is the verdict, whatever the test did after it
        line = spec["tests"].splitlines()[failed[0] - 1].strip()[:200]
        verdict.update(passed=False, status="failed", error=f"AssertionError (tests.py line {failed[0]}: {line})")
    verdict.update(started=link.started, calls=link.calls, ended=link.ended)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(verdict_fd, dumps(verdict).encode() + b"\n")
        linger()


def linger() -> None:
    """Wait to be killed: bwrap's launcher reaps the jail's init and ends last (else the host's init would get it)."""
    import signal

    while True:
        signal.pause()


# ---- the second layer: Python-level guards in the callee --------------------------------------------------
# In the jail they stop the usual hostile shapes early with a clear PermissionError; they are not the
# boundary (a fresh ``posix`` module or ``_io.FileIO`` gets past them).  Without a jail
# (--unsafe-code-reward) they are all there is.
def _deny(name: str):
    def denied(*a, **k):
        raise PermissionError("sandbox: " + name + " is not allowed")

    return denied


def _guard_processes() -> None:
    import _posixsubprocess
    import posix
    import resource

    for n in ("fork", "forkpty", "system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execle",
              "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp",
              "spawnlpe", "posix_spawn", "posix_spawnp", "kill", "killpg", "setsid", "setpgid", "setpgrp",
              "chroot", "pidfd_open"):  # fmt: skip
        for m in (os, posix):
            if hasattr(m, n):
                setattr(m, n, _deny("os." + n))
    _posixsubprocess.fork_exec = _deny("subprocess")
    resource.setrlimit = resource.prlimit = _deny("resource.setrlimit")
    sys.modules.update(ctypes=None, _ctypes=None)


def _path_check(root: str):
    """``check(path, write, dir_fd)``: PermissionError writing outside ``root`` or reading another process's /proc."""
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

    return check


def _guard_files(root: str) -> None:
    import io
    import posix

    check = _path_check(root)
    real_open, real_os_open = builtins.open, os.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_open(file, mode="r", *a, **k):
        check(file, any(c in mode for c in "wax+"))
        return real_open(file, mode, *a, **k)

    def guarded_os_open(path, flags, *a, **k):
        check(path, flags & writes, k.get("dir_fd"))
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
                 ("utime", 1), ("mkfifo", 1), ("mknod", 1), ("removedirs", 1), ("renames", 2)):  # fmt: skip
        if hasattr(os, n):
            g = wrap(getattr(os, n), k)
            setattr(os, n, g)
            if hasattr(posix, n):
                setattr(posix, n, g)


def _guard_network() -> None:
    # socket.py is not imported yet: it subclasses _socket.socket and calls _socket's functions, so patching
    # _socket covers both (and importing socket here would cost ~15 ms a program)
    import _socket

    class NoSocket(_socket.socket):
        __slots__ = ()  # socket.socket adds __weakref__

        def __init__(self, *a, **k):
            raise PermissionError("sandbox: network access is not allowed")

    _socket.socket = _socket.SocketType = NoSocket
    for n in ("socketpair", "dup", "getaddrinfo", "getnameinfo", "gethostbyname", "gethostbyname_ex",
              "gethostbyaddr"):  # fmt: skip
        if hasattr(_socket, n):
            setattr(_socket, n, _deny("network access"))


def install_guards(root: str) -> None:
    """No new process, signal, ctypes or raised rlimit; no write outside ``root``; no other /proc entry; no socket."""
    _guard_processes()
    _guard_files(os.path.realpath(root))
    _guard_network()


if __name__ == "__main__":  # run as ``... -c LOADER CODE ROLE CONFIG`` (espert.jail.python_args)
    {"callee": callee, "checker": checker}[sys.argv[-2]](loads(sys.argv[-1]))
