"""pytest plugin of the test bed, opt-in: ``pytest -p mtp_overlay.bed.plugin`` or, in a conftest,
``pytest_plugins = ["mtp_overlay.bed.plugin"]``.

Loading it imports ``mtp_overlay`` (whose fixes then wait for their targets), so a suite that checks
*stock* upstream behaviour does not load it and stays unpatched. It gives the ``gpu`` marker (skipped
without CUDA; torch is imported only when such a test is collected), ``mtp_run_ranks`` (the
launcher's `run_ranks`) and ``mtp_rank_pools`` (one `RankPool` per layout, shared by the session).
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
    """``mtp_overlay.bed.runtime.launcher.run_ranks``: run a function on freshly spawned Megatron ranks."""
    from .runtime.launcher import run_ranks

    return run_ranks


@pytest.fixture(scope="session")
def mtp_rank_pools():
    """``pools(world_size, tp=1, cp=1, pp=1)``: the session's `RankPool` for that layout (started once)."""
    from .runtime.launcher import RankPool

    pools = {}

    def pool(world_size, tp=1, cp=1, pp=1):
        key = (world_size, tp, cp, pp)
        if key not in pools:
            pools[key] = RankPool(world_size, tp=tp, cp=cp, pp=pp)
        return pools[key]

    yield pool
    for found in pools.values():
        found.close()
