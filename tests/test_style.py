"""Style: `ruff check`, `ruff format --check` and clang-format (csrc/, tests/) pass on the whole tree."""

import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    p = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", ROOT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert "No module named ruff" not in p.stderr, "ruff is a dev requirement: pip install -r requirements-dev.txt"
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_ruff_format_is_clean():
    p = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", ROOT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode == 0, "run `ruff format .`:\n" + p.stdout[-4000:] + p.stderr[-2000:]


def test_clang_format_is_clean():
    exe = shutil.which("clang-format", path=os.path.dirname(sys.executable)) or shutil.which("clang-format")
    assert exe, "clang-format is a dev requirement: pip install -r requirements-dev.txt"
    files = sorted(
        f
        for top in ("csrc", "tests")
        for ext in ("h", "cpp", "cu", "cuh")
        for f in glob.glob(os.path.join(ROOT, top, "**", f"*.{ext}"), recursive=True)
    )
    p = subprocess.run([exe, "--dry-run", "--Werror", *files], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, "run `clang-format -i csrc/**/*.{h,cpp,cu,cuh} tests/**/*.cpp`:\n" + p.stderr[-4000:]
