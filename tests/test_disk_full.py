"""Full disks and failing writes (issue 25): ENOSPC, EDQUOT, EIO or EROFS at every write site of ``espert train``.

Each case fails one write with one line (the file, the errno name, what is intact) and exit code 1, leaves
the run directory byte for byte as it was before that write, and ``--resume`` then ends bit for bit where an
uninterrupted run ends.  The faults come from a file layer around the real one (:class:`Disk`: ``open``,
``os.write``, ``os.sendfile``, ``os.replace``); as root, a real 900 KiB tmpfs fills up too.
"""

import builtins
import errno
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess

import pytest
from conftest import SMALL_RUN as SMALL
from test_runs import FLAGS, assert_same_run, copy_run, one_line_error, reference, sha  # noqa: F401 - a fixture

from espert import runs
from espert.cli import main
from espert.config import ESConfig
from espert.trainer import train


def snapshot(d):
    """Every file under d (temporary ones left out) with its sha256; None when d does not exist.  Midway
    through an export swap the old export is ``export.old-PID/``: it is the export as it was."""
    if not os.path.exists(d):
        return None
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            if ".tmp-" not in p:
                rel = re.sub(r"^export\.old-\d+", "export", os.path.relpath(p, d))
                out[rel] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


class Disk:
    """The real file layer, except that the ``nth`` write (``op`` "write": of a file opened for writing, of
    a log line, of a sendfile copy; ``op`` "replace": a rename onto it) to a path matching ``pattern``
    (temporary ``.tmp-PID`` names stripped) raises OSError(``err``), as a full or broken disk does.
    ``before`` is the run directory just before that write; ``hits`` counts what was seen."""

    def __init__(self, monkeypatch, run_dir, op, pattern, nth, err):
        self.run_dir, self.op, self.pattern, self.nth, self.err = run_dir, op, pattern, nth, err
        self.hits, self.before, self.fired = 0, None, False
        root = os.path.dirname(os.path.abspath(run_dir))
        real_open, real_write, real_sendfile, real_replace = builtins.open, os.write, os.sendfile, os.replace
        disk = self

        class Faulty:  # a file opened for writing: its first write fails when it is the nth such file
            def __init__(self, f, path):
                self._f, self._path, self._seen = f, path, False

            def write(self, b):
                if not self._seen:
                    self._seen = True
                    if disk.match("write", self._path):
                        disk.fail()
                return self._f.write(b)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self._f.__exit__(*exc)

        def fd_path(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return ""

        def fake_open(file, mode="r", *a, **k):
            f = real_open(file, mode, *a, **k)
            if isinstance(file, str) and any(c in mode for c in "wax") and os.path.abspath(file).startswith(root):
                return Faulty(f, file)
            return f

        def fake_write(fd, data):
            if self.match("write", fd_path(fd)):
                self.fail()
            return real_write(fd, data)

        def fake_sendfile(out_fd, in_fd, offset, count):
            if self.match("write", fd_path(out_fd)):
                self.fail()
            return real_sendfile(out_fd, in_fd, offset, count)

        def fake_replace(src, dst, *a, **k):
            if self.match("replace", str(dst)):
                self.fail()
            return real_replace(src, dst, *a, **k)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(os, "write", fake_write)
        monkeypatch.setattr(os, "sendfile", fake_sendfile)
        monkeypatch.setattr(os, "replace", fake_replace)

    def match(self, op, path) -> bool:
        name = re.sub(r"\.tmp-\d+", "", str(path))
        if self.fired or op != self.op or not fnmatch.fnmatch(name, self.pattern):
            return False
        self.hits += 1
        return self.hits == self.nth

    def fail(self):
        self.fired = True
        self.before = snapshot(self.run_dir)
        raise OSError(self.err, os.strerror(self.err))  # as the kernel's: no file name


# (op, path pattern, nth, errno, the file the line names): every place `espert train` writes
SITES = [
    ("write", "*/config.yaml", 1, errno.ENOSPC, "config.yaml"),  # setup
    ("write", "*/log.jsonl", 1, errno.EDQUOT, "log.jsonl"),  # the task record, still in setup
    ("write", "*/log.jsonl", 6, errno.ENOSPC, "log.jsonl"),  # a log line mid-run
    ("write", "*/center.safetensors", 2, errno.EIO, "center.safetensors"),  # the checkpoint of iteration 4
    ("write", "*/export/model.safetensors", 1, errno.ENOSPC, "export/model.safetensors"),
    ("write", "*/export/tokenizer.json", 2, errno.EROFS, "export/tokenizer.json"),  # copied by sendfile
    ("write", "*/export/espert_export.json", 3, errno.ENOSPC, "export/espert_export.json"),
    ("replace", "*/export", 2, errno.EIO, "export"),  # the swap of the second export
]


@pytest.mark.parametrize("op,pattern,nth,err,named", SITES, ids=[f"{s[1][2:]}-{s[2]}" for s in SITES])
def test_a_failed_write_is_one_line_and_the_resume_is_exact(
    reference,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
    op,
    pattern,
    nth,
    err,
    named,
):
    """Before: an OSError traceback (ENOSPC from tensorfile._put), and a log line cut in half by a full disk."""
    d = str(tmp_path / "run")
    disk = Disk(monkeypatch, d, op, pattern, nth, err)
    code = main(["train", "--run-dir", d, *FLAGS])
    monkeypatch.undo()  # space is freed
    assert disk.fired, f"{pattern} was written {disk.hits} times, never a {nth}th time"
    assert code == 1
    ename = errno.errorcode[err]
    out = capsys.readouterr().err
    one_line_error(out, f"cannot write {os.path.join(d, named)}: {ename}")
    assert snapshot(d) == disk.before  # as before that write, and no temporary file is left
    if disk.before is None:
        one_line_error(out, "nothing was written", "run the same command again")
        assert os.listdir(tmp_path) == []
        train(ESConfig(**SMALL), d, progress=False, echo=None)  # the same command (without its closing report)
    else:
        one_line_error(out, "the run directory is as before this write", f"--run-dir {d} --resume")
        assert [n for n in os.listdir(tmp_path) if n != "run"] == []
        train(None, d, resume=True, progress=False, echo=None)
    assert_same_run(reference, d)


@pytest.mark.parametrize("name", ["report.json", "pass_at_k.png"])
def test_a_run_that_cannot_write_its_report_keeps_its_checkpoint(reference, tmp_path, capsys, monkeypatch, name):  # noqa: F811
    """Before: on 1150 KiB of disk the main job ended in a traceback from eval/runner.py writing report.json."""
    d = copy_run(reference, tmp_path / "run")
    disk = Disk(monkeypatch, d, "write", f"*/eval/{name}", 1, errno.ENOSPC)
    code = main(["train", "--run-dir", d, "--resume", "--no-progress"])
    monkeypatch.undo()
    assert disk.fired and code == 1
    one_line_error(
        capsys.readouterr().err,
        f"cannot write {os.path.join(d, 'eval', name)}: ENOSPC",
        "training is complete and intact",
        "last good checkpoint: iteration 6",
        "only the report is missing",
    )
    assert snapshot(d) == disk.before
    assert sha(os.path.join(d, runs.CENTER)) == sha(os.path.join(reference, runs.CENTER))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_real_full_tmpfs_then_resume_is_exact(reference, tmp_path, capsys):  # noqa: F811
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        d = str(mnt / "run")
        subprocess.run(["mount", "-o", "remount,size=120k", str(mnt)], check=True)  # not even the base model fits
        assert main(["train", "--run-dir", d, *FLAGS]) == 1
        one_line_error(capsys.readouterr().err, "base_model/model.safetensors: ENOSPC", "nothing was written")
        assert os.listdir(mnt) == []
        subprocess.run(["mount", "-o", "remount,size=900k", str(mnt)], check=True)  # full at a later write
        assert main(["train", "--run-dir", d, *FLAGS]) == 1
        one_line_error(capsys.readouterr().err, "ENOSPC (No space left on device)", "last good checkpoint: iteration")
        assert not [n for n in os.listdir(d) if ".tmp-" in n or ".old-" in n]
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)  # space is freed
        train(None, d, resume=True, progress=False, echo=None)
        assert_same_run(reference, d)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
