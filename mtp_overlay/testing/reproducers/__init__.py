"""Reproducers: each runs one fix's stock upstream code path with the fix off.

``mtp_overlay.testing.reproducers.<fix_id_with_underscores>.reproduce() -> (bug_shows, evidence)``.
"""
