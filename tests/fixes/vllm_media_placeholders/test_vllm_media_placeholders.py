"""vllm-media-placeholders: the bug shows on the installed upstream with the fix off."""

from mtp_overlay.testing.reproducers import reproduce


def test_the_stock_path_shows_the_bug():
    shows, evidence = reproduce('vllm-media-placeholders')
    assert shows, evidence
