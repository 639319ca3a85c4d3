import os

import pytest
import torch


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
