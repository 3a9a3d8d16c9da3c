"""Reproducers: each runs one fix's stock upstream code path with the fix off and returns
``(bug_shows, evidence)``."""
