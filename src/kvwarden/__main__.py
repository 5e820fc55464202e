"""``python -m kvwarden``: the command line, for machines where the package is on ``PYTHONPATH`` only."""

import sys

from kvwarden.cli import main

if __name__ == "__main__":  # not when a spawned worker re-imports the parent's main module
    sys.exit(main())
