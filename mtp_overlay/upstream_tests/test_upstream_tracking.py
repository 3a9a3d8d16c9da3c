"""Is each fix still needed on the installed upstream? Measured by running it, never declared (issue #8).

For every fix whose upstream distribution is installed: run the stock code path with the fix off
(`Fix.reproduce`), check that the static probe (`mtp-overlay check`) agrees, and compare both with
what the fix's provenance says for this version. A fix that upstream has absorbed fails here with
the fix, the package and version, and what to do.
"""

import pytest

from mtp_overlay import registry
from mtp_overlay.fix import Verdict, distribution_version
from mtp_overlay.testing.reproducers import reproducer


@pytest.mark.parametrize("name", [fix.name for fix in registry.FIXES])
def test_fix_state_matches_upstream_behaviour(name):
    fix = registry.get(name)
    version = distribution_version(fix.distribution)
    if version is None:
        pytest.skip(f"{fix.distribution} is not installed")
    shows, evidence = reproducer(fix)()
    measured = Verdict.NEEDED if shows else Verdict.REDUNDANT
    static = registry.check([name])[0]
    where = f"{fix.distribution} {version}"
    assert static.state == measured, (
        f"{name}: the probe says {static.state} ({static.reason}) but running stock {where} says "
        f"{measured} ({evidence}): the probe no longer recognises upstream; fix the probe"
    )
    expected = fix.expected_state(version)
    if measured == Verdict.REDUNDANT and expected == Verdict.NEEDED:
        pytest.fail(
            f"{name} is REDUNDANT on {where}: {evidence}. Upstream now carries the fix: set "
            f"first_fixed_release to {version} in the fix's provenance, mark its patches "
            f"'Applied-Upstream: {version}', and drop the patch variant for this release."
        )
    if measured == Verdict.NEEDED and expected == Verdict.REDUNDANT:
        pytest.fail(
            f"{name}: the provenance says upstream fixed it in {fix.provenance.first_fixed_release}, "
            f"yet stock {where} still shows the bug: {evidence}. Correct first_fixed_release."
        )
