"""pytest plugin (entry point ``pytest11: mtp_overlay``): the ``gpu`` marker and ``mtp_run_ranks``.

Loaded by every pytest run of an environment with mtp-overlay installed, so it imports nothing
heavy: torch is imported only when a ``gpu``-marked test is collected.
"""

import pytest

GPU_MARKER = "gpu: needs a CUDA device; skipped without one"


def pytest_configure(config):
    config.addinivalue_line("markers", GPU_MARKER)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def mtp_run_ranks():
    """``mtp_overlay.testing.launcher.run_ranks``: run a function on spawned Megatron ranks."""
    from .launcher import run_ranks

    return run_ranks
