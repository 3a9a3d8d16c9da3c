"""The suite loads the test bed's pytest plugin (opt-in: it imports the overlay), and shares one rank
pool per parallel layout across its tests (starting ranks is most of a multi-rank test's cost)."""

import os

os.environ.setdefault("MTP_OVERLAY_SHARED_RANKS", "1")

pytest_plugins = ["mtp_overlay.testing.plugin"]
