"""Reproducers: each runs one fix's stock upstream code path with the fix off.

``<fix_id_with_underscores>.reproduce() -> (bug_shows: bool, evidence: str)``.
"""
