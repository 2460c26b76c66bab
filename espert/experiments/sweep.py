"""``espert sweep``: one config over a grid (population × model, σ × α, ...), one normal run directory
per grid point, and the smoothed-reward table and plot of the second seed paper (its Table 6: debiased
exponential smoothing of the training reward, weight 0.99).

    espert sweep --grid population=8,16,32 --grid sigma=0.01,0.02 --iterations 100 --workers 2

takes ``espert train``'s flags (or ``--set KEY=VALUE``) for every run and writes to
``sweeps/population=8,16,32+sigma=0.01,0.02`` (``--out DIR`` chooses another folder).
Every run is an ordinary ``espert train`` process with its own run directory under ``OUT/runs/``, so
each resumes, replays and is evaluated like any other.  Running the same command again resumes what
is unfinished and skips what is done.  A run that fails is reported and the others go on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import typing
from typing import Any, Callable, Optional, Sequence

from espert.extras import require

#: the paper's smoothing weight
SMOOTHING = 0.99


def smooth(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential smoothing: ``s_t = w·s_{t-1} + (1 - w)·x_t`` from ``s_0 = 0``, divided by
    ``1 - w^t`` so that early values are not pulled towards 0 (TensorBoard's smoothing)."""
    out, s = [], 0.0
    for t, x in enumerate(values, 1):
        s = weight * s + (1 - weight) * x
        out.append(s / (1 - weight**t))
    return out


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``["population=8,16", "sigma=0.01"]`` -> ``{"population": ["8", "16"], "sigma": ["0.01"]}``."""
    from espert.config import ESConfig, did_you_mean

    names = set(ESConfig().to_dict())
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ValueError(f"--grid {item!r}: expected KEY=V1,V2,...")
        if key not in names:
            raise ValueError(f"--grid: unknown config key {did_you_mean(key, names)}")
        if key in grid:
            raise ValueError(f"--grid: {key} is given twice")
        grid[key] = [v.strip() for v in values.split(",") if v.strip()]
    if not grid:
        raise ValueError("give at least one --grid KEY=V1,V2,...")
    return grid


def points(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of the grid's values, in the order given."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def point_name(point: dict[str, str]) -> str:
    """A grid point's run directory name, e.g. ``population=8,sigma=0.01`` (``/`` in a value: ``_``)."""
    return ",".join(f"{k}={v.replace('/', '_')}" for k, v in point.items())


def _flags(settings: dict[str, str]) -> list[str]:
    """``espert train`` flags for config values given as strings (booleans and lists by the field's type)."""
    from espert.config import field_type

    out = []
    for k, v in settings.items():
        flag, t = "--" + k.replace("_", "-"), field_type(k)
        if t is bool:
            if v.lower() not in ("true", "false"):
                raise ValueError(f"{k}={v!r}: expected true or false")
            out.append(flag if v.lower() == "true" else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, *v.split()] if typing.get_origin(t) is list else [flag, v]
    return out


def train_argv(run_dir: str, point: dict[str, str], base: dict[str, str], config: Optional[str]) -> list[str]:
    """The ``espert train`` arguments of one grid point (the grid's values over ``--set`` ones)."""
    argv = ["train", "--run-dir", run_dir, "--no-progress", "--no-report"]
    if config:
        argv += ["--config", config]
    return argv + _flags({**base, **point})


def _state(run_dir: str, target: int) -> str:
    """``new``, ``partial`` or ``done`` (the run has ``target`` iterations logged)."""
    from espert.runs import LOG, read_log

    if not os.path.exists(os.path.join(run_dir, LOG)):
        return "new"
    done = max((r["iteration"] for r in read_log(os.path.join(run_dir, LOG)) if r.get("kind") == "iter"), default=0)
    return "done" if done >= target else "partial"


def summarize(run_dir: str) -> dict:
    """A run's training-reward curve (mean member reward per iteration), smoothed, and its held-out means."""
    from espert.runs import LOG, read_log

    recs = read_log(os.path.join(run_dir, LOG)) if os.path.exists(os.path.join(run_dir, LOG)) else []
    reward = [r["reward"]["mean"] for r in recs if r.get("kind") == "iter"]
    held = [(r["iteration"], r["mean"]) for r in recs if r.get("kind") == "eval"]
    sm = smooth(reward)
    return {
        "iterations": len(reward),
        "train_reward": reward,
        "smoothed": sm,
        "final_smoothed": sm[-1] if sm else None,
        "heldout": held,
    }


