"""Source patches for container builds (issue #7): ``mtp-overlay patch apply|check|revert``.

``manifest`` reads ``patches/manifest.json`` (variants, version ranges, measured sha256s), ``locate``
finds the distribution in the target environment, ``engine`` surveys and patches all-or-nothing,
``command`` is the CLI. Nothing here is imported by ``import mtp_overlay``.
"""
