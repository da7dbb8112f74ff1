"""``python -m parabench`` is the same as the ``bench`` console script."""

import sys

from parabench.cli import main

sys.exit(main())
