"""``python -m regattn ARGS`` runs the ``regattn`` command."""
from regattn.cli import main
from regattn.usage import exit_process

exit_process(main())
