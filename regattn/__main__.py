"""``python -m regattn ARGS`` runs the ``regattn`` command."""
from regattn.cli import run

run()
