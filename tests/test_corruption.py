"""The corruption table: damaged checkpoints, logs, config files and base models.

Every row: a finished run directory, one kind of damage, one command.  The command exits non-zero,
prints one line (no traceback) naming the file and the problem, and changes nothing in the run
directory; and nothing completed is lost: a damaged checkpoint is rebuilt from the log by the next
``--resume`` to the exact bits of the undamaged run.
"""

import hashlib
import json
import os
import shutil

import pytest
import torch
from test_runs import assert_same_run, copy_run, damage, make_old_style, one_line_error, reference  # noqa: F401

from espert import runs
from espert.cli import main


def snapshot(d):
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def edit_log_line(d, index, edit):
    """Replace line ``index`` (0-based) of the log by edit(line bytes)."""
    p = os.path.join(d, runs.LOG)
    lines = open(p, "rb").read().split(b"\n")
    lines[index] = edit(lines[index])
    open(p, "wb").write(b"\n".join(lines))


def iter_line(d, t):
    lines = open(os.path.join(d, runs.LOG), "rb").read().split(b"\n")
    return next(i for i, ln in enumerate(lines) if ln.startswith(b'{"kind":"iter","iteration":%d,' % t))


def flip_digit(line):
    i = line.index(b'"coeffs":[') + len(b'"coeffs":[') + 4  # a digit inside the first coefficient
    return line[:i] + bytes([line[i] ^ 1 if line[i] not in b".-e" else line[i]]) + line[i + 1 :]


def text(path, s):
    def f(d):
        with open(path(d), "w") as fh:
            fh.write(s)

    return f


def replace_base_weights(d):
    from espert.tiny import build_tiny_model

    other = d + "-other"
    build_tiny_model(other, seed=7)
    shutil.copyfile(os.path.join(other, "model.safetensors"), os.path.join(d, runs.BASE, "model.safetensors"))


def center(d):
    return os.path.join(d, runs.CENTER)


REPLAY, RESUME = ["replay", "{d}", "--out", "{out}"], ["train", "--run-dir", "{d}", "--resume", "--no-progress"]

