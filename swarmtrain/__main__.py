"""``python -m swarmtrain`` is the ``swarmtrain`` command."""

import sys

from swarmtrain.cli import main

sys.exit(main())
