"""``python -m regattn.train lm ...`` trains a language model (:mod:`regattn.train.lm`, torchrun-ready);
``python -m regattn.train scaling ...`` runs it on 1 and N processes (:mod:`regattn.train.scaling`);
``python -m regattn.train TASK ...`` trains on a synthetic task (:mod:`regattn.train.cli`)."""
import sys

from regattn.usage import exit_process, run_command

if len(sys.argv) > 1 and sys.argv[1] == "lm":
    from regattn.train.lm import main
    exit_process(run_command("python -m regattn.train lm", main, sys.argv[2:]))
if len(sys.argv) > 1 and sys.argv[1] == "scaling":
    from regattn.train.scaling import main
    exit_process(run_command("python -m regattn.train scaling", main, sys.argv[2:]))
from regattn.train.cli import main
exit_process(run_command("python -m regattn.train", main, sys.argv[1:]))
