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


MAX_FUNCTION_LINES = 60


def long_functions(root, limit=MAX_FUNCTION_LINES):
    """Functions under root/espert longer than limit lines (def to last line, docstring included)."""
    import ast

    found = []
    for path in sorted(glob.glob(os.path.join(root, "espert", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = node.end_lineno - node.lineno + 1
                if span > limit:
                    found.append(f"{os.path.relpath(path, root)}:{node.lineno} {node.name} ({span} lines)")
    return found


def test_no_function_over_sixty_lines():
    assert long_functions(ROOT) == [], "split these (a reader should see a function whole)"


def test_the_length_check_finds_a_long_function(tmp_path):
    (tmp_path / "espert").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "espert" / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}")
    assert long_functions(str(tmp_path)) == [f"espert/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
