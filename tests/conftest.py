"""The suite loads the test bed's pytest plugin (opt-in: it imports the overlay), shares one rank pool
per parallel layout across its tests (starting ranks is most of a multi-rank test's cost), and
enforces CUDA's device-assert rule on CPU in its own process too (the ranks do it themselves)."""

import os

os.environ.setdefault("MTP_OVERLAY_SHARED_RANKS", "1")

pytest_plugins = ["mtp_overlay.bed.plugin"]


def pytest_configure(config):
    from mtp_overlay.bed.runtime.device import emulate_cuda_asserts

    emulate_cuda_asserts()
