"""hf-modules-cache on stock Ray: an actor handed a trust_remote_code config dies unpickling it."""

from ..models.remote_code import ray_round_trip

from mtp_overlay.fixes.hf_modules_cache import PACKAGE


def reproduce():
    result = ray_round_trip(overlay=False)
    return f"No module named '{PACKAGE}'" in result, f"stock Ray actor given a remote-code config: {result}"
