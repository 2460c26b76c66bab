"""``python -m espert`` runs the ``espert`` command line."""

import sys

from espert.cli import main

sys.exit(main())
