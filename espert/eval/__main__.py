"""``python -m espert.eval [eval|analyze] ...``: ``espert eval`` (implied when no sub-command is given) and
``espert analyze``, through espert's one CLI (:data:`espert.cli.COMMANDS`)."""

import sys

from espert.cli import main

argv = sys.argv[1:]
if not argv or argv[0] not in ("eval", "analyze", "-h", "--help"):
    argv = ["eval", *argv]
sys.exit(main(argv, owns_process=True))