def run_sweep(
    out: str,
    grid: dict[str, list[str]],
    base: dict[str, str],
    config: Optional[str] = None,
    workers: int = 1,
    echo: Callable[[str], None] = print,
    ray_address: Optional[str] = None,
    train_config: Optional[Callable[[list[str]], Any]] = None,
) -> dict:
    """Train every grid point (``workers`` processes at a time, or as Ray tasks when ``ray_address`` is
    given: ``""`` starts or joins the local Ray, ``"auto"`` a running cluster), then write
    ``sweep.json``, ``sweep.md`` and ``sweep.png`` into ``out``.  Returns the ``sweep.json`` document.

    train_config: ``espert train`` arguments -> their ESConfig (the CLI's own parsing, which it hands
    down: this module sits beside the CLI and does not import it); every point is checked with it
    before any run starts."""
    plan = []
    for point in points(grid):
        run_dir = os.path.join(out, "runs", point_name(point))
        argv = train_argv(run_dir, point, base, config)
        plan.append((point, run_dir, argv, train_config(argv).iterations))
    _refuse_other_settings(out, grid, base, config)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    from espert.files import atomic_write_text

    pending = {point_name(p): {"params": p, "run_dir": d, "status": "pending"} for p, d, _, _ in plan}
    doc = {"grid": grid, "set": base, "config": config, "smoothing": SMOOTHING, "runs": pending}
    atomic_write_text(os.path.join(out, "sweep.json"), json.dumps(doc, indent=2) + "\n")  # a rerun checks it
    status, queue = _pending(plan, echo)
    t0 = time.time()
    logs = {point_name(p): os.path.join(out, "logs", point_name(p) + ".log") for p, _, _, _ in plan}
    launch = _run_on_ray if ray_address is not None else _run_in_processes
    for name, code, seconds in launch(queue, logs, workers, ray_address, echo):
        status[name] = "done" if code == 0 else f"failed (exit {code})"
        echo(f"[sweep] {name}: {status[name]} after {seconds:.0f} s")
    runs = {}
    for point, run_dir, _, _ in plan:
        name = point_name(point)
        runs[name] = {"params": point, "run_dir": run_dir, "status": status[name], **summarize(run_dir)}
    doc = {"grid": grid, "set": base, "config": config, "smoothing": SMOOTHING, "runs": runs}
    doc["seconds"] = round(time.time() - t0, 1)
    atomic_write_text(os.path.join(out, "sweep.json"), json.dumps(doc, indent=2) + "\n")
    _write_table_and_plot(doc, out, echo)
    return doc


def _pending(plan: list, echo) -> tuple[dict[str, str], list]:
    """The points already done ({name: "done"}) and the queue of the others, a partial run resumed."""
    status: dict[str, str] = {}
    queue = []
    for point, run_dir, argv, target in plan:
        state = _state(run_dir, target)
        if state == "done":
            status[point_name(point)] = "done"
            echo(f"[sweep] {point_name(point)}: done already")
        else:
            queue.append((point, run_dir, argv + (["--resume"] if state == "partial" else []), state))
    return status, queue


def _write_table_and_plot(doc: dict, out: str, echo) -> None:
    from espert.extras import have, install_hint
    from espert.files import atomic_write_text

    table = format_table(doc)
    atomic_write_text(os.path.join(out, "sweep.md"), table + "\n")
    echo(table)
    if have("matplotlib"):
        echo(f"[sweep] plot: {plot_sweep(doc, os.path.join(out, 'sweep.png'))}")
    else:
        echo(f"[sweep] plot skipped: {install_hint('matplotlib')}")


def default_out(grid: dict[str, list[str]]) -> str:
    """``sweeps/population=8,16+sigma=0.01,0.02``: a folder per grid, so that the same command resumes it."""
    return os.path.join("sweeps", "+".join(f"{k}={','.join(v).replace('/', '_')}" for k, v in grid.items()))


