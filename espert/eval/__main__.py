"""``python -m espert.eval [eval|analyze] ...``"""

import sys

from .cli import main

sys.exit(main())
