"""GPU tests: skipped on machines without CUDA (every test in this directory)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")