def _refuse_other_settings(out: str, grid: dict, base: dict, config: Optional[str]) -> None:
    """ValueError when ``out`` holds a sweep of another grid or other settings (its runs would be resumed
    under settings they were not started with); more ``iterations`` extend it (resume takes that)."""
    path = os.path.join(out, "sweep.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    old["set"] = {k: v for k, v in (old.get("set") or {}).items() if k != "iterations"}
    new = {"grid": grid, "set": {k: v for k, v in base.items() if k != "iterations"}, "config": config}
    diff = [f"{k} {old.get(k)} (now {v})" for k, v in new.items() if old.get(k) != v]
    if diff:
        raise ValueError(
            f"{out} holds a sweep with other settings: {'; '.join(diff)}; give --out DIR for a new sweep, or the "
            f"same settings to resume this one"
        )


def _train(argv: list[str], log_path: str) -> int:
    """One grid point: ``espert train`` in a process of its own, its output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.run([sys.executable, "-m", "espert", *argv], stdout=log, stderr=subprocess.STDOUT).returncode


def _run_in_processes(queue, logs, workers, _address, echo):
    """Yield ``(name, exit code, seconds)`` as runs finish, ``workers`` processes at a time."""
    running: list[tuple[str, subprocess.Popen, float]] = []
    queue = list(queue)
    while queue or running:
        while queue and len(running) < workers:
            point, _, argv, state = queue.pop(0)
            name = point_name(point)
            with open(logs[name], "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "espert", *argv], stdout=log, stderr=subprocess.STDOUT)
            running.append((name, proc, time.time()))
            echo(f"[sweep] {name}: {'resumed' if state == 'partial' else 'started'}")
        time.sleep(0.2)
        for item in list(running):
            name, proc, started = item
            if proc.poll() is not None:
                running.remove(item)
                yield name, proc.returncode, time.time() - started


def _run_on_ray(queue, logs, _workers, address, echo):
    """Yield ``(name, exit code, seconds)`` as runs finish, each a Ray task (one CPU) that runs
    :func:`_train` on whichever node Ray picks; run directories must be on storage every node sees."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False)
    task = ray.remote(num_cpus=1)(_train)
    started, futures = time.time(), {}
    for point, _, argv, state in queue:
        name = point_name(point)
        futures[task.remote(argv, logs[name])] = name
        echo(f"[sweep] {name}: {'resumed' if state == 'partial' else 'started'} (Ray task)")
    while futures:
        done, _ = ray.wait(list(futures), num_returns=1)
        for f in done:
            yield futures.pop(f), ray.get(f), time.time() - started


def _cell(run: dict) -> str:
    if run["final_smoothed"] is None:
        return run["status"]
    mark = "" if run["status"] == "done" else f" ({run['status']})"
    return f"{run['final_smoothed']:.3f}{mark}"


def format_table(doc: dict) -> str:
    """Final smoothed training reward per grid point: a pivot for two grid keys, else one row each."""
    grid, runs = doc["grid"], doc["runs"]
    head = f"smoothed training reward (debiased EMA, weight {doc['smoothing']}) at the last iteration"
    keys = list(grid)
    if len(keys) == 2:
        rk, ck = keys
        lines = [head, "", f"| {rk} \\ {ck} | " + " | ".join(grid[ck]) + " |", "|---" * (len(grid[ck]) + 1) + "|"]
        for rv in grid[rk]:
            cells = [_cell(runs[point_name({rk: rv, ck: cv})]) for cv in grid[ck]]
            lines.append(f"| {rv} | " + " | ".join(cells) + " |")
        return "\n".join(lines)
    lines = [head, "", "| " + " | ".join(keys) + " | iterations | smoothed reward | last held-out |"]
    lines.append("|---" * (len(keys) + 3) + "|")
    for run in runs.values():
        held = f"{run['heldout'][-1][1]:.3f}" if run["heldout"] else "-"
        vals = " | ".join(run["params"][k] for k in keys)
        lines.append(f"| {vals} | {run['iterations']} | {_cell(run)} | {held} |")
    return "\n".join(lines)


def plot_sweep(doc: dict, path: str) -> str:
    """The smoothed training-reward curve of every grid point: the first grid key's value picks the
    colour and the second's the line style, so that a 4 × 3 grid stays readable."""
    from espert.eval.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4), dpi=120)
    keys = list(doc["grid"])
    colour = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(doc["grid"][keys[0]])} if keys else {}
    styles = ("-", "--", ":", "-.")
    style = {v: styles[i % len(styles)] for i, v in enumerate(doc["grid"][keys[1]])} if len(keys) > 1 else {}
    curves = {name: run for name, run in doc["runs"].items() if run["smoothed"]}
    for name, run in curves.items():
        point = run.get("params", {})
        curve = run["smoothed"]
        ax.plot(
            range(1, len(curve) + 1),
            curve,
            label=name,
            color=colour.get(point.get(keys[0])) if keys else None,
            linestyle=style.get(point.get(keys[1]), "-") if len(keys) > 1 else "-",
        )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"training reward (smoothed, {doc['smoothing']})")
    ax.set_title(f"sweep over {' × '.join(keys) or 'nothing'}: smoothed training reward per grid point", fontsize=10)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def add_sweep_parser(
    subparsers, train_config: Callable[[list[str]], Any], add_config_flags: Callable[[Any], None]
) -> argparse.ArgumentParser:
    """Add ``espert sweep`` to an argparse ``subparsers`` object; sets ``func``.  train_config: ``espert
    train`` arguments -> ESConfig (see :func:`run_sweep`); add_config_flags: adds train's config flags to a
    parser (the CLI's own; each one given is forwarded to every run)."""
    p = subparsers.add_parser(
        "sweep",
        help="train one config over a grid of values; smoothed-reward table and plot",
        description="\n\n".join(__doc__.split("\n\n")[:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="sweep directory: runs/, logs/, sweep.json/md/png (default: sweeps/KEY=V1,V2+..., from --grid)",
    )
    p.add_argument(
        "--grid", action="append", default=[], metavar="KEY=V1,V2", help="a config field and its values (repeatable)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config field for every run (repeatable)"
    )
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file of config fields under --set and --grid")
    p.add_argument("--workers", type=int, default=1, help="runs trained at once, one process each (default 1)")
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run each grid point as a Ray task instead (no ADDRESS: the local Ray; 'auto': a running cluster, "
        "whose nodes must all see --out); default: local processes",
    )
    add_config_flags(p)
    p.set_defaults(func=run_cli, train_config=train_config)
    return p


def _given_flags(args: argparse.Namespace) -> dict[str, str]:
    """The train flags given on the command line, as ``--set`` strings (their fields' own spelling)."""
    from espert.config import ESConfig

    names = set(ESConfig().to_dict())
    out = {}
    for key, value in vars(args).items():
        if key in names:
            if isinstance(value, bool):
                out[key] = "true" if value else "false"
            elif isinstance(value, list):
                out[key] = " ".join(map(str, value))
            else:
                out[key] = str(value)
    return out


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``espert sweep``: 0 when every run finished, 1 when one failed, 2 on bad input."""
    grid = parse_grid(args.grid)
    base = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        base[key.strip().replace("-", "_")] = value.strip()
    for key, value in _given_flags(args).items():
        if key in base or key in grid:
            raise ValueError(f"{key} is given twice (--{key.replace('_', '-')} and --set or --grid)")
        base[key] = value
    args.out = args.out or default_out(grid)
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    from espert.files import check_output_path

    check_output_path(args.out, "--out")
    if args.ray is not None:
        require("ray", "--ray")
    doc = run_sweep(
        args.out,
        grid,
        base,
        args.config,
        args.workers,
        echo=lambda s: print(s, file=sys.stderr),
        ray_address=args.ray,
        train_config=args.train_config,
    )
    failed = [n for n, r in doc["runs"].items() if r["status"] != "done"]
    if failed:
        print(
            f"espert sweep: {len(failed)} run(s) failed: {', '.join(failed)} (logs in {args.out}/logs)", file=sys.stderr
        )
        return 1
    return 0
