"""The cost of the jail: HumanEval's 164 canonical solutions scored four ways, side by side in one run.

    python bench/sandbox_cost.py                     # 3 rounds, 2 workers
    python bench/sandbox_cost.py --rounds 5 --workers 2 --out sandbox_cost.json

- **plain python**: no sandbox at all, the floor: ``python -S -c PROGRAM`` (solution and tests in one
  program, as HumanEval's harness runs them) per solution, passed when it exits 0;
- **before**: the sandbox before issue 38 (``espert/tasks/sandbox.py`` at ``--before``, read from git): one
  process per solution, program and tests together, a token on stdout as the verdict, Python-level guards,
  ``unshare --net`` as root;
- **checker, unjailed**: today's design without bubblewrap (``--unsafe-code-reward``): a callee process runs
  the solution, a checker process runs the tests and calls it over pipes;
- **checker, jailed**: today's default: the same two processes, each in its own bubblewrap jail.

Every configuration scores the same 164 programs with ``--workers`` at a time (what a reward batch does)
and must pass all 164; the rounds are interleaved so that all four see the same background load, and the
table gives the median.  Then one solution at a time (HumanEval/0, ``--single`` times): the latency of
one check.  The last line says what the jail adds to one ES iteration on HumanEval with the default
population × prompts per iteration (every member scores every prompt).  Say the machine's load with the
numbers: the script prints the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from espert import jail  # noqa: E402
from espert.config import ESConfig  # noqa: E402
from espert.jail import sandbox  # noqa: E402
from espert.tasks import code  # noqa: E402

#: The commit whose sandbox is "before": the branch point of issue 38.
BEFORE = "fdabfa5"


def before_sandbox(rev: str) -> types.ModuleType:
    """The sandbox module as it was at ``rev`` (it imports only the standard library)."""
    src = subprocess.run(
        ["git", "show", f"{rev}:espert/tasks/sandbox.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    mod = sys.modules["sandbox_before"] = types.ModuleType("sandbox_before")  # dataclasses look it up
    exec(compile(src, f"{rev}:espert/tasks/sandbox.py", "exec"), mod.__dict__)
    return mod


def runners(rev: str, limits: sandbox.Limits):
    """name -> fn(list of (completion, answer), workers) -> list of passed flags."""
    old = before_sandbox(rev)
    old_limits = old.Limits(timeout_s=limits.timeout_s, memory_mb=limits.memory_mb)

    def plain(items, workers):
        def one(program):
            argv = [sys.executable, "-S", "-c", program]
            return subprocess.run(argv, capture_output=True, timeout=limits.timeout_s).returncode == 0

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, [code.humaneval_program(c, a) for c, a in items]))

    def before(items, workers):
        programs = [code.humaneval_program(c, a) for c, a in items]
        return [r.passed for r in old.run_programs(programs, old_limits, workers=workers)]

    def checker(jailed: bool):
        def run(items, workers):
            sandbox.allow_unsafe_code(not jailed)
            saved = jail._STATUS
            if not jailed:  # as if bwrap were missing: the same checks, unjailed
                jail._STATUS = jail.JailStatus(False, reason="bench: unjailed")
            try:
                checks = [code.humaneval_check(c, a) for c, a in items]
                return [r.passed for r in sandbox.run_checks(checks, limits, workers=workers)]
            finally:
                jail._STATUS = saved

        return run

    return {
        "plain python": plain,
        "before": before,
        "checker, unjailed": checker(False),
        "checker, jailed": checker(True),
    }


def timed(fn, items, workers) -> float:
    t0 = time.monotonic()
    passed = fn(items, workers)
    took = time.monotonic() - t0
    if not all(passed):
        raise SystemExit(f"{sum(not p for p in passed)} canonical solutions failed")
    return took


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--single", type=int, default=10, help="one-at-a-time checks per configuration")
    p.add_argument("--before", default=BEFORE, help="git revision of the sandbox to compare with")
    p.add_argument("--out", help="write the numbers as JSON")
    args = p.parse_args(argv)
    st = jail.status()
    if not st.available:
        raise SystemExit(f"no jail here: {st.reason}")
    rows = code.humaneval_rows()
    items = [(r["canonical_solution"], code.humaneval_problem(r)[1]) for r in rows]
    run = runners(args.before, code.CODE_LIMITS)
    load0 = os.getloadavg()[0]
    batch = {name: [] for name in run}
    single = {name: [] for name in run}
    for _ in range(args.rounds):
        for name, fn in run.items():
            batch[name].append(timed(fn, items, args.workers))
    for _ in range(args.single):
        for name, fn in run.items():
            single[name].append(timed(fn, items[:1], 1))
    load1 = os.getloadavg()[0]
    return report(args, batch, single, len(items), (load0, load1), st)


def report(args, batch: dict, single: dict, n: int, loads: tuple, st) -> int:
    cpu = _cpu_name()
    print(f"{cpu}, {os.cpu_count()} cores, 1-min load {loads[0]:.1f} before, {loads[1]:.1f} after; {st.line()}")
    print(f"{n} canonical HumanEval solutions, {args.workers} workers, median of {args.rounds} interleaved rounds")
    head = f"{'configuration':<20}{'164 solutions s':>16}{'per solution ms':>17}{'alone ms':>10}"
    print(f"{head}{'vs plain':>10}{'vs before':>11}")
    med = {k: statistics.median(v) for k, v in batch.items()}
    alone = {k: statistics.median(v) for k, v in single.items()}
    for name in batch:
        print(
            f"{name:<20}{med[name]:>16.1f}{1000 * med[name] / n:>17.1f}{1000 * alone[name]:>10.0f}"
            f"{med[name] / med['plain python']:>9.2f}x{med[name] / med['before']:>10.2f}x"
        )
    cfg = ESConfig()
    per_iter = cfg.population * cfg.prompts_per_iteration
    added = per_iter * (med["checker, jailed"] - med["before"]) / n
    jail_only = per_iter * (med["checker, jailed"] - med["checker, unjailed"]) / n
    print(
        f"one ES iteration on HumanEval (population {cfg.population} x {cfg.prompts_per_iteration} prompts = "
        f"{per_iter} checks, {args.workers} workers): +{added:.0f} s against before "
        f"({jail_only:+.0f} s of it the jails, the rest the checker process)"
    )
    if args.out:
        doc = {"cpu": cpu, "cores": os.cpu_count(), "load": loads, "jail": st.line(), "workers": args.workers}
        doc.update(batch_s=batch, single_s=single, added_per_iteration_s=added, checks_per_iteration=per_iter)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
