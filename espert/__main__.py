"""``python -m espert`` runs the ``espert`` command line."""

import sys

try:
    from espert.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports: one line, as in main()
    print("espert: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
