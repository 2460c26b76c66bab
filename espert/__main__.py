"""``python -m espert`` runs the ``espert`` command line."""

import os
import signal
import sys


def _terminated(signum, frame):  # SIGTERM before espert.cli.main takes over: nothing was written yet
    print("espert: terminated (SIGTERM); nothing was written", file=sys.stderr)
    sys.stderr.flush()
    os._exit(143)


signal.signal(signal.SIGTERM, _terminated)
try:
    from espert.cli import run
except KeyboardInterrupt:  # Ctrl-C while Python imports: one line and exit code 130, as in run()
    print("espert: interrupted; nothing was written", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here espert.cli.main says what a signal stopped
run()
