"""``python -m minipaged``: the command line (``entrypoints/cli.py``)."""

import sys

from minipaged.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
