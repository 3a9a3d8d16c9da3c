"""The suite loads the test bed's pytest plugin (opt-in: it imports the overlay)."""

pytest_plugins = ["mtp_overlay.testing.plugin"]
