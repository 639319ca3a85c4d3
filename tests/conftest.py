import os
import random
import zlib

import pytest
import torch

from tests.helpers import reseed

# Every run draws new inputs; the seed is printed so that a failing run can be replayed exactly. It goes into
# the environment, so that the workers of a parallel run (pytest -n), started after this import, share it.
SEED = int(os.environ.get("REGATTN_TEST_SEED") or random.SystemRandom().randrange(2**31))
os.environ["REGATTN_TEST_SEED"] = str(SEED)


def pytest_configure(config):
    """In each worker of a parallel run, torch's threads share the cores this process may run on."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


def pytest_report_header(config):
    return f"REGATTN_TEST_SEED={SEED}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus != 0:
        terminalreporter.write_line(f"replay these inputs with REGATTN_TEST_SEED={SEED}")


@pytest.fixture(autouse=True)
def fresh_inputs(request):
    """Per test, a seed from the run's seed and the test's id: one test replays alone as in the suite."""
    seed = zlib.crc32(f"{SEED}:{request.node.nodeid}".encode())
    reseed(seed)
    torch.manual_seed(seed)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpret():
    """Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (set by `make test`)."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device")


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread (spinning threads only slow them down on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
