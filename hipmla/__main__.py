import sys

from hipmla.cli import main

sys.exit(main())
