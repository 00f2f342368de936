"""``python -m cpshard``: the same as the ``cpshard`` console script."""

import sys

from cpshard.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
