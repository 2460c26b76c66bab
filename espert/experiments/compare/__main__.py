"""``python -m espert.experiments.compare``: the same command as ``espert compare``."""

import sys

from espert.experiments.compare import main

sys.exit(main())
