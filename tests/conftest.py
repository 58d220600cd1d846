"""Test configuration: GPU markers skip themselves where the hardware is missing."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MEGAPAR_PG_TIMEOUT", "60")
# Without a GPU, Triton kernels run in its interpreter; Triton reads this once, at first import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if has_cuda else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs >= 2 GPUs")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _fresh_memos():
    """Every test starts with no kept kernel choice (`impl.Memo`): a test that patches what a choice
    reads (a helper, a capability) then sees it worked out again."""
    from megapar.parallel import impl

    impl.clear_memos()
    yield
