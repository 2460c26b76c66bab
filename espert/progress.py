"""Progress for the steps that take minutes without a word: pretraining the tiny model, loading a model,
converting a GGUF file, the closing report, replay and export.

On a terminal (stderr is a TTY) a step shows a tqdm bar when its size is known, else one line that
counts the seconds; in a log (stderr redirected) it shows nothing, so logs keep only the status lines
the commands print.  ``ESPERT_PROGRESS=0`` turns it off, ``=1`` on (whatever stderr is).
Stdlib only at import (tqdm is imported when a bar is shown).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator

#: seconds between two updates of a step whose size is unknown
TICK = 1.0


def shown() -> bool:
    """Whether progress is shown: ESPERT_PROGRESS, else whether stderr is a terminal."""
    forced = os.environ.get("ESPERT_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class _Silent:
    """The bar of a step that shows nothing."""

    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def bar(desc: str, total: int, unit: str = "step", enabled: bool | None = None) -> Iterator:
    """A bar of ``total`` ``unit``s on stderr (call ``.update(n)``), closed when the block ends; nothing
    when progress is not shown (:func:`shown`)."""
    if not (shown() if enabled is None else enabled) or total <= 0:
        yield _Silent()
        return
    from tqdm import tqdm

    with tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False, unit_scale=unit == "B"
    ) as b:
        yield b


@contextlib.contextmanager
def ticking(desc: str, enabled: bool | None = None) -> Iterator[None]:
    """One line ``desc ... N s`` on stderr, rewritten every :data:`TICK` seconds while the block runs (for
    steps whose size is unknown: a model loading, a file converting), erased when it ends."""
    if not (shown() if enabled is None else enabled):
        yield
        return
    stop, t0 = threading.Event(), time.monotonic()

    def tick() -> None:
        while not stop.wait(TICK):
            sys.stderr.write(f"\r{desc} ... {time.monotonic() - t0:.0f} s")
            sys.stderr.flush()

    thread = threading.Thread(target=tick, name="espert-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if time.monotonic() - t0 >= TICK:
            sys.stderr.write("\r" + " " * (len(desc) + 12) + "\r")
            sys.stderr.flush()
