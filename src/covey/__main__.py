"""``python -m covey``: the ``covey`` command (what launchers such as torchrun run with ``-m covey``)."""

import sys

from covey.cli import main

sys.exit(main())