# name, damage(d), command, exit code, words the error line must hold
TABLE = [
    (
        "center truncated",
        lambda d: damage(center(d), "truncated"),
        REPLAY,
        1,
        ["center.safetensors", "damaged center checkpoint", "sha256"],
    ),
    (
        "center zero-length",
        lambda d: damage(center(d), "empty"),
        REPLAY,
        1,
        ["center.safetensors", "the file is empty"],
    ),
    (
        "center zeroed block",
        lambda d: damage(center(d), "zeroed"),
        REPLAY,
        1,
        ["center.safetensors", "none of the 3 checkpoint(s) recorded"],
    ),
    (
        "center one bit flipped",
        lambda d: damage(center(d), "flipped"),
        REPLAY,
        1,
        ["center.safetensors", "none of the 3 checkpoint(s) recorded"],
    ),
    (
        "center truncated, run without checksums",
        lambda d: (make_old_style(d), damage(center(d), "truncated")),
        REPLAY,
        1,
        ["center.safetensors", "not a readable safetensors file"],
    ),
    (
        "log: invalid JSON in the middle",
        lambda d: edit_log_line(d, 3, lambda ln: ln[:40]),
        RESUME,
        2,
        ["log.jsonl", "line 4 is damaged", "not valid JSON", "not the last line"],
    ),
    (
        "log: a changed digit in the middle",
        lambda d: edit_log_line(d, iter_line(d, 2), flip_digit),
        RESUME,
        2,
        ["log.jsonl", "is damaged", "checksum mismatch", "espert repair", "--truncate-after 1"],
    ),
    (
        "log: damaged complete last line",
        lambda d: edit_log_line(d, -2, lambda ln: ln.replace(b'"', b"'", 1)),
        RESUME,
        2,
        ["log.jsonl", "is damaged", "(the last line)"],
    ),
    (
        "log: an iteration missing",
        lambda d: edit_log_line(d, iter_line(d, 3), lambda ln: b'{"kind":"note"}'),
        RESUME,
        2,
        ["log.jsonl", "holds iteration 4 where 3 comes next", "espert repair", "--truncate-after 2"],
    ),
    (
        "log: emptied, checkpoint at 6",
        lambda d: open(os.path.join(d, runs.LOG), "wb").close(),
        REPLAY,
        2,
        ["log.jsonl ends at iteration 0", "reached iteration 6"],
    ),
    (
        "config.yaml: invalid YAML",
        text(lambda d: os.path.join(d, runs.CONFIG), "format: [espert\nconfig: {}\n"),
        RESUME,
        2,
        ["config.yaml", "invalid YAML at line"],
    ),
    (
        "config.yaml: not a run config",
        text(lambda d: os.path.join(d, runs.CONFIG), "- 1\n- 2\n"),
        RESUME,
        2,
        ["config.yaml", "not an espert run config"],
    ),
    (
        "--config: invalid YAML",
        text(lambda d: d + ".yaml", "sigma: 0.1\n  population: 4\n"),
        ["train", "--config", "{d}.yaml", "--run-dir", "{d}", "--resume"],
        2,
        [".yaml", "invalid YAML at line 2"],
    ),
    (
        "--config: invalid TOML",
        text(lambda d: d + ".toml", "sigma = 0.1\npopulation = \n"),
        ["train", "--config", "{d}.toml", "--run-dir", "{d}", "--resume"],
        2,
        [".toml", "invalid TOML", "at line 2"],
    ),
    (
        "base model: other weights",
        replace_base_weights,
        RESUME,
        2,
        ["model.safetensors: contents changed", "not the one this run started from"],
    ),
    (
        "base model: config.json edited",
        lambda d: open(os.path.join(d, runs.BASE, "config.json"), "a").write(" "),
        REPLAY,
        2,
        ["config.json: size changed"],
    ),
    (
        "base model: weights deleted",
        lambda d: os.unlink(os.path.join(d, runs.BASE, "model.safetensors")),
        RESUME,
        2,
        ["model.safetensors: missing"],
    ),
]


@pytest.mark.parametrize("name,hurt,argv,code,words", TABLE, ids=[row[0] for row in TABLE])
def test_corruption_table(reference, tmp_path, capsys, name, hurt, argv, code, words):  # noqa: F811
    d = copy_run(reference, tmp_path / "run")
    hurt(d)
    before = snapshot(d)
    out = str(tmp_path / "replayed")
    assert main([a.format(d=d, out=out) for a in argv]) == code
    one_line_error(capsys.readouterr().err, *words)
    assert snapshot(d) == before  # the command changed nothing
    if "center" in name:  # nothing lost: the log rebuilds the exact center
        assert main(["train", "--run-dir", d, "--resume", "--no-progress"]) == 0
        one_line_error(capsys.readouterr().err, "center.safetensors", "rebuilding the center")
        a, _ = runs.load_center(center(reference))
        b, it = runs.load_center(center(d))
        assert it == 6 and all(torch.equal(a[k], b[k]) for k in a)


def test_a_torn_last_line_is_dropped_not_refused(reference, tmp_path):
    """The one damage that is no error: a process killed mid-write leaves a line without its newline; that
    record's update was never applied, so resume drops it and redoes the iteration."""
    d = copy_run(reference, tmp_path / "run")
    p = os.path.join(d, runs.LOG)
    lines = open(p, "rb").read().split(b"\n")
    t = iter_line(d, 6)
    open(p, "wb").write(b"\n".join(lines[:t]) + b"\n" + lines[t][:50])
    os.unlink(center(d))  # and the checkpoint of iteration 6 is gone with it
    shutil.rmtree(os.path.join(d, runs.EXPORT))
    assert main(["train", "--run-dir", d, "--resume", "--no-progress"]) == 0
    assert_same_run(reference, d)


def test_every_record_carries_a_checksum(reference):
    for line in open(os.path.join(reference, runs.LOG), "rb").read().splitlines():
        rec = json.loads(line)
        assert list(rec)[-1] == "crc32" and len(rec["crc32"]) == 8
