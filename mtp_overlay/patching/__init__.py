"""Source patches for container builds: ``mtp-overlay patch apply|check|revert``.

``manifest`` reads ``patches/manifest.json`` (measured sha256s), ``locate`` finds the distribution in
the target environment, ``survey`` decides each fix's state on disk from hashes, ``gitapply`` runs
``git apply`` on scratch copies, ``transaction`` writes all-or-nothing under a lock with a journal,
``engine`` ties them together and ``command`` is the CLI. Which patch fits which release, and the
redundancy marker, are each fix's own declaration. Nothing here is imported by ``import mtp_overlay``.
"""
