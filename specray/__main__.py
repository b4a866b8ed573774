"""`python -m specray generate ...`: the same entry point as the `specray` script."""

import sys

from specray.cli import main

sys.exit(main())
