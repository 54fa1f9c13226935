"""``python -m pdserve.cli ARGS``: the same as the ``pdserve`` console script."""

import sys

from pdserve.cli import main

sys.exit(main())
