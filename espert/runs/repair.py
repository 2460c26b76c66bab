"""``espert repair RUN --truncate-after N``: cut a log that forked (or is damaged) back to one history.

The log is cut after iteration N's records; what it held, and any checkpoint or export of an
iteration after N (or of no iteration the kept log knows), move to ``RUN/repair-STAMP/``, so nothing
is deleted.  The kept log is verified (every line's crc32, iterations 1..N) before it replaces
the old one, and ``--resume`` then continues from iteration N exactly as if the run had stopped
there: from a kept checkpoint, or from the base model and the log.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Callable

from espert.files import CENTER, EXPORT, LOG, RunError, atomic_write, fsync_dir, lock_run, unlock_run
from espert.runs.checkpoint import load_center
from espert.runs.export import export_iteration
from espert.runs.log import checkpoint_hashes, iteration_records, read_log, single_history
from espert.runs.run import read_run_config


def repair(run_dir: str, truncate_after: int, echo: Callable[[str], None] | None = print) -> dict:
    """Keep iterations 1..``truncate_after`` of ``run_dir``'s log and only the checkpoint and export those
    records vouch for; returns ``{"kept", "backup", "moved"}``.  Holds the writer lock.  RunError when
    the log holds no intact single history up to that iteration; nothing is changed then."""
    echo = echo or (lambda s: None)
    if truncate_after < 0:
        raise ValueError(f"--truncate-after must be 0 or more, got {truncate_after}")
    read_run_config(run_dir)  # an espert run directory
    log = os.path.join(run_dir, LOG)
    lock = lock_run(run_dir)
    try:
        size, kept = single_history(log, truncate_after)
        moved = []
        ck = os.path.join(run_dir, CENTER)
        if os.path.exists(ck):
            try:
                _, it = load_center(ck, checkpoint_hashes(kept), lazy=True)
            except RunError:
                it = None
            if it is None or it > truncate_after or not checkpoint_hashes(kept):
                moved.append(CENTER)
        ex = export_iteration(os.path.join(run_dir, EXPORT))
        if ex is not None and ex > truncate_after:
            moved.append(EXPORT)
        backup = os.path.join(run_dir, time.strftime("repair-%Y%m%d-%H%M%S"))
        os.makedirs(backup)
        shutil.copy2(log, os.path.join(backup, LOG))
        with open(os.path.join(backup, LOG), "rb+") as f:
            os.fsync(f.fileno())
        fsync_dir(backup)

        def write(tmp):
            with open(log, "rb") as src, open(tmp, "wb") as dst:
                dst.write(src.read(size))
            its = iteration_records(read_log(tmp), log)  # the kept lines as written, before they replace the log
            if len(its) != truncate_after:
                raise RunError(f"{log}: the kept lines hold {len(its)} iterations, not {truncate_after}")

        atomic_write(log, write)
        for name in moved:  # after the log: an interrupted repair leaves a log that still vouches for them
            os.replace(os.path.join(run_dir, name), os.path.join(backup, name))
        fsync_dir(run_dir)
    finally:
        unlock_run(lock)
    echo(
        f"espert: repaired {run_dir}: {LOG} keeps iterations 1..{truncate_after} ({len(kept)} lines, checksums "
        f"verified){'; moved ' + ', '.join(moved) if moved else ''}; the old files are in {backup}; continue "
        f"with: espert train --run-dir {run_dir} --resume"
    )
    return {"kept": truncate_after, "backup": backup, "moved": moved}
