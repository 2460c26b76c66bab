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


#: Lines of espert/ per wing (issue 53): growth past a budget is a decision, made by raising it here with a reason.
#: The issue's budgets, met on 2026-12-06 (engine 4,877, quantized weights 2,007, vLLM 5,473, eval 3,475, tasks
#: 1,975, the jail 1,297, 26,770 in all; the largest file 700 lines), with issue 49's GPTQ, AWQ, act-order, Marlin
#: and float-export work inside them.
WINGS = {
    "engine (noise, ops, kernels, center, params, es, update)": (
        ["noise.py", "icdf_table.py", "center.py", "params.py", "es.py", "update.py", "ops/**/*.py", "kernels/**/*.py"],
        5000,
    ),
    "quantized weights": (["quant/**/*.py"], 2050),
    "vLLM": (["vllm/**/*.py"], 5500),
    "eval": (["eval/**/*.py"], 3500),
    "tasks": (["tasks/**/*.py"], 2000),
    "the code jail": (["jail/**/*.py"], 1300),
    "espert/ in all": (["**/*.py"], 27000),
}
MAX_FILE_LINES = 700


def wing_lines(root: str) -> dict[str, int]:
    """Lines of each wing of :data:`WINGS` under ``root``/espert."""
    out = {}
    for wing, (patterns, _) in WINGS.items():
        files = {f for p in patterns for f in glob.glob(os.path.join(root, "espert", p), recursive=True)}
        out[wing] = sum(len(open(f, encoding="utf-8").read().splitlines()) for f in files)
    return out


def test_every_wing_is_within_its_line_budget():
    lines = wing_lines(ROOT)
    over = {w: (n, WINGS[w][1]) for w, n in lines.items() if n > WINGS[w][1]}
    assert not over, f"over budget (lines, budget): {over}; split or delete, or raise the budget with a reason"
    files = glob.glob(os.path.join(ROOT, "espert", "**", "*.py"), recursive=True)
    big = {
        os.path.relpath(f, ROOT): n
        for f in files
        if (n := len(open(f, encoding="utf-8").read().splitlines())) > MAX_FILE_LINES
    }
    assert not big, f"files over {MAX_FILE_LINES} lines: {big}"


def test_the_budget_check_counts_a_wing(tmp_path):
    (tmp_path / "espert" / "vllm").mkdir(parents=True)
    (tmp_path / "espert" / "vllm" / "m.py").write_text("x = 1\n" * 7)
    assert wing_lines(str(tmp_path))["vLLM"] == 7 and wing_lines(str(tmp_path))["espert/ in all"] == 7
