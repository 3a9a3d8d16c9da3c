"""One spawned rank pool per parallel layout, shared by the test-bed tests (session-scoped)."""

import pytest
import testbed_cases

from mtp_overlay.bed.runtime.launcher import run_ranks_checked


def run_layout(layout):
    """Every case of the layout's plan on its ranks (stock megatron-core; cases install their fixes)."""
    spec = testbed_cases.LAYOUTS[layout]
    return run_ranks_checked(
        testbed_cases.run_plan, spec["world_size"], tp=spec["tp"], cp=spec["cp"], fixes=[],
        args=(testbed_cases.plan(layout),), timeout=900,
    )


@pytest.fixture(scope="session")
def tp1():
    return run_layout("tp1")


@pytest.fixture(scope="session")
def cp2():
    return run_layout("cp2")


@pytest.fixture(scope="session")
def tp2_sp():
    return run_layout("tp2_sp")


@pytest.fixture(scope="session")
def tp2_cp2_sp():
    return run_layout("tp2_cp2_sp")

