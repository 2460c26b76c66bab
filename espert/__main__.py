"""``python -m espert`` runs the ``espert`` command line."""

import os
import signal
import sys


def _stopped(signum, frame):
    """A signal while espert imports: nothing was written yet.  Exit here rather than raise, because the signal
    can land inside a C++ callback of an extension's import (torch's), where an exception cannot unwind."""
    said = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    print(f"espert: {said}; nothing was written", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signum)


signal.signal(signal.SIGTERM, _stopped)
sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # a shell's background job ignores it
if sigint:
    signal.signal(signal.SIGINT, _stopped)
from espert.cli import run  # noqa: E402

signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here espert.cli.main says what a signal stopped
if sigint:
    signal.signal(signal.SIGINT, signal.default_int_handler)
run()
