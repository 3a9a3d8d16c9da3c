"""Upstream-tracking tests, shipped with the package: run them against your own pins with
``pytest --pyargs mtp_overlay.upstream_tests``."""
