"""Imports flow one way: the layers of docs/architecture.md, checked on the source with ast.

Every import between espert modules (at module level or inside a function) must go to the same
layer or a lower one, and the import graph must have no cycle.  The only exceptions are the
lazy imports in ALLOWED, each with its reason; an entry that no longer matches an import is an
error too, so the list only shrinks.  Names resolved with ``importlib`` (the evaluator registry,
the lazy attributes of ``espert`` and ``espert.evaluators``) are registered import paths, not
import statements, and are not edges here.  ``python tests/test_layering.py`` prints the module-level
edges and the line counts per layer.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Bottom-up.  A module belongs to the layer of its longest matching prefix ("espert" itself: only the
#: package's __init__).  A new module must be placed here (test_every_module_has_a_layer).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("config", ("espert", "espert.config", "espert.extras")),
    (
        "noise",
        (
            "espert.noise",
            "espert.icdf_table",  # data only: the noise spec's gaussian-icdf table
            "espert.quant.formats",
            "espert.quant.reference",
            "espert.tasks",
            "espert.jail",  # the code jail: stdlib only
            "espert.update",  # one ES update (numpy only)
            "espert.tiny",
            "espert.progress",  # bars and ticking lines on a terminal: stdlib (tqdm when shown)
            "espert.tensorfile",
            "espert.files",  # atomic writes: stdlib only (vLLM's drop-in writes its files with them)
            "espert.vllm.patches",  # patches of vLLM internals: vLLM and torch only
        ),
    ),
    # the kernels read the plan that ops builds; ops calls them, never the other way
    ("kernels", ("espert._C", "espert._build", "espert.kernels")),
    ("ops", ("espert.ops", "espert.quant.ops", "espert.environment")),
    (
        "params/center",
        (
            "espert.params",
            "espert.center",
            "espert.quant",
            "espert.quant.center",
            "espert.quant.model",
            "espert.diagnostics",
            "espert.vllm.wire",  # the driver <-> worker format
        ),
    ),
    # the worker side of vLLM (and the class paths users write, which forward to it)
    ("vllm engine", ("espert.vllm.engine", "espert.vllm.worker", "espert.vllm.compat")),
    ("evaluators", ("espert.evaluators", "espert.vllm", "espert.vllm.driver")),
    ("es", ("espert.es", "espert.randopt")),
    ("runs", ("espert.runs",)),
    ("train", ("espert.trainer", "espert.tracking")),
    (
        "cli/eval",
        ("espert.cli", "espert.__main__", "espert.eval", "espert.experiments"),
    ),
]

#: (importer, imported) -> why this lazy import may go up a layer or close a cycle.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "espert.vllm.patches.compile_key",
        "espert.environment",
    ): "the commit in vLLM's compile-cache key, as `espert env` reports it",
}


def layer_of(mod: str) -> int:
    best, idx = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or (p != "espert" and mod.startswith(p + "."))) and len(p) > best:
                best, idx = len(p), i
    assert idx is not None, f"{mod} is in no layer of tests/test_layering.py: add it where it belongs"
    return idx


def modules() -> dict[str, str]:
    """Module name -> source path, for everything under espert/."""
    out = {}
    base = os.path.join(ROOT, "espert")
    for dirpath, _, files in os.walk(base):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(["espert", *rel])] = os.path.join(dirpath, f)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(mod: str, path: str, known: set[str]) -> list[tuple[str, bool, int]]:
    """``(imported module, lazy, line)`` for each espert import in ``path`` (TYPE_CHECKING blocks skipped)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_pkg = path.endswith("__init__.py")
    package = mod if is_pkg else mod.rpartition(".")[0]
    out = []

    def resolve(name: str) -> str | None:
        while name and name not in known and name != "espert._C":
            name = name.rpartition(".")[0]
        return name or None

    def visit(node, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for n in child.orelse:
                    visit(n, lazy)
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.startswith("espert"):
                        out.append((resolve(a.name), lazy, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1])
                    src = f"{base}.{child.module}" if child.module else base
                else:
                    src = child.module or ""
                if not src.startswith("espert"):
                    continue
                for a in child.names:  # `from espert import ops` names a submodule
                    sub = f"{src}.{a.name}"
                    out.append((sub if sub in known or sub == "espert._C" else resolve(src), lazy, child.lineno))
            else:
                visit(child, inner)

    visit(tree, False)
    return [(m, lazy, line) for m, lazy, line in out if m and m != mod]


def graph():
    mods = modules()
    known = set(mods)
    edges = []  # (src, dst, lazy, line)
    for m, p in sorted(mods.items()):
        for dst, lazy, line in imports(m, p, known):
            edges.append((m, dst, lazy, line))
    return mods, edges


def find_cycle(nodes, adj) -> list[str] | None:
    color, stack = {}, []

    def dfs(u):
        color[u] = 1
        stack.append(u)
        for v in sorted(adj.get(u, ())):
            if color.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if not color.get(v):
                c = dfs(v)
                if c:
                    return c
        stack.pop()
        color[u] = 2
        return None

    for n in sorted(nodes):
        if not color.get(n):
            c = dfs(n)
            if c:
                return c
    return None


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)


def test_imports_go_down_and_have_no_cycle():
    mods, edges = graph()
    problems = []
    adj = defaultdict(set)
    used = set()
    for src, dst, lazy, line in edges:
        allowed = (src, dst) in ALLOWED
        if allowed:
            used.add((src, dst))
            if not lazy:
                problems.append(f"{src}:{line} imports {dst} at module level; ALLOWED only covers lazy imports")
            continue
        if lazy and dst.startswith(src + ".") and mods[src].endswith("__init__.py"):
            continue  # a package re-exporting its own submodule on first access (PEP 562 __getattr__)
        adj[src].add(dst)
        if layer_of(dst) > layer_of(src):
            problems.append(
                f"{src}:{line} ({LAYERS[layer_of(src)][0]}) imports {dst} ({LAYERS[layer_of(dst)][0]}), a higher layer"
            )
    cycle = find_cycle(mods, adj)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    stale = sorted(set(ALLOWED) - used)
    if stale:
        problems.append(f"ALLOWED entries that match no import any more (delete them): {stale}")
    assert not problems, "\n".join(problems)


def test_help_imports_neither_torch_nor_the_extension():
    code = (
        "import sys\nfrom espert.cli import main\n"
        "for argv in (['--help'], ['train', '--help'], ['replay', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'espert._C')))\n"
        "print('LOADED', bad)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "LOADED []" in p.stdout, p.stdout[-500:]


def report() -> str:
    """Module-level edges and line counts per layer (the issue's before/after table)."""
    mods, edges = graph()
    lines = ["module-level import edges (src -> dst):"]
    lines += [f"  {s} -> {d}" for s, d, lazy, _ in sorted(set((s, d, lz, 0) for s, d, lz, _ in edges)) if not lazy]
    counts = defaultdict(int)
    for m, p in mods.items():
        with open(p, encoding="utf-8") as f:
            counts[layer_of(m)] += sum(1 for _ in f)
    lines.append("lines per layer:")
    lines += [f"  {LAYERS[i][0]:14s} {counts[i]}" for i in range(len(LAYERS))]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(report())
