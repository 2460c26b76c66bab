"""``python -m espert`` runs the ``espert`` command line."""

import os
import sys

try:
    from espert.cli import run
except KeyboardInterrupt:  # Ctrl-C while Python imports: one line and exit code 130, as in run()
    print("espert: interrupted", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)
run()
