"""Every command README.md shows runs as printed, the way a newcomer runs it after `bash .ci/setup`.

Documented commands: every line of README.md's ``bash`` blocks, every ``$ `` line of its other blocks,
its ``python`` block, and the blocks of docs/*.md marked ``<!-- documented command -->`` on the line
before them.  Each runs through bash, exactly as printed, in a folder laid out like the checkout
(``configs/``, ``.venv`` -> this interpreter's environment), in the order printed, under
``ESPERT_SMOKE=1`` (espert/config.py: every command on a smoke-test budget, and says so).  What a CPU
machine cannot run is not run, but checked:

- the first screen's two commands (``bash .ci/setup && ...``) are .ci/run's own steps: CI runs them
  verbatim (a second setup, the main job checked against the transcript below it, the test suite);
- a ``pip`` line: .ci/setup installs the same package (and it is installed here);
- a command for a GPU or a Hub model: its flags parse into a valid ESConfig.

Its time, alone under ``nice -n 19`` on 2 cores shared with other jobs (load 14-19): 606 s, of which the
vLLM run on the real model 345 s, compare 78, sweep 67, train 43, eval 29, replay 17, analyze 13, the
Python block 9 (``pytest -s`` prints each command's time)."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- documented command -->"


def blocks(path: Path, marked_only: bool) -> list[tuple[str, str]]:
    """``(language, body)`` of the fenced blocks of ``path`` (only those after MARK when ``marked_only``)."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if not marked_only or (i > 0 and lines[i - 1].strip() == MARK):
                out.append((m.group(1), "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return out


def commands(body: str, transcript: bool) -> list[str]:
    """The commands of a block: its lines (continuations joined, comments dropped), or its ``$ `` lines."""
    joined = re.sub(r"\\\n\s*", "", body)
    if transcript:
        return [line[2:].strip() for line in joined.splitlines() if line.startswith("$ ")]
    return [c for c in (re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()) if c and c[0] != "#"]


def documented() -> list[tuple[str, str]]:
    """``(kind, text)`` in the order printed: kind is ``bash`` or ``python``."""
    out = []
    for path, marked in [(ROOT / "README.md", False)] + [(p, True) for p in sorted((ROOT / "docs").glob("*.md"))]:
        for lang, body in blocks(path, marked):
            if lang == "python":
                out.append(("python", body))
            elif lang in ("bash", "sh") or marked:
                out += [("bash", c) for c in commands(body, transcript=False)]
            else:
                out += [("bash", c) for c in commands(body, transcript=True)]
    return out


def needs_a_gpu_or_the_hub(cmd: str) -> bool:
    return "--device cuda" in cmd or re.search(r"--model [\w-]+/[\w.-]+", cmd) is not None


def check_parses(cmd: str) -> None:
    """A command this machine cannot run: its flags parse into a valid ESConfig ([optional] parts included)."""
    from espert.cli import build_parser, config_from_args

    argv = shlex.split(cmd.replace("[", "").replace("]", ""))
    assert argv[0] == "espert", cmd
    args = build_parser().parse_args(argv[1:])
    config_from_args(args)[0].validate()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A folder laid out like the checkout a newcomer is in, and the environment the commands get."""
    d = tmp_path_factory.mktemp("newcomer")
    (d / "configs").symlink_to(ROOT / "configs")
    (d / ".venv").symlink_to(sys.prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(ESPERT_SMOKE="1", PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    env.setdefault("PYTHONPATH", str(ROOT))  # this checkout's espert, also from .venv/bin/espert
    env.setdefault("ESPERT_CACHE", str(d / "cache"))
    return d, env


def test_the_first_screen_is_what_ci_runs():
    lang, body = blocks(ROOT / "README.md", False)[0]
    first = commands(body, transcript=False)
    assert lang == "bash" and len(first) == 2 and all(c.startswith("bash .ci/setup && ") for c in first), first
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_command 1" in ci and "readme_command 2" in ci  # .ci/run runs both, verbatim


def test_every_documented_command_runs_as_printed(checkout):
    d, env = checkout
    ran = []
    for kind, text in dict.fromkeys(documented()[2:]):  # the first screen: test_the_first_screen_is_what_ci_runs;
        # a command printed twice (README's and docs/training.md's `espert train`) runs once
        if kind == "bash" and text.startswith("pip "):
            pkg = text.split()[-1]
            assert f"--no-deps {pkg}" in (ROOT / ".ci" / "setup").read_text(), text
            continue
        if kind == "bash" and needs_a_gpu_or_the_hub(text):
            check_parses(text)
            continue
        argv = ["bash", "-c", text] if kind == "bash" else [sys.executable, "-c", text]
        start = time.monotonic()
        res = subprocess.run(argv, cwd=d, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"{text}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        assert "Traceback" not in res.stderr, f"{text}\n{res.stderr[-3000:]}"
        ran.append(text.splitlines()[0])
        print(f"{time.monotonic() - start:6.1f} s  {ran[-1][:100]}")  # where this test's minutes go (pytest -s)
    assert any(c.startswith("espert train") for c in ran) and any(c.startswith("espert replay") for c in ran), ran
