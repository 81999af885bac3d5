"""``python -m hipmla``: see :mod:`hipmla.cli`."""

import sys

from hipmla.cli import main

if __name__ == "__main__":
    sys.exit(main())
