"""``python -m regattn ARGS`` runs the ``regattn`` command."""
import sys

from regattn.cli import main

sys.exit(main())
