"""``python -m zaya`` runs the ``zaya`` command."""

import sys

from zaya.cli import main

sys.exit(main())
