"""Lint: `ruff check` with the rules of pyproject.toml passes on the whole tree."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", ROOT],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "No module named ruff" not in p.stderr, "ruff is a dev requirement: pip install -r requirements-dev.txt"
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
