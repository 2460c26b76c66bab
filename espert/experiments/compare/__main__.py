"""``python -m espert.experiments.compare``: ``espert compare``, through espert's one CLI."""

import sys

from espert.cli import main

sys.exit(main(["compare", *sys.argv[1:]], owns_process=True))
